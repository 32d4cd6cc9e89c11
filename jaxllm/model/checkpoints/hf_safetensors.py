"""HuggingFace checkpoints: config.json + safetensors (one file, or shards with an index), in and out.

Reading goes through the `safetensors` library (it validates headers and offsets, reads bfloat16 into
NumPy through ml_dtypes, and reads a slice of a tensor without the rest: what loading one device's
shard on a mesh needs). Loading builds the model's structure without allocating (abstract_model),
then reads one tensor at a time, puts it on the device and converts it there, so neither host nor
device ever holds two copies of the weights.
"""

from __future__ import annotations

import json
import os
import re
import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jaxllm.model.checkpoints.common import (MODEL_DTYPES, CheckpointError, assemble, model_dtype, param_arrays,
                                             resolve_dtype)
from jaxllm.model.checkpoints.layout import fuse_parts, hf_layout, ignored_tensor, param_parts, to_hf, to_ours
from jaxllm.model.config import ConfigError, LlamaConfig
from jaxllm.model.llama import Llama
from jaxllm.progress import Progress

SUPPORTED_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "F64": np.float64}
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_SHARD_RE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


class SafetensorsCheckpoint:
    """The tensors of a checkpoint directory (single file, indexed shards or bare shards), read lazily.

    `dtype(name)` / `shape(name)` come from the headers; `read(name)` is one whole tensor and
    `read_slice(name, index)` a slice of it (e.g. one tensor-parallel shard), as fresh host arrays.
    """

    def __init__(self, model_dir: str):
        from safetensors import SafetensorError, safe_open

        self.model_dir = model_dir
        self._files = {}  # file name -> open safe_open handle
        self._where: dict[str, str] = {}  # tensor name -> file name
        weight_map = self._weight_map()
        for file in sorted(set(weight_map.values()) if weight_map else self._bare_files()):
            path = os.path.join(model_dir, file)
            if not os.path.isfile(path):
                raise CheckpointError(f"{os.path.join(model_dir, INDEX_FILE)} references shard {file!r}, which does "
                                      f"not exist in {model_dir}")
            try:
                self._files[file] = safe_open(path, framework="numpy")
            except (SafetensorError, OSError) as e:
                raise CheckpointError(f"{path} is not a readable safetensors file ({e}): truncated or corrupt?") from e
        if weight_map:
            for name, file in weight_map.items():
                if name not in self._files[file].keys():
                    raise CheckpointError(f"{INDEX_FILE} places tensor {name} in {file}, which does not contain it")
                self._where[name] = file
        else:
            for file, handle in self._files.items():
                for name in handle.keys():
                    if name in self._where:
                        raise CheckpointError(f"tensor {name} is stored twice: in {self._where[name]} and {file}")
                    self._where[name] = file

    def _weight_map(self) -> dict[str, str] | None:
        index_path = os.path.join(self.model_dir, INDEX_FILE)
        if not os.path.isfile(index_path):
            return None
        try:
            with open(index_path) as f:
                weight_map = json.load(f)["weight_map"]
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise TypeError("weight_map is not an object of file names")
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index_path}: malformed index ({e})") from e
        return weight_map

    def _bare_files(self) -> list[str]:
        if os.path.isfile(os.path.join(self.model_dir, SINGLE_FILE)):
            return [SINGLE_FILE]
        files = sorted(f for f in os.listdir(self.model_dir) if f.endswith(".safetensors"))
        if not files:
            raise CheckpointError(f"no safetensors files in {self.model_dir} (expected {SINGLE_FILE} or "
                                  f"model-0000x-of-0000y.safetensors with {INDEX_FILE})")
        return files

    def names(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def _slice(self, name: str):
        return self._files[self._where[name]].get_slice(name)

    def dtype(self, name: str) -> str:
        """The safetensors dtype code: F32, BF16, ..."""
        return self._slice(name).get_dtype()

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def nbytes(self, name: str) -> int:
        return int(np.prod(self.shape(name), dtype=np.int64)) * np.dtype(SUPPORTED_DTYPES[self.dtype(name)]).itemsize

    def check_dtype(self, name: str) -> None:
        if self.dtype(name) not in SUPPORTED_DTYPES:
            raise CheckpointError(f"tensor {name} has dtype {self.dtype(name)}, which is not supported; "
                                  f"supported: {sorted(SUPPORTED_DTYPES)}")

    def read(self, name: str) -> np.ndarray:
        """The whole tensor as a host array."""
        self.check_dtype(name)
        return np.asarray(self._files[self._where[name]].get_tensor(name))

    def read_slice(self, name: str, index) -> np.ndarray:
        """tensor[index] (basic slicing) read without the rest of the tensor."""
        self.check_dtype(name)
        return np.asarray(self._slice(name)[index])


def read_hf_config(model_dir: str) -> tuple[dict, LlamaConfig]:
    """(the raw config.json dict, our config); errors name the file."""
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


def _checkpoint_dtype(raw_config: dict, ckpt: SafetensorsCheckpoint) -> jnp.dtype:
    for key in ("dtype", "torch_dtype"):  # transformers 5 writes `dtype`, 4 wrote `torch_dtype`
        name = raw_config.get(key)
        if isinstance(name, str) and name in MODEL_DTYPES:
            return jnp.dtype(MODEL_DTYPES[name])
    dtype = jnp.dtype(SUPPORTED_DTYPES[ckpt.dtype("model.embed_tokens.weight")])
    return dtype if dtype.name in MODEL_DTYPES else jnp.dtype(jnp.float32)


def _cut_range(shape: tuple[int, ...], index: tuple[slice, ...], lo: int, hi: int) -> slice:
    """The run of the flattened axes lo..hi-1 of `shape` that `index` selects: whole, or cut on the
    group's first axis only (the one axis a tensor-parallel rule splits), hence contiguous."""
    size = int(np.prod(shape[lo:hi], dtype=np.int64))
    cut = [ax for ax in range(lo, hi) if index[ax].indices(shape[ax]) != (0, shape[ax], 1)]
    if not cut:
        return slice(0, size)
    start, stop, step = index[cut[0]].indices(shape[cut[0]])
    if len(cut) > 1 or cut[0] != lo or step != 1:
        raise NotImplementedError(f"reading slice {index} of a {shape} parameter: only one axis, the first of its "
                                  "group, may be cut")
    inner = size // shape[lo]
    return slice(start * inner, stop * inner)


def _read_part(ckpt: SafetensorsCheckpoint, tensor, index: tuple[slice, ...]) -> np.ndarray:
    """tensor (in our orientation, `tensor.shape`)[index], read from the file without the rest of it."""
    shape = tensor.shape
    sliced = tuple(len(range(*index[ax].indices(shape[ax]))) for ax in range(len(shape)))
    if not tensor.transpose and len(tensor.hf_shape) == 1 and len(shape) > 1:  # a bias [H*hd] we hold as [H, hd]
        return ckpt.read_slice(tensor.name, (_cut_range(shape, index, 0, len(shape)),)).reshape(sliced)
    if not tensor.transpose:  # stored as we hold it
        return ckpt.read_slice(tensor.name, index)
    # ours = hf.T.reshape(shape): our leading axes flatten to HF's `in` axis (hf_shape[1]), the rest to `out`
    k = next(k for k in range(1, len(shape) + 1) if int(np.prod(shape[:k], dtype=np.int64)) == tensor.hf_shape[1])
    hf_index = (_cut_range(shape, index, k, len(shape)), _cut_range(shape, index, 0, k))
    return ckpt.read_slice(tensor.name, hf_index).T.reshape(sliced)


def read_param_slice(ckpt: SafetensorsCheckpoint, rule, config: LlamaConfig, index: tuple[slice, ...],
                     dtype) -> np.ndarray:
    """One Param's slice `index` (one device's shard), read and fused on the host from its HF tensors'
    slices alone, in `dtype`."""
    name = rule.path[-1]
    if rule.fuse is None:
        out = _read_part(ckpt, rule.tensors[0], index)
    elif name in ("qkv", "qkv_bias"):  # [D, Hkv, G + 2, hd] from q [D, Hq, hd], k and v [D, Hkv, hd]; a bias: no D
        g = config.num_heads // config.num_kv_heads
        lead, (heads, group, dim) = index[:-3], index[-3:]  # lead: the hidden axis of the weight, none of the bias
        whole = (slice(None),)
        if group.indices(g + 2) != (0, g + 2, 1) or dim.indices(config.head_dim) != (0, config.head_dim, 1):
            raise NotImplementedError(f"q/k/v slice {index}: only hidden and KV heads may be cut")
        start, stop, _ = heads.indices(config.num_kv_heads)
        q = _read_part(ckpt, rule.tensors[0], lead + (slice(start * g, stop * g),) + whole)
        k, v = (_read_part(ckpt, t, lead + (slice(start, stop),) + whole) for t in rule.tensors[1:])
        q = q.reshape(*q.shape[:-2], stop - start, g, q.shape[-1])
        out = np.concatenate([q, k[..., None, :], v[..., None, :]], axis=-2)
    elif name == "gate_up":  # [D, 2, F] from gate and up [D, F]
        if index[1].indices(2) != (0, 2, 1):
            raise NotImplementedError(f"gate/up slice {index}: only hidden and the MLP width may be cut")
        out = np.stack([_read_part(ckpt, t, (index[0], index[2])) for t in rule.tensors], axis=1)
    else:
        raise NotImplementedError(f"no sliced reader for the fused parameter {'.'.join(map(str, rule.path))}")
    return out.astype(np.dtype(dtype))


def load_hf(model_dir: str | os.PathLike, *, dtype=None, progress: bool = True, sharding=None) -> Llama:
    """Load a HuggingFace Llama-family checkpoint (config.json + safetensors, single or sharded; the architectures
    of config.ARCHITECTURES).

    dtype: None keeps the checkpoint's dtype (config.json dtype / torch_dtype, else the tensors');
    'float32' / 'bfloat16' / 'float16' converts each tensor on the device as it arrives.
    sharding: None puts each Param on the default device; else a function of the model's config
    returning (path, shape) -> the jax Sharding of that Param (sharding.rules.load_sharding): each
    device's shard is read on its own (`read_slice`), so no process reads or holds more of a tensor
    than its devices keep.
    """
    model_dir = os.fspath(model_dir)
    raw_config, config = read_hf_config(model_dir)
    if sharding is not None:
        sharding = sharding(config)
    ckpt = SafetensorsCheckpoint(model_dir)
    rules = {rule.path: rule for rule in hf_layout(config)}
    tensors = [t for rule in rules.values() for t in rule.tensors]
    missing = [t.name for t in tensors if t.name not in ckpt]
    if missing:
        raise CheckpointError(f"{model_dir}: {len(missing)} tensors missing, e.g. {missing[:5]}")
    expected = {t.name for t in tensors}
    unexpected = sorted(n for n in ckpt.names() if n not in expected and not ignored_tensor(n, config))
    if unexpected:
        warnings.warn(f"{model_dir}: ignoring {len(unexpected)} unexpected tensors, e.g. {unexpected[:5]}")
    for t in tensors:
        if ckpt.shape(t.name) != t.hf_shape:
            raise CheckpointError(f"tensor {t.name}: expected shape {list(t.hf_shape)}, got {list(ckpt.shape(t.name))}")
        ckpt.check_dtype(t.name)
    dtype = resolve_dtype(dtype) or _checkpoint_dtype(raw_config, ckpt)
    total = sum(ckpt.nbytes(t.name) for t in tensors)

    with Progress(total, f"loading {os.path.basename(os.path.normpath(model_dir))}", unit="B",
                  enabled=progress) as bar:
        def load_tensor(tensor, target_dtype):
            host = ckpt.read(tensor.name)
            out = to_ours(jax.device_put(host), tensor, target_dtype)
            del host
            bar.update(ckpt.nbytes(tensor.name), detail=tensor.name)
            return out

        def load_sharded(path, shape, target_dtype):
            rule = rules[path]
            out = jax.make_array_from_callback(
                shape, sharding(path, shape), lambda index: read_param_slice(ckpt, rule, config, index, target_dtype))
            bar.update(sum(ckpt.nbytes(t.name) for t in rule.tensors), detail=".".join(map(str, path)))
            return out

        def load_one(path, shape, target_dtype):
            if sharding is not None:
                return load_sharded(path, shape, target_dtype)
            rule = rules[path]
            value = fuse_parts(rule, [load_tensor(t, target_dtype) for t in rule.tensors])
            if tuple(value.shape) != shape:  # the layout and the model disagree: a bug, not a user error
                raise RuntimeError(f"{'.'.join(map(str, path))}: built {value.shape}, the model has {shape}")
            return value

        return assemble(config, dtype, load_one)


def _clear_safetensors(out_dir: str) -> None:
    # A re-export with different sharding must not leave stale shards that the loader would pick up.
    for name in os.listdir(out_dir):
        if name in (SINGLE_FILE, INDEX_FILE) or _SHARD_RE.fullmatch(name):
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
        json.dump({**config.to_hf(), "_name_or_path": config.name, "torch_dtype": model_dtype(arrays).name},
                  f, indent=2)

    # Greedy packing in layer order; a tensor bigger than the limit gets a shard of its own.
    itemsize = model_dtype(arrays).itemsize
    shards: list[list[tuple]] = [[]]  # (rule, tensor index)
    shard_bytes = 0
    for rule in hf_layout(config):
        for k, tensor in enumerate(rule.tensors):
            nbytes = int(np.prod(tensor.hf_shape)) * itemsize
            if max_shard_bytes and shards[-1] and shard_bytes + nbytes > max_shard_bytes:
                shards.append([])
                shard_bytes = 0
            shards[-1].append((rule, k))
            shard_bytes += nbytes

    sharded = max_shard_bytes is not None
    weight_map = {}
    for n, shard in enumerate(shards):
        file = f"model-{n + 1:05d}-of-{len(shards):05d}.safetensors" if sharded else SINGLE_FILE
        out = {}
        for rule, k in shard:
            part = param_parts(rule, arrays[rule.path])[k]
            out[rule.tensors[k].name] = np.ascontiguousarray(jax.device_get(to_hf(part, rule.tensors[k])))
        save_file(out, os.path.join(out_dir, file), metadata={"format": "pt"})
        weight_map.update({name: file for name in out})
    if sharded:
        total = int(sum(a.nbytes for a in arrays.values()))
        with open(os.path.join(out_dir, INDEX_FILE), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
