"""Appending new tokens' K/V into their rBlocks: one pass over the new tokens.

`write_kv` (XLA scatters; every dtype, int8 with scales) writes K/V as given. `rope_write_kv_kernel`
(one Pallas kernel, float pools) takes the model's fused q|k|v projection, grouped per KV head
([tokens, kv_heads, G + 2, head_dim]: G query heads, then k, then v), or the skinny matmul's float32
split-K partials of it, summed on the way, and does the step's whole RoPE + KV write: it
rotates q (returned) and k, and writes the rotated k and v into the pool, so a decode step launches
one kernel per layer for all of it instead of a partial sum, a RoPE fusion and a writer. Its meaning
is `rope_write_kv`'s (`apply_rope` then `write_kv`); `pallas_kernels.dispatch.rope_write_kv` picks
between them. Under jit with the pool donated both update the pool in place, so a step writes only the
new tokens' bytes (and, for int8, their scales).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import compat
from pallas_kernels.rope import apply_rope

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


def _rope_write_kernel(slots_ref, qkv_ref, cos_ref, sin_ref, k_pool_in_ref, v_pool_in_ref, q_ref, k_pool_ref,
                       v_pool_ref, *, block_size: int, group: int, num_kv_heads: int, num_parts: int):
    """Program (token, head): q head `head` rotated into q_ref; K/V head `head` (rotated k, v as is)
    into the token's pool slot. qkv_ref is [T, Hkv * (G + 2), D] (the grouped layout, flattened), or
    with num_parts [S, T, Hkv * (G + 2), D] float32 split-K partials, summed first. Rounding as
    rope_write_kv: the projection rounded to q's dtype, the rotation in float32 rounded to it again,
    then to the pool's dtype."""
    del k_pool_in_ref, v_pool_in_ref  # the same buffers as k_pool_ref / v_pool_ref (aliased)
    token, head = pl.program_id(0), pl.program_id(1)
    half = qkv_ref.shape[-1] // 2
    lo, hi = pl.ds(0, half), pl.ds(half, half)
    dtype = q_ref.dtype

    def load(h, cols):
        """The projection's head h, columns cols, as q's dtype would hold it, in float32."""
        if not num_parts:
            return qkv_ref[token, h, cols].astype(dtype).astype(jnp.float32)
        total = qkv_ref[0, token, h, cols]
        for part in range(1, num_parts):
            total = total + qkv_ref[part, token, h, cols]
        return total.astype(dtype).astype(jnp.float32)

    def rotated(h):
        x1, x2 = load(h, lo), load(h, hi)
        c, s = cos_ref[token, :], sin_ref[token, :]
        return (x1 * c - x2 * s).astype(dtype), (x2 * c + x1 * s).astype(dtype)

    num_q_heads, stride = num_kv_heads * group, group + 2  # stride: rows of one KV head's group

    @pl.when(head < num_q_heads)
    def _():
        r1, r2 = rotated((head // group) * stride + head % group)
        q_ref[token, head, lo] = r1
        q_ref[token, head, hi] = r2

    slot = slots_ref[token]

    @pl.when((head < num_kv_heads) & (slot >= 0))
    def _():
        block, row = slot // block_size, slot % block_size
        r1, r2 = rotated(head * stride + group)
        k_pool_ref[block, head, row, lo] = r1.astype(k_pool_ref.dtype)
        k_pool_ref[block, head, row, hi] = r2.astype(k_pool_ref.dtype)
        v_head = head * stride + group + 1  # load() has rounded it to q's dtype already
        v_pool_ref[block, head, row, lo] = load(v_head, lo).astype(v_pool_ref.dtype)
        v_pool_ref[block, head, row, hi] = load(v_head, hi).astype(v_pool_ref.dtype)


@functools.partial(jax.jit, static_argnames=("dtype", "interpret"))
def _rope_write_kv_kernel(k_pool, v_pool, qkv, cos, sin, slot_mapping, *, dtype, interpret: bool):
    num_parts = qkv.shape[0] if qkv.ndim == 5 else 0
    num_tokens, num_kv_heads, stride, head_dim = qkv.shape[-4:]
    group = stride - 2
    num_q_heads = num_kv_heads * group
    whole = pl.no_block_spec
    q, k_pool, v_pool = pl.pallas_call(
        functools.partial(_rope_write_kernel, block_size=k_pool.shape[2], group=group,
                          num_kv_heads=num_kv_heads, num_parts=num_parts),
        grid=(num_tokens, max(num_q_heads, num_kv_heads)),
        in_specs=[whole] * 6,
        out_specs=[whole] * 3,
        out_shape=[jax.ShapeDtypeStruct((num_tokens, num_q_heads, head_dim), dtype),
                   jax.ShapeDtypeStruct(k_pool.shape, k_pool.dtype), jax.ShapeDtypeStruct(v_pool.shape, v_pool.dtype)],
        input_output_aliases={4: 1, 5: 2},
        compiler_params=compat.triton_compiler_params(num_warps=1, num_stages=1),
        interpret=interpret,
        name="rope_write_kv",
    )(slot_mapping.astype(jnp.int32), qkv.reshape(*qkv.shape[:-3], num_kv_heads * stride, head_dim),
      cos.astype(jnp.float32), sin.astype(jnp.float32), k_pool, v_pool)  # the reshape is free: contiguous
    return q.reshape(num_tokens, num_kv_heads, group, head_dim), k_pool, v_pool


def _check_qkv(k_pool, qkv, cos, sin, slot_mapping) -> None:
    """qkv [tokens, kv_heads, G + 2, head_dim] (or [S, ...] float32 split-K partials), G >= 1;
    cos, sin [tokens, head_dim // 2]."""
    num_kv_heads, head_dim = k_pool.shape[1], k_pool.shape[3]
    if qkv.ndim not in (4, 5) or qkv.shape[-3] != num_kv_heads or qkv.shape[-2] < 3 or qkv.shape[-1] != head_dim:
        raise ValueError(f"qkv shape {qkv.shape} != ([parts,] tokens, {num_kv_heads}, G + 2, {head_dim}) with G >= 1: "
                         f"the {num_kv_heads} KV heads of the pool, each with its G query heads, k and v")
    if qkv.ndim == 5 and qkv.dtype != jnp.float32:
        raise ValueError(f"qkv as split-K partials ([parts, tokens, kv_heads, G + 2, head_dim]) must be float32, "
                         f"got {qkv.dtype}")
    if head_dim % 2:
        raise ValueError(f"head_dim {head_dim} must be even for RoPE")
    tokens = qkv.shape[-4]
    for name, table in (("cos", cos), ("sin", sin)):
        if table.shape != (tokens, head_dim // 2):
            raise ValueError(f"{name} shape {table.shape} != (tokens, head_dim // 2) = ({tokens}, {head_dim // 2})")
    if slot_mapping.shape != (tokens,):
        raise ValueError(f"slot_mapping shape {slot_mapping.shape} != (num_tokens,) = ({tokens},)")


def rope_write_kv(k_pool, v_pool, qkv, cos, sin, slot_mapping, k_scale=None, v_scale=None, *, dtype=None):
    """The reference for rope_write_kv_kernel, every pool dtype: apply_rope to q and k, then write_kv.

    qkv: [tokens, kv_heads, G + 2, head_dim] (per KV head: G query heads, k, v), or [S, ...] float32
    split-K partials of the projection (summed and rounded to `dtype` first, as the projection's output
    would be). dtype: q's dtype (default qkv's; needed with partials). Returns (q, k_pool, v_pool,
    k_scale, v_scale); q is [tokens, kv_heads, G + 1, head_dim], the rotated q|k of each group, whose
    first G heads are the queries (the decode kernel reads them in place).
    """
    _check_qkv(k_pool, qkv, cos, sin, slot_mapping)
    qk, v = rotate_qkv(qkv, cos, sin, dtype=dtype)
    return (qk, *write_kv(k_pool, v_pool, qk[:, :, -1], v, slot_mapping, k_scale, v_scale))


def rotate_qkv(qkv, cos, sin, *, dtype=None) -> tuple[jax.Array, jax.Array]:
    """RoPE on a step's q and k, as rope_write_kv writes them: qkv [tokens, kv_heads, G + 2, head_dim] (or [S, ...]
    float32 split-K partials, then `dtype` is required) -> (qk [tokens, kv_heads, G + 1, head_dim]: the rotated
    queries, then the rotated k, of each group; v [tokens, kv_heads, head_dim]), in the projection's dtype."""
    dtype = _projection_dtype(qkv, dtype)
    if qkv.ndim == 5:
        qkv = jnp.sum(qkv, axis=0)  # float32, then rounded as the projection's output would be
    qkv = qkv.astype(dtype)
    tokens, num_kv_heads, stride, head_dim = qkv.shape
    group = stride - 2
    # apply_rope takes [T, heads, D]: the group axes flattened and back (free reshapes).
    qk = apply_rope(qkv[:, :, :group + 1].reshape(tokens, -1, head_dim), cos, sin)
    return qk.reshape(tokens, num_kv_heads, group + 1, head_dim), qkv[:, :, group + 1]


def _projection_dtype(qkv, dtype):
    """The dtype q and the projection are rounded to: `dtype`, or qkv's own when it is not partials."""
    if dtype is not None:
        return jnp.dtype(dtype)
    if qkv.ndim == 5:
        raise ValueError("qkv as split-K partials needs the projection's dtype")
    return qkv.dtype


def rope_write_kv_kernel(
    k_pool: jax.Array,
    v_pool: jax.Array,
    qkv: jax.Array,
    cos: jax.Array,
    sin: jax.Array,
    slot_mapping: jax.Array,
    *,
    dtype=None,
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """RoPE and the KV write of a step as one Pallas kernel (grid: tokens x max(q, KV) heads), float pools.

    Args:
      k_pool, v_pool: [num_blocks, kv_heads, block_size, head_dim], float.
      qkv: [tokens, kv_heads, G + 2, head_dim], the model's fused projection grouped per KV head (its G
        query heads, then k, then v; read in place), or [S, tokens, ...] float32 split-K partials of it
        (the skinny matmul's), summed in the kernel.
      cos, sin: [tokens, head_dim // 2] float32, each token's angles (jaxllm.model.rope.rope_tables).
      slot_mapping: [tokens] int32, `block_id * block_size + row`, distinct and inside the pool (the
        allocator guarantees both); negative entries (padding tokens) write nothing.
      dtype: q's dtype, what the projection is rounded to (default qkv's; needed with partials).

    Returns (q [tokens, kv_heads, G, head_dim] rotated, k_pool, v_pool): the same values as the first
    G heads of each group of rope_write_kv's q, and its pools (to float32 rounding inside the rotation). In
    place under a jit that donates the pools (the model step); called eagerly it returns updated copies.
    """
    if k_pool.dtype == jnp.int8:
        raise ValueError("rope_write_kv_kernel writes float pools; int8 pools (with scales) go through rope_write_kv")
    if v_pool.shape != k_pool.shape or v_pool.dtype != k_pool.dtype:
        raise ValueError(f"v_pool {v_pool.shape} {v_pool.dtype} != k_pool {k_pool.shape} {k_pool.dtype}")
    _check_qkv(k_pool, qkv, cos, sin, slot_mapping)
    interpret = compat.default_interpret(interpret)
    return tuple(_rope_write_kv_kernel(k_pool, v_pool, qkv, cos, sin, slot_mapping,
                                       dtype=_projection_dtype(qkv, dtype), interpret=interpret))
