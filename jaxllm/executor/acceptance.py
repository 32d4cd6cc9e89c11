"""Speculative decoding's acceptance on the device: a verify step's logits -> the tokens each sequence keeps.

A verify step (StepKind.VERIFY) runs Q = k + 1 tokens a sequence over its cached KV: its last token, its n <= k
draft tokens d_1..d_n, then fillers. Column j of the row (j = 0 is the last token) gives the target model's
distribution p_j of the token after it; `drafts[:, j]` is d_{j+1}, the draft p_j decides (-1 past the draft). The
drafts are decided in order, and the first rejection ends the run:

- greedy rows (temperature 0): d_{j+1} is accepted while it is p_j's argmax; the tokens kept are the argmaxes of
  p_0..p_a (a the accepted drafts): exactly the tokens a + 1 plain decode steps would give;
- sampled rows: every draft source here proposes a point mass (prompt lookup, a greedy draft model, a replay),
  so d_{j+1} is accepted with probability p_j(d_{j+1}); at the first rejection the token is drawn from p_j with
  d_{j+1} taken out (renormalised: max(p - q, 0) for a point mass q), and when every draft is accepted a bonus
  token is drawn from p_n. This is the rejection sampling of Leviathan et al. (2023) and Chen et al. (2023): each
  kept token follows the target's distribution exactly. p_j is the sampler's (temperature, top-k, top-p:
  sampler.filtered_logits).

Randomness is per (the row's seed, the position of the token being decided), as in the sampler: the acceptance
draw is a uniform from that key folded once more, the final token a categorical from the key plain sampling uses
at that position. The result is [S, Q]: the a + 1 tokens kept, then -1.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxllm.executor.sampler import filtered_logits, greedy_tokens

__all__ = ["accept_drafts"]


def accept_drafts(logits: jax.Array, drafts: jax.Array, kv_lens: jax.Array, temperature: jax.Array,
                  top_k: jax.Array, top_p: jax.Array, seeds: jax.Array, *, greedy: bool) -> jax.Array:
    """The tokens each sequence of a verify step keeps (see the module docstring).

    Args:
      logits: [S, Q, vocab] float32, every token's (logit bias applied where a row has one).
      drafts: [S, Q] int32, the draft after each token (d_{j+1} at column j), -1 past the row's draft.
      kv_lens: [S] (each sequence's KV with its Q tokens written); temperature, top_p [S] float32, top_k, seeds
        [S] int32.
      greedy: static, every row has temperature 0.
    Returns:
      [S, Q] int32: each sequence's kept tokens (its accepted drafts, then one drawn token), -1 after them.
    """
    num_seqs, queries, vocab = logits.shape
    column = jnp.arange(queries)[None, :]
    valid = drafts >= 0

    def kept(accepted: jax.Array, last) -> jax.Array:
        count = jnp.sum(jnp.cumprod(accepted.astype(jnp.int32), axis=1), axis=1)  # [S]: leading accepted drafts
        return jnp.where(column < count[:, None], drafts,
                         jnp.where(column == count[:, None], last(count)[:, None], -1)).astype(jnp.int32)

    best = greedy_tokens(logits.reshape(-1, vocab)).reshape(num_seqs, queries)  # each column's argmax
    greedy_out = kept(valid & (drafts == best), lambda count: jnp.take_along_axis(best, count[:, None], axis=1)[:, 0])
    if greedy:
        return greedy_out
    repeat = lambda x: jnp.repeat(x, queries)  # noqa: E731  per row -> per token
    masked = filtered_logits(logits.reshape(-1, vocab), repeat(temperature), repeat(top_k), repeat(top_p))
    masked = masked.reshape(num_seqs, queries, vocab)
    p_draft = jnp.take_along_axis(jax.nn.softmax(masked, axis=-1), jnp.maximum(drafts, 0)[..., None], axis=-1)[..., 0]
    positions = (kv_lens - queries + 1)[:, None] + column  # [S, Q]: where each column's token goes

    def uniform(seed, position):
        return jax.random.uniform(jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(seed), position), 1))

    draws = jax.vmap(jax.vmap(uniform, in_axes=(None, 0)))(seeds, positions)  # [S, Q]

    def last(count):
        pick = lambda x: jnp.take_along_axis(x, count[:, None], axis=1)[:, 0]  # noqa: E731
        rejected = pick(drafts)  # -1 where every draft was accepted: nothing taken out
        at = jnp.take_along_axis(masked, count[:, None, None], axis=1)[:, 0]  # [S, vocab]
        at = jnp.where(jnp.arange(vocab)[None, :] == rejected[:, None], -jnp.inf, at)

        def draw(row_logits, seed, position):
            return jax.random.categorical(jax.random.fold_in(jax.random.PRNGKey(seed), position), row_logits)

        return jax.vmap(draw)(at, seeds, pick(positions)).astype(jnp.int32)

    sampled_out = kept(valid & (draws < p_draft), last)
    return jnp.where((temperature > 0)[:, None], sampled_out, greedy_out)
