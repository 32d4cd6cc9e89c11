"""Token sampling on device: greedy, temperature, top-k, top-p, with a per-request seed.

Each row's randomness comes from (its request's seed, the position of the token it samples),
never from the batch, so a request samples the same tokens alone or in a crowded batch, and
again after preemption and recompute.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def greedy_tokens(logits: jax.Array) -> jax.Array:
    """The most likely token of every row ([rows] int32): what sample_tokens gives a temperature-0 row.

    jnp.argmax's answer (the first maximum; the first NaN if any), written as two reductions: over logits split
    on the vocabulary (tensor parallel) XLA runs each as an all-reduce of one value a row, which its own
    all-reduce kernel does in microseconds, where an argmax's (value, index) pair goes through an NCCL all-gather
    that cost 0.66-0.85 ms a decode step on 2 and 4 H100s (benchmarks/NOTES.md, "Tensor parallel decode step").
    """
    best = jnp.max(logits, axis=-1, keepdims=True)
    ids = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    hit = (logits == best) | jnp.isnan(logits)
    return jnp.min(jnp.where(hit, ids, logits.shape[-1]), axis=-1).astype(jnp.int32)


def token_logprobs(logits: jax.Array, tokens: jax.Array, k: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Log-probabilities of the model's distribution (log_softmax of the float32 logits, before any
    temperature or truncation): each row's token and its k most likely tokens.

    Args:
      logits: [rows, vocab]; tokens: [rows] int32 (the tokens sampled from these rows); k: static, <= vocab.
    Returns:
      (token logprob [rows] float32, top ids [rows, k] int32, top logprobs [rows, k] float32), most likely first.
    """
    logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
    top, ids = jax.lax.top_k(logprobs, k)
    return chosen, ids.astype(jnp.int32), top


def sample_tokens(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
                  seeds: jax.Array, positions: jax.Array) -> jax.Array:
    """Sample one token per row.

    Args:
      logits: [rows, vocab] float32.
      temperature, top_p: [rows] float32; temperature 0 means greedy.
      top_k: [rows] int32; 0 disables it.
      seeds, positions: [rows] int32; the position of the token being sampled.
    Returns:
      [rows] int32 token ids.
    """
    greedy = greedy_tokens(logits)
    masked = filtered_logits(logits, temperature, top_k, top_p)

    def draw(row_logits, seed, position):
        key = jax.random.fold_in(jax.random.PRNGKey(seed), position)
        return jax.random.categorical(key, row_logits)

    sampled = jax.vmap(draw)(masked, seeds, positions).astype(jnp.int32)
    return jnp.where(temperature > 0, sampled, greedy)


def filtered_logits(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """[rows, vocab] logits scaled by each row's temperature (1 where it is 0) with the tokens top-k and top-p leave
    out at -inf, in vocabulary order: the distribution a sampled row draws from (its softmax)."""
    vocab = logits.shape[-1]
    scaled = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
    order = jnp.argsort(-scaled, axis=-1)  # [rows, vocab], most likely first
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    rank = jnp.arange(vocab)[None, :]
    keep = (top_k[:, None] <= 0) | (rank < top_k[:, None])
    probs = jax.nn.softmax(jnp.where(keep, sorted_logits, -jnp.inf), axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    # Always keep the most likely token, so top_p never empties a row.
    keep = keep & ((mass_before < top_p[:, None]) | (rank == 0))
    # Back to vocabulary order before drawing: the Gumbel noise must belong to a token id, not to a
    # rank. Two near-equal logits swap ranks when the batch shape changes the matmuls' rounding, and
    # noise drawn per rank then moves to another token: the sample would depend on the batch.
    rows = jnp.arange(logits.shape[0])[:, None]
    keep = jnp.zeros(keep.shape, bool).at[rows, order].set(keep)
    return jnp.where(keep, scaled, -jnp.inf)
