"""DistAttention (Infinite-LLM): attention over a sequence whose rBlocks live on several instances.

Each instance on the mesh's `instance` axis holds its own pool shard; the pools are stacked on a
leading instance axis sharded over it: `[instances, num_blocks, num_kv_heads, block_size, head_dim]`.
A sequence's KV is cut into parts, one per instance (possibly empty): instance i holds positions
`[start_i, start_i + len_i)` in its local rBlocks, listed in its own table row, the part's first token
at row 0 of the first local rBlock. The query is replicated to every instance (the query travels to the
KV, the KV never moves); inside `shard_map` every instance attends over its own part and returns the
output with its residuals (row max, row sum of exponentials), the parts are gathered over the axis and
merged exactly with `residuals.merge_partials`. Every instance ends with the whole result.

Decode ignores where a part sits in the sequence (every key is visible to the one query token), so an
instance's table may list its rBlocks of the sequence in any order as long as the partial last rBlock
of the sequence, if it holds it, comes last. Prefill is causal: its parts carry their start positions.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from pallas_kernels import kv_layout
from pallas_kernels.ragged_decode import DecodeBlockSizes, ragged_decode, ragged_decode_reference
from pallas_kernels.ragged_prefill import token_positions
from pallas_kernels.residuals import merge_partials

# Token rows at a time in the prefill part math: memory O(chunk x local context).
_TOKEN_CHUNK = 64


def shard_map(f, mesh: Mesh, in_specs, out_specs):
    """`jax.shard_map` (0.10+ and 0.11) or the older experimental one; replication is not checked (the
    Pallas kernels inside have no replication rule). To move to pallas_kernels/compat.py."""
    if hasattr(jax, "shard_map"):
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    from jax.experimental.shard_map import shard_map as experimental_shard_map

    return experimental_shard_map(f, mesh, in_specs, out_specs, check_rep=False)


def _check(q, k_pools, v_pools, tables, lens, k_scales, v_scales, mesh: Mesh, axis: str) -> int:
    if axis not in mesh.shape:
        raise ValueError(f"mesh has no axis {axis!r}; its axes are {tuple(mesh.shape)}")
    instances = mesh.shape[axis]
    if k_pools.ndim != 5 or k_pools.shape != v_pools.shape:
        raise ValueError(f"k_pools {k_pools.shape} and v_pools {v_pools.shape} must be the same "
                         f"[instances, num_blocks, num_kv_heads, block_size, head_dim]")
    if k_pools.shape[0] != instances:
        raise ValueError(f"pools stack {k_pools.shape[0]} instances; the mesh axis {axis!r} has {instances}")
    if (k_scales is None) != (v_scales is None) or (k_scales is None) == (k_pools.dtype == jnp.int8):
        raise ValueError(f"int8 pools need k_scales and v_scales, others neither; pools are {k_pools.dtype}, "
                         f"scales given: {k_scales is not None}, {v_scales is not None}")
    if tables.ndim != 3 or tables.shape[0] != instances:
        raise ValueError(f"tables {tables.shape} must be [instances={instances}, num_seqs, max_blocks]")
    if lens.shape != tables.shape[:2]:
        raise ValueError(f"lens {lens.shape} must be [instances, num_seqs] = {tables.shape[:2]}")
    if q.shape[-1] != k_pools.shape[-1]:
        raise ValueError(f"q head_dim {q.shape[-1]} != pool head_dim {k_pools.shape[-1]}")
    return instances


def _merge(out, row_max, row_sum, axis: str, dtype, return_residuals: bool):
    """Gather every instance's part and merge them: out [...] (dtype), residuals [..] float32."""
    parts = jax.lax.all_gather((out, row_max, row_sum), axis)  # each [instances, ...]
    merged, total_max, total_sum = merge_partials(*parts)
    merged = merged.astype(dtype)
    return (merged, (total_max, total_sum)) if return_residuals else merged


