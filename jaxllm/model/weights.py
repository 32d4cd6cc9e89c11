"""Checkpoints: HuggingFace safetensors in and out, Orbax in and out, and `load_model` over both and presets.

HF tensor names map onto the layout documented in model.py:
  model.embed_tokens.weight                  [V, D]        -> embedding [V, D]
  model.layers.{i}.self_attn.q_proj.weight   [Hq*hd, D]    -> layers[i].attention.qkv[:, :, :G]  [D, Hkv, G, hd]
                                                              (transpose, reshape; G = Hq // Hkv)
  model.layers.{i}.self_attn.k/v_proj.weight [Hkv*hd, D]   -> qkv[:, :, G] / qkv[:, :, G + 1]  [D, Hkv, 1, hd]
  model.layers.{i}.self_attn.o_proj.weight   [D, Hq*hd]    -> layers[i].attention.o [Hq, hd, D]
  model.layers.{i}.mlp.gate/up_proj.weight   [F, D]        -> layers[i].mlp.gate_up[:, 0 / 1] [D, F]
  model.layers.{i}.mlp.down_proj.weight      [D, F]        -> layers[i].mlp.down [F, D]
  model.layers.{i}.input_layernorm.weight / post_attention_layernorm.weight -> input_norm / post_attention_norm
  model.norm.weight -> final_norm.weight;  lm_head.weight [V, D] -> lm_head [D, V] (absent when tied)
HF's q/k projections are already in the rotate-half order our RoPE uses, so no permutation.

Loading builds the model's structure without allocating (abstract_model), then reads one tensor at a
time from a memory map, puts it on the device and converts it there, so neither host nor device ever
holds two copies of the weights.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import struct
import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from jaxllm.model.config import PRESETS, ConfigError, LlamaConfig, preset
from jaxllm.model.llama import Llama, abstract_model, init_model
from jaxllm.progress import Progress
from jaxllm.model.rope import inverse_frequencies

MODEL_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
_DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
_SAFETENSORS_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "F64": np.float64}
_SINGLE_FILE = "model.safetensors"
_INDEX_FILE = "model.safetensors.index.json"
_SHARD_RE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
_ORBAX_MARKER = "jaxllm_config.json"
# 2: fused q/k/v and gate/up Params (model.py). Version 1 checkpoints kept them separate.
_ORBAX_LAYOUT_VERSION = 2
_ORBAX_PARAMS = "params"
_TOKENIZER_FILES = ("tokenizer.model", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "generation_config.json")
_MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit


class CheckpointError(ValueError):
    """A checkpoint directory is missing, malformed, or does not fit its config."""


def resolve_dtype(dtype) -> jnp.dtype | None:
    """None, 'float32' / 'bfloat16' / 'float16' (or bf16/fp16/fp32), or a dtype -> a model dtype (or None)."""
    if dtype is None:
        return None
    if isinstance(dtype, str):
        name = _DTYPE_ALIASES.get(dtype.lower(), dtype.lower())
        if name not in MODEL_DTYPES:
            raise ValueError(f"dtype {dtype!r} is not supported; use one of {sorted(MODEL_DTYPES)}")
        return jnp.dtype(MODEL_DTYPES[name])
    try:
        resolved = jnp.dtype(dtype)
    except TypeError as e:
        raise ValueError(f"dtype {dtype!r} is not a dtype; use one of {sorted(MODEL_DTYPES)}") from e
    if resolved.name not in MODEL_DTYPES:
        raise ValueError(f"dtype {resolved.name!r} is not supported; use one of {sorted(MODEL_DTYPES)}")
    return resolved


# ----- the name map -----


@dataclasses.dataclass(frozen=True)
class _Entry:
    path: tuple  # nnx state path, e.g. ("layers", 0, "attention", "qkv")
    hf_name: str
    hf_shape: tuple[int, ...]
    transpose: bool  # HF stores Linear weights [out, in]; we keep [in, ...out]
    # Where the tensor sits in a fused Param: (axis, start, size) along that axis; None = the whole Param.
    part: tuple[int, int, int] | None = None

    def part_shape(self, param_shape: tuple[int, ...]) -> tuple[int, ...]:
        if self.part is None:
            return param_shape
        axis, _, size = self.part
        return param_shape[:axis] + (size,) + param_shape[axis + 1:]

    def take(self, param: jax.Array) -> jax.Array:
        """This entry's slice of the Param."""
        if self.part is None:
            return param
        axis, start, size = self.part
        return jax.lax.slice_in_dim(param, start, start + size, axis=axis)


