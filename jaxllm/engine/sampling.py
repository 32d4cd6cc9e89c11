"""Token sampling on device: greedy, temperature, top-k, top-p, with a per-request seed.

Each row's randomness comes from (its request's seed, the position of the token it samples),
never from the batch, so a request samples the same tokens alone or in a crowded batch, and
again after preemption and recompute.
"""

from __future__ import annotations

import dataclasses
import numbers

import jax
import jax.numpy as jnp

SEED_LIMIT = 2**31  # seeds are in [0, SEED_LIMIT): they travel as int32


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False  # EOS only: stop_token_ids still stop
    stop_token_ids: tuple[int, ...] = ()  # token ids that end the request like EOS (not appended)
    # None: off. k >= 0: each new token's log-probability and the k most likely tokens' (id, logprob),
    # of the model's distribution before temperature/top-k/top-p (as OpenAI and vLLM report them).
    logprobs: int | None = None

    def __post_init__(self):
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if not (isinstance(self.temperature, (int, float)) and self.temperature >= 0 and self.temperature < float("inf")):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (an integer; 0 disables it), got {self.top_k!r}")
        if not (isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not (0 <= self.seed < SEED_LIMIT):
            raise ValueError(f"seed must be in [0, 2**31) (an integer), got {self.seed!r}")
        stop = self.stop
        if stop is None:
            stop = ()
        elif isinstance(stop, str):
            stop = (stop,)
        try:
            stop = tuple(stop)
        except TypeError:
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}") from None
        for s in stop:
            if not isinstance(s, str) or not s:
                # "" and [""] alike: an empty stop string would end every request at once.
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
        object.__setattr__(self, "stop", stop)
        ids = () if self.stop_token_ids is None else self.stop_token_ids
        try:
            ids = tuple(ids)
        except TypeError:
            raise ValueError(f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}") from None
        for t in ids:
            # numpy integers are fine; bools and floats are almost certainly a caller's mistake.
            if isinstance(t, bool) or not isinstance(t, numbers.Integral) or t < 0:
                raise ValueError(f"stop_token_ids must be non-negative integers, got {t!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in ids))
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, numbers.Integral)
                                          or self.logprobs < 0):
            raise ValueError(f"logprobs must be None (off) or an integer >= 0, got {self.logprobs!r}")
        if self.logprobs is not None:
            object.__setattr__(self, "logprobs", int(self.logprobs))


def greedy_tokens(logits: jax.Array) -> jax.Array:
    """The most likely token of every row ([rows] int32): what sample_tokens gives a temperature-0 row."""
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


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
    vocab = logits.shape[-1]
    greedy = greedy_tokens(logits)
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
    masked = jnp.where(keep, scaled, -jnp.inf)

    def draw(row_logits, seed, position):
        key = jax.random.fold_in(jax.random.PRNGKey(seed), position)
        return jax.random.categorical(key, row_logits)

    sampled = jax.vmap(draw)(masked, seeds, positions).astype(jnp.int32)
    return jnp.where(temperature > 0, sampled, greedy)
