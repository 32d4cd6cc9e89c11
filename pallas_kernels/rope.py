"""Rotary position embeddings, rotate-half layout (Llama-2 and HF checkpoints): the rotation itself.

`jaxllm.model.rope` builds the angle tables from a model config; the KV writer
(`kv_write.rope_write_kv_kernel`) applies the same rotation inside its kernel, with this function as
its reference.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate x [tokens, heads, head_dim] by its positions' angles (first half / second half pairs).

    cos, sin: [tokens, head_dim // 2] float32. Computed in float32, returned in x.dtype.
    """
    half = x.shape[-1] // 2
    x32 = x.astype(jnp.float32)
    x1, x2 = x32[..., :half], x32[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]  # [T, 1, D/2]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)
