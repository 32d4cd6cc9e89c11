"""DistAttention inside an engine step: instances run their own batches, attention runs where the KV lives.

An engine of several instances runs one step over the mesh with every instance's rows side by side: the
step is `shard_map`ped over the `instance` axis (jaxllm.engine.instance_runner), so inside it each instance
sees its own tokens and its own pool shard, the `tensor` axis still partitioned by XLA. A step in which every
sequence's rBlocks are at home runs the ordinary attention on each instance, with no collective at all. A
step in which some sequence has borrowed rBlocks carries `DistParts` and each layer's attention becomes:

1. The step's q/k/v projections and RoPE tables are gathered over the instance axis (all_gather): every
   instance now has every instance's new tokens, and writes the K/V of those whose rBlocks it holds
   (`write_slots`: the local slot of each gathered token, -1 elsewhere). A token's K/V is written where
   its rBlock lives; the KV already in the pools never moves.
2. Each instance attends, for every instance's sequences, over the rBlocks it holds of them (`rows`: one row
   per part; a decode step has one row per gathered sequence, a prefill step one row per run of consecutive
   rBlocks holding the query tokens that can see it (sharding.prefill_parts), the run's start placed by the
   kernel's `query_starts`), with the kernels' residuals (row max, sum
   of exponentials). Several rows of one sequence on one instance are merged there (segment max / sum).
3. The parts are merged exactly, on their home instances: a `pmax` of the row maxima, then each instance's
   rescaled numerators and denominators summed and scattered home (`psum_scatter`): residuals.merge_partials'
   arithmetic, as one reduce-scatter over the axis instead of a gather of every part.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels.ragged_decode import ragged_decode, ragged_decode_reference
from pallas_kernels.ragged_prefill import ragged_prefill, ragged_prefill_reference
from sharding.mesh import INSTANCE

__all__ = ["DistParts", "dist_attention"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DistParts:
    """One instance's share of a step's DistAttention (inside the instance shard_map; stacked [I, ...] outside).

    With I instances of T padded tokens and S padded sequences each (gathered index g = instance * T + t):
    write_slots [I*T] int32: the local pool slot of gathered token g's K/V on this instance, -1 if not here.
    row_tables [R, W] int32: this instance's local rBlocks of each row's part (table order).
    row_lens [R] int32: keys of the part (0: an empty row).
    Decode steps (R = I*S, row g is gathered sequence g and its one query token): the rest are None.
    Prefill steps: row_query_starts [R] int32: the position of the row's first query token relative to the
    part's first key; row_cu_q_lens [R+1] int32: the rows' query tokens, packed; row_tokens [Q] int32: the
    gathered token of each packed row query (padding rows past row_cu_q_lens[-1] point at token 0 and are
    dropped).
    """

    write_slots: jax.Array
    row_tables: jax.Array
    row_lens: jax.Array
    row_query_starts: jax.Array | None = None
    row_cu_q_lens: jax.Array | None = None
    row_tokens: jax.Array | None = None


def _gather(x, axis: int = 0):
    """Every instance's x, concatenated on `axis` (instance-major)."""
    return jax.lax.all_gather(x, INSTANCE, axis=axis, tiled=True)


def _queries(q, num_q_heads: int):
    """rope_write_kv's grouped q [N, Hkv, Gh, hd] (or [N, Hq, hd]) as [N, Hq, hd]."""
    if q.ndim == 4:
        group = num_q_heads // q.shape[1]
        q = q[:, :, :group].reshape(q.shape[0], -1, q.shape[-1])
    return q


def _segment_merge(out, row_max, row_sum, segments, num_segments: int):
    """Partials of packed row queries [Q, ...] merged per gathered token [num_segments, ...] (float32)."""
    seg_max = jax.ops.segment_max(row_max, segments, num_segments=num_segments)
    safe = jnp.where(jnp.isfinite(seg_max), seg_max, 0.0)
    weight = jnp.where(row_sum > 0, row_sum * jnp.exp(row_max - safe[segments]), 0.0)
    out = jnp.where(weight[..., None] > 0, out.astype(jnp.float32), 0.0)
    num = jax.ops.segment_sum(out * weight[..., None], segments, num_segments=num_segments)
    den = jax.ops.segment_sum(weight, segments, num_segments=num_segments)
    return num / jnp.where(den > 0, den, 1.0)[..., None], seg_max, den