def _layout(config: LlamaConfig) -> list[_Entry]:
    D, F, V = config.hidden_size, config.intermediate_size, config.vocab_size
    Hq, Hkv = config.num_heads, config.num_kv_heads
    G = Hq // Hkv  # qkv is grouped per KV head: [D, Hkv, G + 2, hd]
    q_out, kv_out = Hq * config.head_dim, Hkv * config.head_dim
    entries = [_Entry(("embedding",), "model.embed_tokens.weight", (V, D), False)]
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        qkv, gate_up = ("layers", i, "attention", "qkv"), ("layers", i, "mlp", "gate_up")
        entries += [
            _Entry(("layers", i, "input_norm", "weight"), p + "input_layernorm.weight", (D,), False),
            _Entry(qkv, p + "self_attn.q_proj.weight", (q_out, D), True, (2, 0, G)),
            _Entry(qkv, p + "self_attn.k_proj.weight", (kv_out, D), True, (2, G, 1)),
            _Entry(qkv, p + "self_attn.v_proj.weight", (kv_out, D), True, (2, G + 1, 1)),
            _Entry(("layers", i, "attention", "o"), p + "self_attn.o_proj.weight", (D, q_out), True),
            _Entry(("layers", i, "post_attention_norm", "weight"), p + "post_attention_layernorm.weight", (D,), False),
            _Entry(gate_up, p + "mlp.gate_proj.weight", (F, D), True, (1, 0, 1)),
            _Entry(gate_up, p + "mlp.up_proj.weight", (F, D), True, (1, 1, 1)),
            _Entry(("layers", i, "mlp", "down"), p + "mlp.down_proj.weight", (D, F), True),
        ]
    entries.append(_Entry(("final_norm", "weight"), "model.norm.weight", (D,), False))
    if not config.tie_word_embeddings:
        entries.append(_Entry(("lm_head",), "lm_head.weight", (V, D), True))
    return entries


def _ignored(name: str, config: LlamaConfig) -> bool:
    # inv_freq is recomputed from the config; tied checkpoints sometimes store a copy of the embedding.
    return name.endswith("rotary_emb.inv_freq") or (config.tie_word_embeddings and name == "lm_head.weight")


def _to_ours_impl(x, transpose, shape, dtype):
    x = x.T if transpose else x  # [out, in] -> [in, out], then split heads: [D, H*hd] -> [D, H, hd]
    return x.reshape(shape).astype(dtype)


def _to_hf_impl(x, transpose, hf_shape):
    return x.reshape(hf_shape[::-1]).T if transpose else x.reshape(hf_shape)


# Jitted so the transpose and cast run on the device, one tensor at a time; one compile per distinct shape.
_to_ours = jax.jit(_to_ours_impl, static_argnums=(1, 2, 3))
_to_hf = jax.jit(_to_hf_impl, static_argnums=(1, 2))


# ----- safetensors reading (own header parser: safetensors' numpy reader cannot return bfloat16) -----


@dataclasses.dataclass(frozen=True)
class _StoredTensor:
    file: str
    dtype: str  # safetensors code: F32, BF16, ...
    shape: tuple[int, ...]
    begin: int  # absolute byte offsets in the file
    end: int


def _read_header(path: str) -> dict[str, _StoredTensor]:
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CheckpointError(f"{path}: {size} bytes is too short for a safetensors file")
        (n,) = struct.unpack("<Q", raw)
        if n > min(_MAX_HEADER_BYTES, size - 8):
            raise CheckpointError(f"{path}: header length {n} exceeds the file size {size} or {_MAX_HEADER_BYTES}")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path}: malformed safetensors header: {e}") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: safetensors header is not a JSON object")
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = (int(v) + 8 + n for v in info["data_offsets"])
            stored = _StoredTensor(path, str(info["dtype"]), tuple(int(d) for d in info["shape"]), begin, end)
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{path}: malformed header entry for tensor {name}: {info!r}") from e
        if not (8 + n <= begin <= end <= size):
            raise CheckpointError(f"{path}: tensor {name} bytes [{begin}, {end}) lie outside the file ({size} bytes)")
        out[name] = stored
    return out


