"""Speculative decoding's acceptance: greedy keeps the argmax run, sampling keeps the target's distribution (a
chi-square test over every outcome of a two-draft verify on a small vocabulary)."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.executor.acceptance import accept_drafts

CHI2_P001 = {3: 16.27, 9: 27.88, 6: 22.46, 5: 20.52}  # chi-square quantiles at p = 0.001, by degrees of freedom


def test_greedy_keeps_the_leading_argmax_matches_then_the_argmax():
    vocab, queries = 8, 4
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, queries, vocab)).astype(np.float32)
    best = logits.argmax(-1)
    drafts = np.full((3, queries), -1, np.int32)
    drafts[0, :3] = [best[0, 0], best[0, 1], (best[0, 2] + 1) % vocab]  # two right, then wrong
    drafts[1, :2] = [best[1, 0], best[1, 1]]  # both right (a bonus token after them)
    # row 2: no draft at all: one token, its argmax
    out = accept_drafts(jnp.asarray(logits), jnp.asarray(drafts), jnp.array([20, 30, 9]), jnp.zeros(3),
                        jnp.zeros(3, jnp.int32), jnp.ones(3), jnp.zeros(3, jnp.int32), greedy=True)
    assert np.asarray(out).tolist() == [[best[0, 0], best[0, 1], best[0, 2], -1],
                                        [best[1, 0], best[1, 1], best[1, 2], -1],
                                        [best[2, 0], -1, -1, -1]]


def _filtered(p: np.ndarray, temperature: float, top_k: int) -> np.ndarray:
    """The sampler's distribution: p ** (1 / T) renormalised over its top_k tokens (0: all)."""
    q = p ** (1.0 / temperature)
    if top_k:
        q = np.where(q >= np.sort(q)[::-1][top_k - 1], q, 0.0)
    return q / q.sum()


def _outcomes(dists: list[np.ndarray], drafts: list[int]) -> dict[tuple, float]:
    """Every kept sequence a verify of these drafts can give, with its probability under plain sampling: the
    first token unequal to its draft ends the run; all drafts equal: one more token."""
    out, prefix, prob = {}, (), 1.0
    for j, dist in enumerate(dists):
        for token in range(len(dist)):
            if j < len(drafts) and token == drafts[j]:
                continue
            out[prefix + (token,)] = prob * dist[token]
        if j == len(drafts):
            break
        prefix, prob = prefix + (drafts[j],), prob * dist[drafts[j]]
    return out


@pytest.mark.parametrize("temperature,top_k", [(1.0, 0), (0.6, 3)])
def test_sampled_tokens_follow_the_target_distribution(temperature, top_k):
    """Chi-square over every outcome of two point-mass drafts (accepted, rejected, the bonus token): the kept tokens
    are distributed as plain sampling from the target's (filtered) distributions would give them."""
    vocab, queries, trials = 4, 3, 30000
    p = np.array([[0.1, 0.2, 0.3, 0.4], [0.4, 0.3, 0.2, 0.1], [0.25, 0.25, 0.3, 0.2]])
    drafts = [2, 1]  # a likely draft, then a middling one
    logits = jnp.asarray(np.log(p)[None].astype(np.float32))
    drafts_row = jnp.array([drafts + [-1]], jnp.int32)

    @jax.jit
    def kept(seed):
        return accept_drafts(logits, drafts_row, jnp.array([17]), jnp.full(1, temperature), jnp.full(1, top_k),
                             jnp.ones(1), seed[None], greedy=False)[0]

    rows = np.asarray(jax.vmap(kept)(jnp.arange(trials, dtype=jnp.int32)))
    expected = _outcomes([_filtered(row, temperature, top_k) for row in p], drafts)
    counts = dict.fromkeys(expected, 0)
    for row in rows:
        key = tuple(int(t) for t in row if t >= 0)
        assert key in counts, f"an outcome plain sampling cannot give: {key}"
        counts[key] += 1
    live = {k: v for k, v in expected.items() if v > 0}
    assert all(counts[k] == 0 for k in expected if k not in live), "a token the filter removes was kept"
    chi2 = sum((counts[k] - trials * v) ** 2 / (trials * v) for k, v in live.items())
    assert chi2 < CHI2_P001[len(live) - 1], (counts, chi2)


def test_the_chi_square_test_can_fail():
    """Accepting every draft (no rejection sampling) is far outside the bound the test above applies."""
    p = np.array([[0.1, 0.2, 0.3, 0.4], [0.4, 0.3, 0.2, 0.1], [0.25, 0.25, 0.3, 0.2]])
    expected = _outcomes(list(p), [2, 1])
    trials = 30000
    always = {k: (trials if k == (2, 1, 2) else 0) for k in expected}
    chi2 = sum((always[k] - trials * v) ** 2 / (trials * v) for k, v in expected.items())
    assert chi2 > CHI2_P001[len(expected) - 1]
    assert len(list(itertools.chain(expected))) == 10
