"""DistAttention (Infinite-LLM) inside an engine step: instances run their own batches, attention runs where
the KV lives.

An engine of several instances runs one step over the mesh with every instance's rows side by side: the step
is `shard_map`ped over the `instance` axis (jaxllm.executor), so inside it each instance sees its own tokens
and its own pool shard, the `tensor` axis still partitioned by XLA. A step in which every sequence's rBlocks
are at home runs the ordinary attention on each instance, with no collective at all. A step in which some
sequence has borrowed rBlocks carries `DistParts`, its Kernels carry `DistAttention` (the
`Kernels.distributed` hook of pallas_kernels.dispatch), and each layer's attention becomes:

1. The step's q/k/v projections and RoPE tables are gathered over the instance axis (all_gather): every
   instance now has every instance's new tokens, and writes the K/V of those whose rBlocks it holds
   (`write_slots`: the local slot of each gathered token, -1 elsewhere). A token's K/V is written where
   its rBlock lives; the KV already in the pools never moves.
2. Each instance attends, for every instance's sequences, over the rBlocks it holds of them (`rows`). A decode
   step has one row per gathered sequence and its one query token. A prefill step has one row per sequence with
   PAST keys (before the step's first query of it) on the instance, holding all its query tokens, unmasked
   (sharding.prefill_parts); the step's own new keys (the CHUNK) are attended causally on each sequence's home,
   from a small pool of the step's own K/V (`chunk_*`), since every instance has them after the gather. So a
   prefill step's rows never outnumber its sequences, nor its row queries its tokens, however the rBlocks lie:
   its shapes are its bucket's. The per-part attention is `dispatch.ragged_attention`, the same call as every
   other step's, so it runs the step's Pallas kernels (per tensor shard under tensor parallelism), with the
   kernels' residuals (row max, sum of exponentials); several partials of one token on one instance are merged
   there (`residuals.merge_partials` by segment).
3. The parts are merged exactly, on their home instances, by the same `merge_partials` with its reductions
   done over the axis (`SpreadOverAxis`): a `pmax` of the row maxima, then each instance's rescaled
   numerators and denominators summed and scattered home (`psum_scatter`), one reduce-scatter instead of a
   gather of every part.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels import dispatch
from pallas_kernels.kv_write import quantize_int8, rotate_qkv
from pallas_kernels.residuals import merge_partials
from sharding.mesh import INSTANCE
from sharding.prefill_parts import chunk_block_size

__all__ = ["DistAttention", "DistParts", "SpreadOverAxis"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DistParts:
    """One instance's share of a step's DistAttention (inside the instance shard_map; stacked [I, ...] outside).

    With I instances of T padded tokens and S padded sequences each (gathered index g = instance * T + t):
    write_slots [I*T] int32: the local pool slot of gathered token g's K/V on this instance, -1 if not here.
    row_tables [R, W] int32: this instance's local rBlocks of each row's part (table order).
    row_lens [R] int32: keys of the part (0: an empty row).
    Decode steps (R = I*S, row g is gathered sequence g and its one query token): the rest are None.
    Prefill steps (R = I*S: a row per gathered sequence at most, sharding.prefill_parts): row_query_starts [R]
    int32: the row's key count (every query sees every key); row_cu_q_lens [R+1] int32: the rows' query tokens,
    packed; row_tokens [Q] int32, Q = I*T: the gathered token of each packed row query (padding past
    row_cu_q_lens[-1] points at token 0 and is dropped); token_rows [I*T] int32: the other way, each gathered
    token's packed row query here, -1 if none (a token has at most one: a row per sequence an instance). And this
    instance's chunk (its own T tokens' K/V as a pool of N = ceil(T / c) + S rBlocks of c =
    chunk_block_size(block size) tokens, each sequence from an rBlock of its own, its rows the step's, packed as
    its cu_q_lens): chunk_tokens [N * c] int32: the local token each slot holds (0 where none: never attended);
    chunk_tables [S, ceil(T / c)].
    """

    write_slots: jax.Array
    row_tables: jax.Array
    row_lens: jax.Array
    row_query_starts: jax.Array | None = None
    row_cu_q_lens: jax.Array | None = None
    row_tokens: jax.Array | None = None
    token_rows: jax.Array | None = None
    chunk_tokens: jax.Array | None = None
    chunk_tables: jax.Array | None = None


class SpreadOverAxis:
    """merge_partials' parts laid out over a mesh axis: every member holds a partial of every gathered row
    [members * N, ...]; the merged result of a member's own N rows lands on it (a pmax, then a reduce-scatter)."""

    def __init__(self, axis: str):
        self.axis = axis

    def live(self, row_sum: jax.Array) -> jax.Array:
        return row_sum > 0

    def max(self, x: jax.Array) -> jax.Array:
        return jax.lax.pmax(x, self.axis)

    def expand(self, reduced: jax.Array) -> jax.Array:
        return reduced

    def sum(self, x: jax.Array) -> jax.Array:
        return jax.lax.psum_scatter(x, self.axis, scatter_dimension=0, tiled=True)

    def result(self, reduced: jax.Array) -> jax.Array:
        rows = reduced.shape[0] // jax.lax.axis_size(self.axis)
        return jax.lax.dynamic_slice_in_dim(reduced, jax.lax.axis_index(self.axis) * rows, rows)


def _gather(x, axis: int = 0):
    """Every instance's x, concatenated on `axis` (instance-major)."""
    return jax.lax.all_gather(x, INSTANCE, axis=axis, tiled=True)


