"""`load_model`: a preset name, a HuggingFace directory or an Orbax directory -> (model, tokenizer dir)."""

from __future__ import annotations

import os

import jax.numpy as jnp

from jaxllm.model.checkpoints.common import resolve_dtype
from jaxllm.model.checkpoints.hf_safetensors import load_hf
from jaxllm.model.checkpoints.orbax import ORBAX_MARKER, load_orbax
from jaxllm.model.config import PRESETS, preset
from jaxllm.model.llama import Llama, init_model
from jaxllm.model.tokenizer_files import has_tokenizer


def _tokenizer_dir(directory: str) -> str | None:
    return directory if has_tokenizer(directory) else None


def load_model(spec: str, *, dtype=None, progress: bool = True, sharding=None) -> tuple[Llama, str | None]:
    """A preset name (random weights, seed 0), an HF directory or an Orbax directory -> (model, tokenizer dir).

    The tokenizer dir is the checkpoint directory when it holds a tokenizer (tokenizer.json or
    tokenizer.model), else None; its generation_config.json, if any, is read from there too
    (generation_config.load_generation_defaults). Presets with dtype None are float32.
    sharding: None, or a function of the model's config returning (path, shape) -> each Param's jax
    Sharding (sharding.rules.load_sharding with its mesh bound): checkpoints load straight into those
    shards, and presets draw their random weights straight into them (init_model).
    """
    resolved = resolve_dtype(dtype)
    spec = os.fspath(spec)
    if spec in PRESETS:
        config = preset(spec)
        return init_model(config, dtype=resolved or jnp.float32, seed=0,
                          sharding=None if sharding is None else sharding(config)), None
    if os.path.isdir(spec):
        if os.path.isfile(os.path.join(spec, ORBAX_MARKER)):
            return load_orbax(spec, dtype=resolved, sharding=sharding), _tokenizer_dir(spec)
        if os.path.isfile(os.path.join(spec, "config.json")):
            return load_hf(spec, dtype=resolved, progress=progress, sharding=sharding), _tokenizer_dir(spec)
    raise ValueError(f"model {spec!r} is neither a preset (known: {sorted(PRESETS)}) nor a checkpoint directory "
                     f"(a directory with config.json or {ORBAX_MARKER})")