def dist_decode_attention(
    q: jax.Array,
    k_pools: jax.Array,
    v_pools: jax.Array,
    tables: jax.Array,
    lens: jax.Array,
    *,
    mesh: Mesh,
    axis: str = "instance",
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
    sm_scale: float | None = None,
    reference: bool = False,
    return_residuals: bool = False,
    block_sizes: DecodeBlockSizes | None = None,
    interpret: bool | None = None,
):
    """Decode attention (one query token per sequence) over KV spread across the mesh's `axis`.

    Args:
      q: [num_seqs, num_q_heads, head_dim], replicated.
      k_pools, v_pools: [instances, num_blocks, num_kv_heads, block_size, head_dim], sharded on `axis`
        (float, or int8 with scales).
      tables: [instances, num_seqs, max_blocks] int32: each instance's local rBlocks of each sequence.
      lens: [instances, num_seqs] int32: KV tokens of each sequence held by each instance (0: none).
      mesh, axis: the mesh and its instance axis.
      k_scales, v_scales: [instances, num_blocks, num_kv_heads, block_size] float32 for int8 pools.
      sm_scale: softmax scale, default 1/sqrt(head_dim).
      reference: every instance runs `ragged_decode_reference` (pure jnp) instead of the kernel.
      return_residuals: also return the merged row max and row sum.
      block_sizes, interpret: the decode kernel's schedule and interpret flag.

    Returns:
      out [num_seqs, num_q_heads, head_dim] in q.dtype (and `(row_max, row_sum)` [num_seqs, num_q_heads]
      float32 with return_residuals), replicated.
    """
    _check(q, k_pools, v_pools, tables, lens, k_scales, v_scales, mesh, axis)
    quantized = k_scales is not None

    def local(q, k, v, table, n, *scales):
        k_scale, v_scale = (scales[0][0], scales[1][0]) if quantized else (None, None)
        args = (q, k[0], v[0], table[0], n[0])
        if reference:
            out, (m, l) = ragged_decode_reference(*args, k_scale=k_scale, v_scale=v_scale, sm_scale=sm_scale,
                                                  return_residuals=True)
        else:
            out, (m, l) = ragged_decode(*args, k_scale=k_scale, v_scale=v_scale, sm_scale=sm_scale,
                                        return_residuals=True, block_sizes=block_sizes, interpret=interpret)
        return _merge(out, m, l, axis, q.dtype, return_residuals)

    sharded = P(axis)
    scales = (k_scales, v_scales) if quantized else ()
    out_specs = (P(), (P(), P())) if return_residuals else P()
    fn = shard_map(local, mesh, (P(),) + (sharded,) * (4 + len(scales)), out_specs)
    return fn(q, k_pools, v_pools, tables.astype(jnp.int32), lens.astype(jnp.int32), *scales)