def _read_tensor(stored: _StoredTensor, name: str) -> np.ndarray:
    """The tensor as a fresh host array (copied out of the map: the file may be rewritten later).

    load_hf has checked its dtype code against _SAFETENSORS_DTYPES already.
    """
    dtype = np.dtype(_SAFETENSORS_DTYPES[stored.dtype])
    expected = int(np.prod(stored.shape, dtype=np.int64)) * dtype.itemsize
    if stored.end - stored.begin != expected:
        raise CheckpointError(f"tensor {name} in {stored.file}: {stored.end - stored.begin} bytes stored, "
                              f"{expected} expected for {stored.dtype}{list(stored.shape)}")
    if expected == 0:
        return np.zeros(stored.shape, dtype)
    mapped = np.memmap(stored.file, dtype=np.uint8, mode="r", offset=stored.begin, shape=(expected,))
    return np.array(mapped.view(dtype).reshape(stored.shape))


def _index_checkpoint(model_dir: str) -> dict[str, _StoredTensor]:
    """HF tensor name -> where it is stored, over a single file, an indexed shard set or bare shards."""
    index_path = os.path.join(model_dir, _INDEX_FILE)
    if os.path.isfile(index_path):
        try:
            with open(index_path) as f:
                weight_map = json.load(f)["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not an object")
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index_path}: malformed index ({e})") from e
        headers = {}
        for file in sorted(set(weight_map.values())):
            path = os.path.join(model_dir, str(file))
            if not os.path.isfile(path):
                raise CheckpointError(f"{index_path} references shard {file!r}, which does not exist in {model_dir}")
            headers[file] = _read_header(path)
        out = {}
        for name, file in weight_map.items():
            if name not in headers[file]:
                raise CheckpointError(f"{index_path} places tensor {name} in {file}, which does not contain it")
            out[name] = headers[file][name]
        return out
    if os.path.isfile(os.path.join(model_dir, _SINGLE_FILE)):
        files = [_SINGLE_FILE]
    else:
        files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not files:
        raise CheckpointError(f"no safetensors files in {model_dir} (expected {_SINGLE_FILE} or "
                              f"model-0000x-of-0000y.safetensors with {_INDEX_FILE})")
    out = {}
    for file in files:
        for name, stored in _read_header(os.path.join(model_dir, file)).items():
            if name in out:
                raise CheckpointError(f"tensor {name} is stored twice: in {out[name].file} and {stored.file}")
            out[name] = stored
    return out


def _checkpoint_dtype(raw_config: dict, stored: dict[str, _StoredTensor]) -> jnp.dtype:
    for key in ("torch_dtype", "dtype"):
        name = raw_config.get(key)
        if isinstance(name, str) and name in MODEL_DTYPES:
            return jnp.dtype(MODEL_DTYPES[name])
    # load_hf has checked every tensor's dtype code, the embedding's included.
    dtype = jnp.dtype(_SAFETENSORS_DTYPES[stored["model.embed_tokens.weight"].dtype])
    return dtype if dtype.name in MODEL_DTYPES else jnp.dtype(jnp.float32)


def _read_hf_config(model_dir: str) -> tuple[dict, LlamaConfig]:
    if not os.path.isdir(model_dir):
        raise CheckpointError(f"checkpoint directory {model_dir} does not exist")
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise CheckpointError(f"no config.json in {model_dir}")
    try:
        with open(path) as f:
            raw = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is malformed: {e}") from e
    try:  # from_hf checks the contents (a JSON object, a Llama); the error gains the file's path here
        return raw, LlamaConfig.from_hf(raw)
    except ConfigError as e:
        raise CheckpointError(f"{path}: {e}") from e


# ----- building a model from loaded arrays -----


