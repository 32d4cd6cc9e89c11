"""Ragged prefill: packed query tokens of many sequences attending causally to their KV in the rBlock pool.

Sequence `s` owns query tokens `cu_q_lens[s]:cu_q_lens[s+1]` of the packed batch. Its KV
(already written, these tokens included) has `kv_lens[s]` tokens, so its `i`-th query token sits
at position `kv_lens[s] - q_len[s] + i` and attends to keys `0..position`. KV cached before this
chunk (chunked prefill, shared prefixes) is simply the part of the KV before the first query
position. Decode is the case `q_len == 1`. Tokens past `cu_q_lens[-1]` are padding: output 0.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import kv_layout, validation

# Fewer token rows at a time keeps the reference's memory at O(chunk * context) on long prompts.
_REFERENCE_TOKEN_CHUNK = 64


def token_positions(cu_q_lens: jax.Array, kv_lens: jax.Array, num_tokens: int):
    """Per packed token: (sequence index [T], position in its sequence [T], is-real-token [T])."""
    num_seqs = kv_lens.shape[0]
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(cu_q_lens, t, side="right") - 1, 0, num_seqs - 1).astype(jnp.int32)
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    position = kv_lens[seq] - q_lens[seq] + (t - cu_q_lens[seq])
    real = t < cu_q_lens[num_seqs]
    return seq, position, real


@functools.partial(jax.jit, static_argnames=("sm_scale", "return_residuals"))
def ragged_prefill_reference(
    q: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array,
    block_tables: jax.Array,
    kv_lens: jax.Array,
    cu_q_lens: jax.Array,
    *,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
    sm_scale: float | None = None,
    return_residuals: bool = False,
):
    """Pure-jnp ragged causal attention over the rBlock pool, computed in float32.

    Args:
      q: [num_tokens, num_q_heads, head_dim] packed query tokens.
      k_pool, v_pool: [num_blocks, num_kv_heads, block_size, head_dim] (float, or int8 with scales).
      block_tables: [num_seqs, max_blocks_per_seq] int32.
      kv_lens: [num_seqs] int32, KV tokens of each sequence including this chunk's.
      cu_q_lens: [num_seqs + 1] int32 cumulative query-token counts.
      k_scale, v_scale: [num_blocks, num_kv_heads, block_size] float32 for int8 pools.
      sm_scale: softmax scale, default 1/sqrt(head_dim).
      return_residuals: also return the row max and row sum of exponentials.

    Returns:
      out [num_tokens, num_q_heads, head_dim] in q.dtype (normalised; 0 for rows with no keys), and
      with residuals `(out, (row_max, row_sum))`, each [num_tokens, num_q_heads] float32
      (-inf and 0 for rows with no keys).
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_pool.shape[1]
    group = num_q_heads // num_kv_heads
    scale = sm_scale if sm_scale is not None else head_dim ** -0.5
    keys = kv_layout.gather_sequences(k_pool, k_scale, block_tables)  # [S, Hkv, L, D]
    values = kv_layout.gather_sequences(v_pool, v_scale, block_tables)  # [S, Hkv, L, D]
    seq, position, real = token_positions(cu_q_lens, kv_lens, num_tokens)
    key_index = jnp.arange(keys.shape[2])

    def one_token(args):
        q_t, s, pos, is_real = args  # q_t [Hq, D]
        q_t = q_t.astype(jnp.float32).reshape(num_kv_heads, group, head_dim)
        scores = jnp.einsum("kgd,kld->kgl", q_t, keys[s]) * scale  # [Hkv, G, L]
        visible = (key_index <= pos) & (key_index < kv_lens[s]) & is_real  # [L]
        scores = jnp.where(visible, scores, -jnp.inf)
        row_max = jnp.max(scores, axis=-1)  # [Hkv, G]
        safe_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
        p = jnp.exp(scores - safe_max[..., None])
        row_sum = jnp.sum(p, axis=-1)
        out = jnp.einsum("kgl,kld->kgd", p, values[s]) / jnp.where(row_sum > 0, row_sum, 1.0)[..., None]
        return (out.reshape(num_q_heads, head_dim), row_max.reshape(num_q_heads), row_sum.reshape(num_q_heads))

    out, row_max, row_sum = jax.lax.map(one_token, (q, seq, position, real), batch_size=_REFERENCE_TOKEN_CHUNK)
    out = out.astype(q.dtype)
    if return_residuals:
        return out, (row_max, row_sum)
    return out


def check_ragged_prefill_args(q, k_pool, v_pool, block_tables, kv_lens, cu_q_lens, k_scale=None, v_scale=None,
                              head_dims=validation.SUPPORTED_HEAD_DIMS) -> None:
    """Raise ValueError naming the value and the limit for malformed ragged-prefill arguments."""
    if q.ndim != 3:
        raise ValueError(f"q must be [num_tokens, num_q_heads, head_dim], got shape {q.shape}")
    validation.check_pool(q, k_pool, v_pool, k_scale, v_scale, head_dims=head_dims)
    validation.check_tables(block_tables, kv_lens, k_pool.shape[0], k_pool.shape[2])
    validation.check_cu_q_lens(cu_q_lens, block_tables.shape[0], q.shape[0], kv_lens)