def _part_prefill(q, k_pool, v_pool, table, starts, lens, cu_q_lens, kv_lens, k_scale, v_scale, sm_scale):
    """One instance's part of causal ragged attention, float32 math (ragged_prefill_reference's, with keys
    at positions start + j for j < len): (out [T, Hq, D] float32, row_max, row_sum [T, Hq])."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_pool.shape[1]
    group = num_q_heads // num_kv_heads
    seq, position, real = token_positions(cu_q_lens, kv_lens, num_tokens)
    local_index = jnp.arange(table.shape[1] * k_pool.shape[2])
    highest = jax.lax.Precision.HIGHEST

    def one_token(args):
        q_t, s, pos, is_real = args  # q_t [Hq, D]
        keys = kv_layout.gather_sequences(k_pool, k_scale, table[s][None])[0]  # [Hkv, L, D]
        values = kv_layout.gather_sequences(v_pool, v_scale, table[s][None])[0]
        # A key at absolute position p is visible to a query at position pos iff p <= pos.
        visible = (local_index < lens[s]) & (starts[s] + local_index <= pos) & is_real  # [L]
        keys = jnp.where(visible[None, :, None], keys, 0.0)  # rows outside the part may hold anything
        values = jnp.where(visible[None, :, None], values, 0.0)
        q_t = q_t.astype(jnp.float32).reshape(num_kv_heads, group, head_dim)
        scores = jnp.einsum("kgd,kld->kgl", q_t, keys, precision=highest) * sm_scale  # [Hkv, G, L]
        scores = jnp.where(visible, scores, -jnp.inf)
        row_max = jnp.max(scores, axis=-1)  # [Hkv, G]
        safe_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
        p = jnp.exp(scores - safe_max[..., None])
        row_sum = jnp.sum(p, axis=-1)
        out = jnp.einsum("kgl,kld->kgd", p, values, precision=highest) / jnp.where(row_sum > 0, row_sum, 1.0)[..., None]
        return out.reshape(num_q_heads, head_dim), row_max.reshape(num_q_heads), row_sum.reshape(num_q_heads)

    return jax.lax.map(one_token, (q, seq, position, real), batch_size=_TOKEN_CHUNK)


def dist_prefill_attention(
    q: jax.Array,
    k_pools: jax.Array,
    v_pools: jax.Array,
    tables: jax.Array,
    starts: jax.Array,
    lens: jax.Array,
    cu_q_lens: jax.Array,
    kv_lens: jax.Array,
    *,
    mesh: Mesh,
    axis: str = "instance",
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
    sm_scale: float | None = None,
    return_residuals: bool = False,
):
    """Causal ragged attention of packed query tokens over KV spread across the mesh's `axis` (pure jnp).

    Sequence s owns query tokens cu_q_lens[s]:cu_q_lens[s+1], at positions kv_lens[s] - q_len + i
    (as in `ragged_prefill`); instance i holds its positions [starts[i, s], starts[i, s] + lens[i, s]).

    Args:
      q: [num_tokens, num_q_heads, head_dim], replicated.
      k_pools, v_pools, k_scales, v_scales, tables, mesh, axis, sm_scale: as in `dist_decode_attention`.
      starts: [instances, num_seqs] int32, the position of each part's first token.
      lens: [instances, num_seqs] int32, the part's tokens (0: none).
      cu_q_lens: [num_seqs + 1] int32, replicated.
      kv_lens: [num_seqs] int32, each sequence's whole KV length (this chunk's tokens included), replicated.

    Returns:
      out [num_tokens, num_q_heads, head_dim] in q.dtype (0 for padding tokens), and with
      return_residuals `(row_max, row_sum)` [num_tokens, num_q_heads] float32, replicated.
    """
    _check(q, k_pools, v_pools, tables, lens, k_scales, v_scales, mesh, axis)
    if starts.shape != lens.shape:
        raise ValueError(f"starts {starts.shape} must be lens' shape {lens.shape}")
    if cu_q_lens.shape != (tables.shape[1] + 1,) or kv_lens.shape != (tables.shape[1],):
        raise ValueError(f"cu_q_lens {cu_q_lens.shape} and kv_lens {kv_lens.shape} must be [num_seqs + 1] and "
                         f"[num_seqs] with num_seqs = {tables.shape[1]}")
    quantized = k_scales is not None
    scale = float(sm_scale) if sm_scale is not None else q.shape[-1] ** -0.5

    def local(q, cu, kv, k, v, table, start, n, *scales):
        k_scale, v_scale = (scales[0][0], scales[1][0]) if quantized else (None, None)
        out, m, l = _part_prefill(q, k[0], v[0], table[0], start[0], n[0], cu, kv, k_scale, v_scale, scale)
        return _merge(out, m, l, axis, q.dtype, return_residuals)

    sharded = P(axis)
    scales = (k_scales, v_scales) if quantized else ()
    out_specs = (P(), (P(), P())) if return_residuals else P()
    fn = shard_map(local, mesh, (P(),) * 3 + (sharded,) * (5 + len(scales)), out_specs)
    return fn(q, cu_q_lens.astype(jnp.int32), kv_lens.astype(jnp.int32), k_pools, v_pools, tables.astype(jnp.int32),
              starts.astype(jnp.int32), lens.astype(jnp.int32), *scales)
