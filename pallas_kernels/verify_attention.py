"""Verify attention: each sequence's Q query tokens (speculative decoding's verify step: its last token and Q - 1
draft tokens) over its KV in the rBlock pool, as a decode over the keys before them plus a small causal part.

In a verify step every sequence has exactly Q query tokens, packed in sequence order: token s * Q + i is query i
of sequence s, at position kv_len - Q + i (its kv_len counts them). Every one of them sees all L0 = kv_len - Q
earlier keys, so that part is a decode with Q x G query rows per KV head instead of G: the decode kernel
(pallas_kernels.ragged_decode: the KV split over work items, a KV head's rows in one tile of at least 16 rows, of
which MHA used one) reads the long KV once for all Q tokens, where a prefill kernel gives one query block a head
and reads a long KV on a few SMs. The Q newest keys (this step's, written by it) are read back through the table,
Q x Hkv rows a sequence, and attended causally in jnp; the two parts merge exactly with their residuals
(pallas_kernels.residuals). The result is ragged causal attention's (`verify_attention_reference`, the prefill
reference with cu_q_lens = arange x Q).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from pallas_kernels import kv_layout
from pallas_kernels.ragged_prefill import ragged_prefill_reference
from pallas_kernels.residuals import merge_partials

__all__ = ["verify_attention", "verify_attention_reference"]


def verify_attention(
    q: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array,
    block_tables: jax.Array,
    kv_lens: jax.Array,
    *,
    queries: int,
    past: Callable,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
    num_q_heads: int | None = None,
    sm_scale: float | None = None,
    return_residuals: bool = False,
):
    """Causal attention of Q query tokens a sequence to its KV (see the module docstring).

    Args:
      q: [S * Q, Hq, D], or grouped per KV head [S * Q, Hkv, Gh, D] of which the first num_q_heads // Hkv of each
        group are the queries (rope_write_kv's q).
      k_pool, v_pool: [num_blocks, Hkv, block_size, D] (float, or int8 with k_scale / v_scale [num_blocks, Hkv,
        block_size]).
      block_tables: [S, W] int32; kv_lens: [S] int32, each sequence's KV with its Q query tokens (0: a padding
        sequence, whose tokens attend to nothing).
      queries: Q (static), the query tokens of every sequence.
      past: the decode attention over the earlier keys, with ragged_decode's arguments: past(q [S, Hkv, Q * G, D],
        k_pool, v_pool, block_tables, kv_lens, k_scale=, v_scale=, num_q_heads=, return_residuals=True) ->
        (out [S, Hkv * Q * G, D], (row_max, row_sum) [S, Hkv * Q * G]).
      return_residuals: also return (row max, row sum of exponentials) [S * Q, Hq] float32.

    Returns:
      out [S * Q, Hq, D] in q.dtype (heads in group order), and with residuals (out, (row_max, row_sum)).
    """
    num_seqs = kv_lens.shape[0]
    num_kv_heads, block_size, head_dim = k_pool.shape[1], k_pool.shape[2], k_pool.shape[3]
    if q.shape[0] != num_seqs * queries:
        raise ValueError(f"a verify step has {queries} query tokens a sequence: q's {q.shape[0]} tokens != "
                         f"{num_seqs} sequences x {queries}")
    if q.ndim == 3:
        hq = q.shape[1] if num_q_heads is None else num_q_heads
        q = q[:, :hq].reshape(q.shape[0], num_kv_heads, hq // num_kv_heads, head_dim)
    group = (q.shape[1] * q.shape[2] if num_q_heads is None else num_q_heads) // num_kv_heads
    q = q[:, :, :group].reshape(num_seqs, queries, num_kv_heads, group, head_dim)  # [S, Q, Hkv, G, D]
    scale = head_dim ** -0.5 if sm_scale is None else sm_scale
    first = jnp.maximum(kv_lens - queries, 0)  # [S]: the keys every query of the sequence sees

    # The earlier keys: one decode over them with a KV head's Q x G query rows together.
    rows = q.transpose(0, 2, 1, 3, 4).reshape(num_seqs, num_kv_heads, queries * group, head_dim)
    past_out, (past_max, past_sum) = past(rows, k_pool, v_pool, block_tables, first, k_scale=k_scale,
                                          v_scale=v_scale, num_q_heads=num_kv_heads * queries * group,
                                          return_residuals=True)

    def as_queries(x):  # [S, Hkv * Q * G, ...] -> [S, Q, Hkv, G, ...]
        x = x.reshape((num_seqs, num_kv_heads, queries, group) + x.shape[2:])
        return jnp.moveaxis(x, 2, 1)

    past_out, past_max, past_sum = as_queries(past_out), as_queries(past_max), as_queries(past_sum)

    # The step's own keys: positions first .. first + Q - 1, read back through the table.
    positions = first[:, None] + jnp.arange(queries)[None, :]  # [S, Q]
    present = positions < kv_lens[:, None]  # padding sequences (kv_len 0) have none
    entry = jnp.clip(positions // block_size, 0, block_tables.shape[1] - 1)
    blocks = jnp.take_along_axis(block_tables, entry, axis=1)  # [S, Q]
    offsets = positions % block_size

    def new_keys(pool, scale_pool):  # [S, Q, Hkv, D] float32, 0 where absent (whatever the pool holds there)
        values = kv_layout.dequantize(pool[blocks, :, offsets], None if scale_pool is None
                                      else scale_pool[blocks, :, offsets])
        return jnp.where(present[:, :, None, None], values, 0.0)

    keys, values = new_keys(k_pool, k_scale), new_keys(v_pool, v_scale)
    highest = jax.lax.Precision.HIGHEST
    scores = jnp.einsum("sihgd,sjhd->sihgj", q.astype(jnp.float32), keys, precision=highest) * scale
    visible = (jnp.arange(queries)[None, :] <= jnp.arange(queries)[:, None])[None] & present[:, None, :]  # [S, Qi, Qj]
    scores = jnp.where(visible[:, :, None, None, :], scores, -jnp.inf)
    own_max = jnp.max(scores, axis=-1)  # [S, Q, Hkv, G]
    safe_max = jnp.where(jnp.isfinite(own_max), own_max, 0.0)
    p = jnp.exp(scores - safe_max[..., None])
    own_sum = jnp.sum(p, axis=-1)
    own_out = jnp.einsum("sihgj,sjhd->sihgd", p, values, precision=highest)
    own_out = own_out / jnp.where(own_sum > 0, own_sum, 1.0)[..., None]

    out, row_max, row_sum = merge_partials(jnp.stack([past_out.astype(jnp.float32), own_out]),
                                           jnp.stack([past_max, own_max]), jnp.stack([past_sum, own_sum]))
    tokens = num_seqs * queries
    out = out.reshape(tokens, num_kv_heads * group, head_dim).astype(q.dtype)
    if return_residuals:
        return out, (row_max.reshape(tokens, -1), row_sum.reshape(tokens, -1))
    return out


def verify_attention_reference(q, k_pool, v_pool, block_tables, kv_lens, *, queries: int, k_scale=None,
                               v_scale=None, sm_scale=None, return_residuals: bool = False):
    """Pure-jnp verify attention: ragged prefill with Q query tokens a sequence (q [S * Q, Hq, D]); same results as
    `verify_attention`. A padding sequence (kv_len 0) holds Q tokens too: their rows have no keys (out 0)."""
    num_seqs = kv_lens.shape[0]
    cu_q_lens = jnp.arange(num_seqs + 1, dtype=jnp.int32) * queries
    # A kv_len below Q would place the first queries before position 0: there they see no key, as in the kernel.
    return ragged_prefill_reference(q, k_pool, v_pool, block_tables, kv_lens, cu_q_lens, k_scale=k_scale,
                                    v_scale=v_scale, sm_scale=sm_scale, return_residuals=return_residuals)