def _value(variable: nnx.Variable) -> jax.Array:
    # get_value() in newer Flax; .value in older releases (and deprecated in newer ones).
    return variable.get_value() if hasattr(variable, "get_value") else variable.value


def _assemble(config: LlamaConfig, dtype, load_one) -> Llama:
    """A Llama whose every Param comes from load_one(path, shape, dtype) and whose inv_freq is computed."""
    graphdef, params, rest = nnx.split(abstract_model(config, dtype=dtype), nnx.Param, ...)
    values = {}
    for path, variable in nnx.to_flat_state(params):
        target = _value(variable)
        values[path] = load_one(path, tuple(target.shape), target.dtype)
    rest_values = {}
    for path, _ in nnx.to_flat_state(rest):
        if path != ("inv_freq",):  # a new non-Param variable needs a rule here, not a silent zero
            raise NotImplementedError(f"no rule to compute model variable {'.'.join(map(str, path))}")
        rest_values[path] = jnp.asarray(inverse_frequencies(config), jnp.float32)
    nnx.replace_by_pure_dict(params, _unflatten(values))
    nnx.replace_by_pure_dict(rest, _unflatten(rest_values))
    return nnx.merge(graphdef, params, rest)


def _unflatten(flat: dict[tuple, object]) -> dict:
    nested: dict = {}
    for path, value in flat.items():
        node = nested
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return nested


def param_arrays(model: Llama) -> dict[tuple, jax.Array]:
    """Every Param of the model by its nnx path, e.g. ("layers", 0, "attention", "q") -> [D, Hq, hd]."""
    params = nnx.state(model, nnx.Param)
    return {path: _value(v) for path, v in nnx.to_flat_state(params)}


def _model_dtype(arrays: dict[tuple, jax.Array]) -> jnp.dtype:
    """The model's dtype, from param_arrays' result."""
    return jnp.dtype(arrays[("embedding",)].dtype)


# ----- HuggingFace safetensors -----


def load_hf(model_dir: str | os.PathLike, *, dtype=None, progress: bool = True) -> Llama:
    """Load a HuggingFace Llama checkpoint (config.json + safetensors, single or sharded).

    dtype: None keeps the checkpoint's dtype (config.json torch_dtype, else the tensors');
    'float32' / 'bfloat16' / 'float16' converts each tensor on the device as it arrives.
    """
    model_dir = os.fspath(model_dir)
    raw_config, config = _read_hf_config(model_dir)
    stored = _index_checkpoint(model_dir)
    layout = _layout(config)
    parts_of: dict[tuple, list[_Entry]] = {}
    for e in layout:
        parts_of.setdefault(e.path, []).append(e)
    missing = [e.hf_name for e in layout if e.hf_name not in stored]
    if missing:
        raise CheckpointError(f"{model_dir}: {len(missing)} tensors missing, e.g. {missing[:5]}")
    expected_names = {e.hf_name for e in layout}
    unexpected = sorted(n for n in stored if n not in expected_names and not _ignored(n, config))
    if unexpected:
        warnings.warn(f"{model_dir}: ignoring {len(unexpected)} unexpected tensors, e.g. {unexpected[:5]}")
    for e in layout:
        got = stored[e.hf_name]
        if got.shape != e.hf_shape:
            raise CheckpointError(f"tensor {e.hf_name}: expected shape {list(e.hf_shape)}, got {list(got.shape)}")
        if got.dtype not in _SAFETENSORS_DTYPES:
            raise CheckpointError(f"tensor {e.hf_name} has dtype {got.dtype}, which is not supported; "
                                  f"supported: {sorted(_SAFETENSORS_DTYPES)}")
    dtype = resolve_dtype(dtype) or _checkpoint_dtype(raw_config, stored)
    total = sum(stored[e.hf_name].end - stored[e.hf_name].begin for e in layout)

    with Progress(total, f"loading {os.path.basename(os.path.normpath(model_dir))}", unit="B",
                  enabled=progress) as bar:
        def load_part(entry, shape, target_dtype):
            info = stored[entry.hf_name]
            host = _read_tensor(info, entry.hf_name)
            out = _to_ours(jax.device_put(host), entry.transpose, entry.part_shape(shape), jnp.dtype(target_dtype))
            del host
            bar.update(info.end - info.begin, detail=entry.hf_name)
            return out

        def load_one(path, shape, target_dtype):
            parts = [load_part(e, shape, target_dtype) for e in parts_of[path]]
            if len(parts) == 1:
                return parts[0]
            return jnp.concatenate(parts, axis=parts_of[path][0].part[0])  # fused: parts in layout order

        return _assemble(config, dtype, load_one)


