"""DistAttention (Infinite-LLM): attention over a sequence whose rBlocks live on several instances.

Each instance on the mesh's `instance` axis holds its own pool shard; the pools are stacked on a
leading instance axis sharded over it: `[instances, num_blocks, num_kv_heads, block_size, head_dim]`.
The query is replicated to every instance (the query travels to the KV, the KV never moves); inside
`shard_map` every instance attends over what it holds and returns the output with its residuals (row
max, row sum of exponentials), the partials are gathered over the axis and merged exactly with
`residuals.merge_partials`. Every instance ends with the whole result.

Decode: a sequence's KV is cut into parts, one per instance (possibly empty), listed in that instance's
table row with its length. Decode ignores where a part sits in the sequence (every key is visible to the
one query token), so an instance's table may list its rBlocks of the sequence in any order as long as the
partial last rBlock of the sequence, if it holds it, comes last.

Prefill is causal, so it works on PART ROWS (`sharding.prefill_parts`): each run of consecutive table
entries of a sequence on one instance is a row of that instance's ragged batch, with its local table,
its kv_len, its `query_starts` (where its keys sit relative to its queries) and the indices of its query
tokens in the step's packed queries. An instance gathers its rows' query tokens, runs `ragged_prefill`
over its rows with residuals, and the partials of every row on every instance are gathered over the
axis and merged per query token (`merge_partials` by segment). Any number of runs of one sequence may
lie on one instance, in any order.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from pallas_kernels.ragged_decode import DecodeBlockSizes, ragged_decode, ragged_decode_reference
from pallas_kernels.ragged_prefill import PrefillBlockSizes, ragged_prefill, ragged_prefill_reference
from pallas_kernels.residuals import merge_partials


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


def dist_prefill_attention(
    q: jax.Array,
    k_pools: jax.Array,
    v_pools: jax.Array,
    tables: jax.Array,
    kv_lens: jax.Array,
    query_starts: jax.Array,
    cu_q_lens: jax.Array,
    token_index: jax.Array,
    *,
    mesh: Mesh,
    axis: str = "instance",
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
    sm_scale: float | None = None,
    reference: bool = False,
    return_residuals: bool = False,
    block_sizes: PrefillBlockSizes | None = None,
    interpret: bool | None = None,
):
    """Causal ragged attention of packed query tokens over KV spread across the mesh's `axis`, by part rows.

    The last five arrays are `PrefillParts.device_args()` (sharding.prefill_parts): R part rows and T_l
    packed query tokens per instance. Row r of instance i holds keys 0..kv_lens[i, r]-1 of one part of a
    sequence in its local rBlocks tables[i, r]; its query tokens are q[token_index[i, cu_q_lens[i, r]:
    cu_q_lens[i, r + 1]]], the first at position query_starts[i, r] relative to the row's key 0 (each
    sees the row's keys up to its own position). Every query token's result is the exact merge of its
    partials over all rows of all instances.

    Args:
      q: [num_tokens, num_q_heads, head_dim] the step's packed query tokens, replicated.
      k_pools, v_pools: [instances, num_blocks, num_kv_heads, block_size, head_dim], sharded on `axis`
        (float, or int8 with scales).
      tables: [instances, R, W] int32 local rBlock ids of each row.
      kv_lens: [instances, R] int32 keys of each row (0: unused).
      query_starts: [instances, R] int32 first query position of each row, relative to its key 0.
      cu_q_lens: [instances, R + 1] int32 the rows' query tokens packed per instance.
      token_index: [instances, T_l] int32 per packed local token, its index into q; outside
        [0, num_tokens) for padding (ignored).
      mesh, axis: the mesh and its instance axis.
      k_scales, v_scales: [instances, num_blocks, num_kv_heads, block_size] float32 for int8 pools.
      sm_scale: softmax scale, default 1/sqrt(head_dim).
      reference: every instance runs `ragged_prefill_reference` (pure jnp) instead of the kernel.
      return_residuals: also return the merged row max and row sum.
      block_sizes, interpret: the prefill kernel's schedule and interpret flag.

    Returns:
      out [num_tokens, num_q_heads, head_dim] in q.dtype (0 for tokens no row holds: padding), and with
      return_residuals `(row_max, row_sum)` [num_tokens, num_q_heads] float32 (-inf and 0 there), replicated.
    """
    instances = _check(q, k_pools, v_pools, tables, kv_lens, k_scales, v_scales, mesh, axis)
    rows = tables.shape[1]
    if query_starts.shape != kv_lens.shape:
        raise ValueError(f"query_starts {query_starts.shape} must be kv_lens' shape {kv_lens.shape}")
    if cu_q_lens.shape != (instances, rows + 1):
        raise ValueError(f"cu_q_lens {cu_q_lens.shape} must be [instances, rows + 1] = {(instances, rows + 1)}")
    if token_index.ndim != 2 or token_index.shape[0] != instances:
        raise ValueError(f"token_index {token_index.shape} must be [instances={instances}, local tokens]")
    quantized = k_scales is not None
    num_tokens = q.shape[0]

    def local(q, k, v, table, n, starts, cu, index, *scales):
        k_scale, v_scale = (scales[0][0], scales[1][0]) if quantized else (None, None)
        # The query travels to the KV: this instance's rows' tokens, packed (padding reads token 0).
        q_local = q[jnp.clip(index[0], 0, num_tokens - 1)]  # [T_l, Hq, D]
        args = (q_local, k[0], v[0], table[0], n[0], cu[0])
        if reference:
            out, (m, l) = ragged_prefill_reference(*args, query_starts=starts[0], k_scale=k_scale,
                                                   v_scale=v_scale, sm_scale=sm_scale, return_residuals=True)
        else:
            out, (m, l) = ragged_prefill(*args, query_starts=starts[0], k_scale=k_scale, v_scale=v_scale,
                                         sm_scale=sm_scale, return_residuals=True, block_sizes=block_sizes,
                                         interpret=interpret)
        outs, maxes, sums, ids = jax.lax.all_gather((out, m, l, index[0]), axis)  # [I, T_l, ...]
        flat = lambda x: x.reshape((-1,) + x.shape[2:])  # [I * T_l, ...]
        merged, total_max, total_sum = merge_partials(flat(outs), flat(maxes), flat(sums), segment_ids=flat(ids),
                                                      num_segments=num_tokens)
        merged = merged.astype(q.dtype)
        return (merged, (total_max, total_sum)) if return_residuals else merged

    sharded = P(axis)
    scales = (k_scales, v_scales) if quantized else ()
    out_specs = (P(), (P(), P())) if return_residuals else P()
    fn = shard_map(local, mesh, (P(),) + (sharded,) * (7 + len(scales)), out_specs)
    as_i32 = lambda x: jnp.asarray(x, jnp.int32)
    return fn(q, k_pools, v_pools, as_i32(tables), as_i32(kv_lens), as_i32(query_starts), as_i32(cu_q_lens),
              as_i32(token_index), *scales)