def _merge_home(out, row_max, row_sum, dtype):
    """Every instance's partials of every gathered token [I*T, Hq, hd] -> this instance's tokens, merged
    exactly [T, Hq, hd] (merge_partials' arithmetic as a pmax and a reduce-scatter)."""
    total_max = jax.lax.pmax(row_max, INSTANCE)
    safe = jnp.where(jnp.isfinite(total_max), total_max, 0.0)
    weight = jnp.where(row_sum > 0, row_sum * jnp.exp(row_max - safe), 0.0)  # [I*T, Hq]
    # A token that saw no key here contributes nothing, whatever its (unread) output holds.
    out = jnp.where(weight[..., None] > 0, out.astype(jnp.float32), 0.0)
    num = jax.lax.psum_scatter(out * weight[..., None], INSTANCE, scatter_dimension=0, tiled=True)
    den = jax.lax.psum_scatter(weight, INSTANCE, scatter_dimension=0, tiled=True)
    return (num / jnp.where(den > 0, den, 1.0)[..., None]).astype(dtype)


def dist_attention(qkv, cos, sin, k_pool, v_pool, k_scale, v_scale, parts: DistParts, *, decode: bool,
                   num_q_heads: int, dtype, kernels, rope_write_kv):
    """One layer's K/V write and attention for a step with borrowed rBlocks (the module's steps 1-3).

    qkv: this instance's fused projection [T, Hkv, G+2, hd] (or [P, T, ...] float32 split-K partials);
    cos, sin: its RoPE tables [T, ...]; the pool and scales: this instance's; kernels: the step's Kernels
    (`decode_attention` / `prefill_attention` "reference" runs the pure-jnp references, anything else the
    Triton kernels); rope_write_kv: pallas_kernels.dispatch.rope_write_kv.
    Returns (out [T, Hq, hd] in dtype, k_pool, v_pool, k_scale, v_scale).
    """
    token_axis = 1 if qkv.ndim == 5 else 0
    q, k_pool, v_pool, k_scale, v_scale = rope_write_kv(
        k_pool, v_pool, _gather(qkv, token_axis), _gather(cos), _gather(sin), parts.write_slots, k_scale, v_scale,
        dtype=dtype, kernels=kernels)
    q = _queries(q, num_q_heads)  # [I*T, Hq, hd], every instance's rotated queries
    interpret = kernels.interpret
    if decode:
        if kernels.decode_attention == "reference":
            out, (m, l) = ragged_decode_reference(q, k_pool, v_pool, parts.row_tables, parts.row_lens,
                                                  k_scale=k_scale, v_scale=v_scale, return_residuals=True)
        else:
            out, (m, l) = ragged_decode(q, k_pool, v_pool, parts.row_tables, parts.row_lens, k_scale=k_scale,
                                        v_scale=v_scale, return_residuals=True,
                                        block_sizes=kernels.decode_block_sizes, interpret=interpret)
    else:
        q_rows = q[parts.row_tokens]  # [Q, Hq, hd]
        args = (q_rows, k_pool, v_pool, parts.row_tables, parts.row_lens, parts.row_cu_q_lens)
        if kernels.prefill_attention == "reference":
            out, (m, l) = ragged_prefill_reference(*args, k_scale=k_scale, v_scale=v_scale,
                                                   query_starts=parts.row_query_starts, return_residuals=True)
        else:  # the Triton kernel takes parts; the Mosaic one does not
            out, (m, l) = ragged_prefill(*args, k_scale=k_scale, v_scale=v_scale,
                                         query_starts=parts.row_query_starts, return_residuals=True,
                                         block_sizes=kernels.prefill_block_sizes, interpret=interpret)
        real = jnp.arange(q_rows.shape[0]) < parts.row_cu_q_lens[-1]
        l = jnp.where(real[:, None], l, 0.0)
        m = jnp.where(real[:, None], m, -jnp.inf)
        out, m, l = _segment_merge(out, m, l, parts.row_tokens, q.shape[0])
    return _merge_home(out, m, l, dtype), k_pool, v_pool, k_scale, v_scale
