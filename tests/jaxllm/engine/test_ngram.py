"""Prompt lookup's draft rule (vLLM's ngram): the longest matching suffix, its earliest occurrence, k tokens."""

import numpy as np
import pytest

from jaxllm.engine.speculative.ngram import NgramProposer, ngram_draft


def reference_draft(tokens, k, min_n, max_n):
    """Brute force: for n from max_n down, the earliest earlier window equal to the last n tokens."""
    tokens = list(tokens)
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


def test_vllm_example():
    assert ngram_draft(np.array([1, 2, 3, 4, 2, 3]), 3, min_n=2, max_n=4).tolist() == [4, 2, 3]


def test_no_match_gives_no_draft():
    assert ngram_draft(np.array([1, 2, 3, 4, 5]), 4, min_n=2, max_n=4).tolist() == []
    assert ngram_draft(np.array([7]), 4, min_n=1, max_n=4).tolist() == []


@pytest.mark.parametrize("seed", range(40))
def test_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 3, rng.integers(2, 40))
    k, min_n = int(rng.integers(1, 6)), int(rng.integers(1, 3))
    max_n = int(rng.integers(min_n, 5))
    assert ngram_draft(tokens, k, min_n=min_n, max_n=max_n).tolist() == reference_draft(tokens, k, min_n, max_n)


def test_bad_ngram_sizes_named():
    with pytest.raises(ValueError, match="min_n 3"):
        NgramProposer(min_n=3, max_n=2)
