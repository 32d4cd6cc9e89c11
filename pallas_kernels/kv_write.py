"""Appending new tokens' K/V into their rBlocks: one pass over the new tokens.

Two implementations with one meaning: `write_kv` (XLA scatters; every dtype, int8 with scales)
and `write_kv_kernel` (one Pallas kernel writing K and V together, float pools; a decode step then
launches one kernel per layer for its KV instead of a scatter per pool plus index fusions).
`pallas_kernels.dispatch.write_kv` picks between them. Under jit with the pool donated both update
the pool in place, so a step writes only the new tokens' bytes (and, for int8, their scales).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import compat

INT8_MAX = 127.0


def quantize_int8(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Symmetric per-token-per-head int8: x [..., head_dim] -> (int8 [..., head_dim], float32 scale [...])."""
    x = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=-1)
    scale = jnp.where(amax > 0, amax / INT8_MAX, 1.0)
    q = jnp.clip(jnp.round(x / scale[..., None]), -INT8_MAX, INT8_MAX).astype(jnp.int8)
    return q, scale


def _check_new_kv(k_pool, k_new, v_new, slot_mapping) -> None:
    """k_new, v_new [num_tokens, kv_heads, head_dim] matching the pool; slot_mapping [num_tokens]."""
    _, num_kv_heads, _, head_dim = k_pool.shape
    if k_new.shape[1:] != (num_kv_heads, head_dim) or v_new.shape != k_new.shape:
        raise ValueError(f"new K/V shape {k_new.shape}/{v_new.shape} != (tokens, {num_kv_heads}, {head_dim})")
    if slot_mapping.shape != k_new.shape[:1]:
        raise ValueError(f"slot_mapping shape {slot_mapping.shape} != (num_tokens,) = ({k_new.shape[0]},)")


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
    _check_new_kv(k_pool, k_new, v_new, slot_mapping)
    num_blocks, block_size = k_pool.shape[0], k_pool.shape[2]
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


def _write_kernel(slots_ref, k_new_ref, v_new_ref, k_pool_in_ref, v_pool_in_ref, k_pool_ref, v_pool_ref, *,
                  block_size: int, k_first_head: int, v_first_head: int):
    del k_pool_in_ref, v_pool_in_ref  # the same buffers as k_pool_ref / v_pool_ref (aliased)
    token, head = pl.program_id(0), pl.program_id(1)
    slot = slots_ref[token]

    @pl.when(slot >= 0)
    def _():
        block, row = slot // block_size, slot % block_size
        k_pool_ref[block, head, row, :] = k_new_ref[token, k_first_head + head, :].astype(k_pool_ref.dtype)
        v_pool_ref[block, head, row, :] = v_new_ref[token, v_first_head + head, :].astype(v_pool_ref.dtype)


@functools.partial(jax.jit, static_argnames=("k_first_head", "v_first_head", "interpret"))
def _write_kv_kernel(k_pool, v_pool, k_new, v_new, slot_mapping, *, k_first_head: int, v_first_head: int,
                     interpret: bool):
    num_tokens, num_kv_heads = k_new.shape[0], k_pool.shape[1]
    whole = pl.no_block_spec
    return pl.pallas_call(
        functools.partial(_write_kernel, block_size=k_pool.shape[2], k_first_head=k_first_head,
                          v_first_head=v_first_head),
        grid=(num_tokens, num_kv_heads),
        in_specs=[whole] * 5,
        out_specs=[whole, whole],
        out_shape=[jax.ShapeDtypeStruct(k_pool.shape, k_pool.dtype), jax.ShapeDtypeStruct(v_pool.shape, v_pool.dtype)],
        input_output_aliases={3: 0, 4: 1},
        compiler_params=compat.triton_compiler_params(num_warps=1, num_stages=1),
        interpret=interpret,
        name="write_kv",
    )(slot_mapping.astype(jnp.int32), k_new, v_new, k_pool, v_pool)


def write_kv_kernel(
    k_pool: jax.Array,
    v_pool: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    slot_mapping: jax.Array,
    *,
    k_first_head: int = 0,
    v_first_head: int = 0,
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array]:
    """`write_kv` for float pools as one Pallas kernel (grid: new tokens x KV heads), in place.

    Same arguments and meaning as write_kv (negative slots are skipped); slots must be distinct and
    inside the pool (the allocator guarantees both). k_new / v_new may hold more heads than the pool,
    as the model's fused projection does: heads k_first_head .. + kv_heads of k_new (and v_first_head
    .. of v_new) are written, read in place (slicing them out would cost a copy kernel per layer).
    In place under a jit that donates the pools (the model step); called eagerly it returns updated
    copies. Returns (k_pool, v_pool).
    """
    if k_pool.dtype == jnp.int8:
        raise ValueError("write_kv_kernel writes float pools; int8 pools (with scales) go through write_kv")
    if v_pool.shape != k_pool.shape or v_pool.dtype != k_pool.dtype:
        raise ValueError(f"v_pool {v_pool.shape} {v_pool.dtype} != k_pool {k_pool.shape} {k_pool.dtype}")
    num_kv_heads = k_pool.shape[1]
    for name, new, first in (("k", k_new, k_first_head), ("v", v_new, v_first_head)):
        if new.ndim != 3 or not 0 <= first <= new.shape[1] - num_kv_heads:
            raise ValueError(f"{name}_first_head {first} + {num_kv_heads} KV heads do not fit {name}_new "
                             f"{new.shape} ([tokens, heads, head_dim])")
    heads_used = lambda new: jax.ShapeDtypeStruct((new.shape[0], num_kv_heads, new.shape[2]), new.dtype)
    _check_new_kv(k_pool, heads_used(k_new), heads_used(v_new), slot_mapping)
    interpret = compat.default_interpret(interpret)
    return tuple(_write_kv_kernel(k_pool, v_pool, k_new, v_new, slot_mapping, k_first_head=k_first_head,
                                  v_first_head=v_first_head, interpret=interpret))
