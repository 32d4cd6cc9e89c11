"""Rotary position embeddings as Llama-2 (and HF checkpoints) use them: the angle tables of a config.

The rotation itself (rotate-half layout) is `pallas_kernels.rope.apply_rope`, which the RoPE + KV-write
kernel follows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.model.config import LlamaConfig


def inverse_frequencies(config: LlamaConfig) -> np.ndarray:
    """[head_dim // 2] float64 inverse frequencies, with the config's RoPE scaling folded in.

    `linear` scaling divides positions by the factor, which is the same as dividing the
    frequencies. `dynamic` (NTK) raises the base as for a sequence filling the whole extended
    window; applied statically so cached keys never need re-rotation (see RopeScaling).
    """
    dim = config.head_dim
    base = config.rope_theta
    scaling = config.rope_scaling
    if scaling is not None and scaling.type == "dynamic" and scaling.factor > 1.0:
        f = scaling.factor
        max_len = config.max_position_embeddings * f
        base = base * ((f * max_len / config.max_position_embeddings) - (f - 1)) ** (dim / (dim - 2))
    inv_freq = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    if scaling is not None and scaling.type == "linear":
        inv_freq = inv_freq / scaling.factor
    return inv_freq


def rope_tables(inv_freq: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos, sin [tokens, head_dim // 2] float32 for integer positions [tokens]."""
    angles = positions.astype(jnp.float32)[:, None] * inv_freq.astype(jnp.float32)[None, :]
    return jnp.cos(angles), jnp.sin(angles)
