"""jaxllm's own Orbax checkpoints: the Params as saved (fused layout, any dtype) plus jaxllm_config.json.

Bit-exact round trips, and restored straight onto the device without a host copy.
"""

from __future__ import annotations

import json
import os
import shutil

import jax
from flax import nnx

from jaxllm.model.checkpoints.common import (TOKENIZER_FILES, CheckpointError, assemble, model_dtype, param_arrays,
                                             resolve_dtype, variable_value)
from jaxllm.model.config import LlamaConfig
from jaxllm.model.llama import Llama, abstract_model

ORBAX_MARKER = "jaxllm_config.json"
# 2: fused q/k/v and gate/up Params (llama.py). Version 1 checkpoints kept them separate.
_ORBAX_LAYOUT_VERSION = 2
_ORBAX_PARAMS = "params"


def _flat_key(path: tuple) -> str:
    return ".".join(str(p) for p in path)


def save_orbax(model: Llama, out_dir: str | os.PathLike, *, tokenizer_dir: str | os.PathLike | None = None) -> None:
    """Write an Orbax checkpoint of the Params plus jaxllm_config.json; copy tokenizer files from tokenizer_dir."""
    import orbax.checkpoint as ocp

    out_dir = os.path.abspath(os.fspath(out_dir))
    if os.path.isdir(out_dir) and os.listdir(out_dir) and not os.path.isfile(os.path.join(out_dir, ORBAX_MARKER)):
        raise CheckpointError(f"refusing to write into {out_dir}: it is not empty and not a jaxllm Orbax checkpoint")
    os.makedirs(out_dir, exist_ok=True)
    marker = os.path.join(out_dir, ORBAX_MARKER)
    if os.path.exists(marker):
        os.remove(marker)  # the directory is not a valid checkpoint until the new marker is written
    arrays = param_arrays(model)
    flat = {_flat_key(path): value for path, value in arrays.items()}
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(os.path.join(out_dir, _ORBAX_PARAMS), flat, force=True)
        getattr(checkpointer, "wait_until_finished", lambda: None)()  # async in some Orbax versions
    if tokenizer_dir is not None:
        for name in TOKENIZER_FILES:
            src = os.path.join(os.fspath(tokenizer_dir), name)
            if os.path.isfile(src):
                shutil.copyfile(src, os.path.join(out_dir, name))
    config = model.config
    with open(marker, "w") as f:
        json.dump({"format": "jaxllm-orbax", "version": _ORBAX_LAYOUT_VERSION, "dtype": model_dtype(arrays).name,
                   "config": {**config.to_hf(), "_name_or_path": config.name}}, f, indent=2)


def load_orbax(directory: str | os.PathLike, *, dtype=None, sharding=None) -> Llama:
    """Restore a checkpoint written by save_orbax (bit-exact when dtype is None or the saved dtype).

    sharding: None restores onto the default device; else a function of the model's config returning
    (path, shape) -> each Param's jax Sharding (sharding.rules.load_sharding): restored straight into
    those shards.
    """
    import orbax.checkpoint as ocp

    directory = os.path.abspath(os.fspath(directory))
    marker = os.path.join(directory, ORBAX_MARKER)
    if not os.path.isdir(directory):
        raise CheckpointError(f"checkpoint directory {directory} does not exist")
    if not os.path.isfile(marker):
        raise CheckpointError(f"no {ORBAX_MARKER} in {directory}: not a jaxllm Orbax checkpoint")
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
        raise CheckpointError(f"{directory} has {ORBAX_MARKER} but no {_ORBAX_PARAMS}/ directory")

    if sharding is not None:
        sharding = sharding(config)
    one_device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shapes = {}
    graphdef, params, _ = nnx.split(abstract_model(config, dtype=saved_dtype), nnx.Param, ...)
    for path, variable in nnx.to_flat_state(params):
        target = variable_value(variable)
        where = one_device if sharding is None else sharding(tuple(path), tuple(target.shape))
        shapes[_flat_key(path)] = jax.ShapeDtypeStruct(target.shape, saved_dtype, sharding=where)
    with ocp.StandardCheckpointer() as checkpointer:
        restored = checkpointer.restore(params_dir, shapes)
    restored = dict(restored)

    def load_one(path, shape, target_dtype):
        value = restored.pop(_flat_key(path))
        if tuple(value.shape) != shape:
            raise CheckpointError(f"{params_dir}: {_flat_key(path)} has shape {list(value.shape)}, "
                                  f"expected {list(shape)}")
        return value.astype(target_dtype)  # a no-op (same buffer) when the dtype is already right

    return assemble(config, dtype, load_one)
