"""Appending new tokens' K/V into their rBlocks: one scatter, one pass over the new tokens.

Under jit with the pool donated, XLA updates the pool in place, so a step writes only the new
tokens' bytes (and, for int8, their scales).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

INT8_MAX = 127.0


def quantize_int8(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Symmetric per-token-per-head int8: x [..., head_dim] -> (int8 [..., head_dim], float32 scale [...])."""
    x = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=-1)
    scale = jnp.where(amax > 0, amax / INT8_MAX, 1.0)
    q = jnp.clip(jnp.round(x / scale[..., None]), -INT8_MAX, INT8_MAX).astype(jnp.int8)
    return q, scale


def write_kv(
    k_pool: jax.Array,
    v_pool: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    slot_mapping: jax.Array,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
):
    """Write new tokens into the pool.

    Args:
      k_pool, v_pool: [num_blocks, kv_heads, block_size, head_dim].
      k_new, v_new: [num_tokens, kv_heads, head_dim], any float dtype.
      slot_mapping: [num_tokens] int32, `block_id * block_size + row`; negative entries (padding
        tokens) are dropped.
      k_scale, v_scale: [num_blocks, kv_heads, block_size] float32 when the pool is int8.

    Returns:
      (k_pool, v_pool, k_scale, v_scale) updated; scales are None for float pools.
    """
    num_blocks, num_kv_heads, block_size, head_dim = k_pool.shape
    if k_new.shape[1:] != (num_kv_heads, head_dim) or v_new.shape != k_new.shape:
        raise ValueError(f"new K/V shape {k_new.shape}/{v_new.shape} != (tokens, {num_kv_heads}, {head_dim})")
    if slot_mapping.shape != k_new.shape[:1]:
        raise ValueError(f"slot_mapping shape {slot_mapping.shape} != (num_tokens,) = ({k_new.shape[0]},)")
    # Padding slots point past the pool; mode="drop" discards them without a branch.
    block = jnp.where(slot_mapping >= 0, slot_mapping // block_size, num_blocks)
    row = jnp.where(slot_mapping >= 0, slot_mapping % block_size, 0)
    if k_pool.dtype == jnp.int8:
        if k_scale is None or v_scale is None:
            raise ValueError("int8 pools need k_scale and v_scale")
        kq, ks = quantize_int8(k_new)
        vq, vs = quantize_int8(v_new)
        k_pool = k_pool.at[block, :, row, :].set(kq, mode="drop")
        v_pool = v_pool.at[block, :, row, :].set(vq, mode="drop")
        k_scale = k_scale.at[block, :, row].set(ks, mode="drop")
        v_scale = v_scale.at[block, :, row].set(vs, mode="drop")
        return k_pool, v_pool, k_scale, v_scale
    k_pool = k_pool.at[block, :, row, :].set(k_new.astype(k_pool.dtype), mode="drop")
    v_pool = v_pool.at[block, :, row, :].set(v_new.astype(v_pool.dtype), mode="drop")
    return k_pool, v_pool, None, None