def _clear_safetensors(out_dir: str) -> None:
    # A re-export with different sharding must not leave stale shards that the loader would pick up.
    for name in os.listdir(out_dir):
        if name in (_SINGLE_FILE, _INDEX_FILE) or _SHARD_RE.fullmatch(name):
            os.remove(os.path.join(out_dir, name))


def save_hf(model: Llama, out_dir: str | os.PathLike, *, max_shard_bytes: int | None = None) -> None:
    """Write config.json and HF-named safetensors (sharded, with an index, when max_shard_bytes is set)."""
    out_dir = os.fspath(out_dir)
    if max_shard_bytes is not None and max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    from safetensors.numpy import save_file

    config = model.config
    arrays = param_arrays(model)
    os.makedirs(out_dir, exist_ok=True)
    _clear_safetensors(out_dir)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump({**config.to_hf(), "_name_or_path": config.name, "torch_dtype": _model_dtype(arrays).name},
                  f, indent=2)

    # Greedy packing in layer order; a tensor bigger than the limit gets a shard of its own.
    shards: list[list[_Entry]] = [[]]
    shard_bytes = 0
    for entry in _layout(config):
        nbytes = int(np.prod(entry.hf_shape)) * arrays[entry.path].dtype.itemsize
        if max_shard_bytes and shards[-1] and shard_bytes + nbytes > max_shard_bytes:
            shards.append([])
            shard_bytes = 0
        shards[-1].append(entry)
        shard_bytes += nbytes

    sharded = max_shard_bytes is not None
    weight_map = {}
    for k, shard in enumerate(shards):
        file = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" if sharded else _SINGLE_FILE
        tensors = {e.hf_name: np.ascontiguousarray(jax.device_get(_to_hf(e.take(arrays[e.path]), e.transpose,
                                                                           e.hf_shape)))
                   for e in shard}
        save_file(tensors, os.path.join(out_dir, file), metadata={"format": "pt"})
        weight_map.update({name: file for name in tensors})
    if sharded:
        total = int(sum(a.nbytes for a in arrays.values()))
        with open(os.path.join(out_dir, _INDEX_FILE), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


# ----- Orbax -----


def _flat_key(path: tuple) -> str:
    return ".".join(str(p) for p in path)


def save_orbax(model: Llama, out_dir: str | os.PathLike, *, tokenizer_dir: str | os.PathLike | None = None) -> None:
    """Write an Orbax checkpoint of the Params plus jaxllm_config.json; copy tokenizer files from tokenizer_dir."""
    import orbax.checkpoint as ocp

    out_dir = os.path.abspath(os.fspath(out_dir))
    if os.path.isdir(out_dir) and os.listdir(out_dir) and not os.path.isfile(os.path.join(out_dir, _ORBAX_MARKER)):
        raise CheckpointError(f"refusing to write into {out_dir}: it is not empty and not a jaxllm Orbax checkpoint")
    os.makedirs(out_dir, exist_ok=True)
    marker = os.path.join(out_dir, _ORBAX_MARKER)
    if os.path.exists(marker):
        os.remove(marker)  # the directory is not a valid checkpoint until the new marker is written
    arrays = param_arrays(model)
    flat = {_flat_key(path): value for path, value in arrays.items()}
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(os.path.join(out_dir, _ORBAX_PARAMS), flat, force=True)
        getattr(checkpointer, "wait_until_finished", lambda: None)()  # async in some Orbax versions
    if tokenizer_dir is not None:
        for name in _TOKENIZER_FILES:
            src = os.path.join(os.fspath(tokenizer_dir), name)
            if os.path.isfile(src):
                shutil.copyfile(src, os.path.join(out_dir, name))
    config = model.config
    with open(marker, "w") as f:
        json.dump({"format": "jaxllm-orbax", "version": _ORBAX_LAYOUT_VERSION, "dtype": _model_dtype(arrays).name,
                   "config": {**config.to_hf(), "_name_or_path": config.name}}, f, indent=2)


def load_orbax(directory: str | os.PathLike, *, dtype=None) -> Llama:
    """Restore a checkpoint written by save_orbax (bit-exact when dtype is None or the saved dtype)."""
    import orbax.checkpoint as ocp

    directory = os.path.abspath(os.fspath(directory))
    marker = os.path.join(directory, _ORBAX_MARKER)
    if not os.path.isdir(directory):
        raise CheckpointError(f"checkpoint directory {directory} does not exist")
    if not os.path.isfile(marker):
        raise CheckpointError(f"no {_ORBAX_MARKER} in {directory}: not a jaxllm Orbax checkpoint")
    try:
        with open(marker) as f:
            meta = json.load(f)
        config = LlamaConfig.from_hf(meta["config"])
        saved_dtype = resolve_dtype(meta["dtype"])
        version = meta.get("version")
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{marker} is malformed: {e!r}") from e
    if version != _ORBAX_LAYOUT_VERSION:
        raise CheckpointError(f"{directory} holds parameter layout version {version}; this jaxllm reads version "
                              f"{_ORBAX_LAYOUT_VERSION} (fused q/k/v and gate/up): convert the HuggingFace checkpoint "
                              f"again with `jaxllm convert`")
    dtype = resolve_dtype(dtype) or saved_dtype
    params_dir = os.path.join(directory, _ORBAX_PARAMS)
    if not os.path.isdir(params_dir):
        raise CheckpointError(f"{directory} has {_ORBAX_MARKER} but no {_ORBAX_PARAMS}/ directory")

    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shapes = {}
    graphdef, params, _ = nnx.split(abstract_model(config, dtype=saved_dtype), nnx.Param, ...)
    for path, variable in nnx.to_flat_state(params):
        target = _value(variable)
        shapes[_flat_key(path)] = jax.ShapeDtypeStruct(target.shape, saved_dtype, sharding=sharding)
    with ocp.StandardCheckpointer() as checkpointer:
        restored = checkpointer.restore(params_dir, shapes)
    restored = dict(restored)

    def load_one(path, shape, target_dtype):
        value = restored.pop(_flat_key(path))
        if tuple(value.shape) != shape:
            raise CheckpointError(f"{params_dir}: {_flat_key(path)} has shape {list(value.shape)}, "
                                  f"expected {list(shape)}")
        return value.astype(target_dtype)  # a no-op (same buffer) when the dtype is already right

    return _assemble(config, dtype, load_one)


# ----- any model spec -----


def _tokenizer_dir(directory: str) -> str | None:
    return directory if os.path.isfile(os.path.join(directory, "tokenizer.model")) else None


def load_model(spec: str, *, dtype=None, progress: bool = True) -> tuple[Llama, str | None]:
    """A preset name (random weights, seed 0), an HF directory or an Orbax directory -> (model, tokenizer dir).

    The tokenizer dir is the checkpoint directory when it holds tokenizer.model, else None.
    Presets with dtype None are float32 (init_model's default).
    """
    resolved = resolve_dtype(dtype)
    spec = os.fspath(spec)
    if spec in PRESETS:
        return init_model(preset(spec), dtype=resolved or jnp.float32, seed=0), None
    if os.path.isdir(spec):
        if os.path.isfile(os.path.join(spec, _ORBAX_MARKER)):
            return load_orbax(spec, dtype=resolved), _tokenizer_dir(spec)
        if os.path.isfile(os.path.join(spec, "config.json")):
            return load_hf(spec, dtype=resolved, progress=progress), _tokenizer_dir(spec)
    raise ValueError(f"model {spec!r} is neither a preset (known: {sorted(PRESETS)}) nor a checkpoint directory "
                     f"(a directory with config.json or {_ORBAX_MARKER})")