@dataclasses.dataclass(frozen=True)
class DistAttention:
    """The `Kernels.distributed` hook: dispatch.paged_attention for a step whose rBlocks lie on several
    instances (the module's steps 1-3). Frozen and hashable: part of the step's static Kernels."""

    axis: str = INSTANCE

    def attention(self, qkv, cos, sin, k_pool, v_pool, k_scale, v_scale, batch: dispatch.AttentionBatch, *,
                  num_q_heads: int, dtype, kernels: dispatch.Kernels):
        """qkv: this instance's fused projection [T, Hkv, G+2, hd] (or [P, T, ...] float32 split-K partials);
        cos, sin: its RoPE tables [T, ...]; the pool and scales: this instance's; batch: this instance's step, its
        DistParts in batch.parts (a prefill's chunk rows are packed as batch.cu_q_lens); kernels: the step's
        Kernels without this hook. Returns (out [T, Hq, hd] in dtype, k_pool, v_pool, k_scale, v_scale)."""
        parts = batch.parts
        token_axis = 1 if qkv.ndim == 5 else 0
        q, k_pool, v_pool, k_scale, v_scale = dispatch.rope_write_kv(
            k_pool, v_pool, _gather(qkv, token_axis), _gather(cos), _gather(sin), parts.write_slots, k_scale,
            v_scale, dtype=dtype, kernels=kernels)  # q: every instance's rotated queries [I*T, Hkv, Gh, hd]
        attend = dict(k_scale=k_scale, v_scale=v_scale, num_q_heads=num_q_heads, kernels=kernels,
                      return_residuals=True)
        if batch.single_query:
            rows = jnp.arange(q.shape[0] + 1, dtype=jnp.int32)  # one query token a row
            out, (row_max, row_sum) = dispatch.ragged_attention(q, k_pool, v_pool, parts.row_tables, parts.row_lens,
                                                                rows, single_query=True, **attend)
        else:
            q_rows = q[parts.row_tokens]  # [Q, ...]: each part row's queries
            out, (row_max, row_sum) = dispatch.ragged_attention(
                q_rows, k_pool, v_pool, parts.row_tables, parts.row_lens, parts.row_cu_q_lens, single_query=False,
                query_starts=parts.row_query_starts, **attend)
            # Per gathered token its one past partial here, by a gather: a scatter-add would start from zeros of
            # [I*T, Hq, hd] float32 a layer, which XLA fuses across layers into one broadcast, all live at once.
            here, at = parts.token_rows >= 0, jnp.maximum(parts.token_rows, 0)
            out = jnp.where(here[:, None, None], out[at].astype(jnp.float32), 0.0)
            row_max = jnp.where(here[:, None], row_max[at], -jnp.inf)
            row_sum = jnp.where(here[:, None], row_sum[at], 0.0)
            chunk = self._chunk(qkv, cos, sin, k_pool, parts, batch.cu_q_lens, dtype=dtype, attend=attend)
            tokens = chunk[0].shape[0]
            start = jax.lax.axis_index(self.axis) * tokens  # this instance's own tokens: their chunk is here
            own = [jax.lax.dynamic_slice_in_dim(x, start, tokens) for x in (out, row_max, row_sum)]
            merged = merge_partials(*(jnp.stack([a, b.astype(a.dtype)]) for a, b in zip(own, chunk)))
            out, row_max, row_sum = (jax.lax.dynamic_update_slice_in_dim(x, m, start, 0)
                                     for x, m in zip((out, row_max, row_sum), merged))
        out, _, _ = merge_partials(out, row_max, row_sum, parts=SpreadOverAxis(self.axis))  # home, exactly
        return out.astype(dtype), k_pool, v_pool, k_scale, v_scale

    @staticmethod
    def _chunk(qkv, cos, sin, k_pool, parts: DistParts, cu_q_lens, *, dtype, attend: dict):
        """This instance's own prefill tokens attending causally to each other (their sequences' chunk keys), from
        a pool of their K/V alone, gathered from the tokens (no pool to clear): (out [T, Hq, hd], row max, row
        sum) per local token. int8 pools: the K/V quantized as the pool holds them."""
        block = chunk_block_size(k_pool.shape[2])
        qk, v = rotate_qkv(qkv, cos, sin, dtype=dtype)
        q, k = qk[:, :, :-1], qk[:, :, -1]

        def as_pool(x):  # [T, Hkv, ...] -> [N, Hkv, block, ...] by the chunk's slots
            x = x[parts.chunk_tokens]
            return jnp.moveaxis(x.reshape((-1, block) + x.shape[1:]), 1, 2)

        if k_pool.dtype == jnp.int8:
            (k, k_scale), (v, v_scale) = quantize_int8(k), quantize_int8(v)
            attend = dict(attend, k_scale=as_pool(k_scale), v_scale=as_pool(v_scale))
        else:
            k, v = k.astype(k_pool.dtype), v.astype(k_pool.dtype)
        lens = cu_q_lens[1:] - cu_q_lens[:-1]  # a sequence's chunk is its query tokens
        out, (row_max, row_sum) = dispatch.ragged_attention(q, as_pool(k), as_pool(v), parts.chunk_tables, lens,
                                                            cu_q_lens, single_query=False, **attend)
        real = jnp.arange(q.shape[0]) < cu_q_lens[-1]
        return out, row_max, jnp.where(real[:, None], row_sum, 0.0)  # padding tokens: no keys
