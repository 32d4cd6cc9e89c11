"""The device penalties (jaxllm.executor.penalties) against a float64 NumPy implementation of the documented
semantics (vLLM's: jaxllm.contract.sampling_params), on random logits and random histories: the state a slot
builds over chunked prefill, recomputed generated tokens and decode steps, from a slot its last owner left dirty,
and the logits it makes; rows without penalties come out bitwise as they went in."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.contract import SamplingParams
from jaxllm.executor import penalties
from jaxllm.executor.penalties import PenaltyInputs, PenaltyState
from jaxllm.executor.sampler import sample_tokens
from tests.jaxllm.penalty_reference import penalized_logits as reference
from tests.seeds import seed

VOCAB = 97
SLOTS = 6
BIAS_WIDTH = 4


_read = jax.jit(penalties.read_tokens)
_process = jax.jit(penalties.process_logits)
_count = jax.jit(penalties.count_sampled)


def _inputs(rows: list[dict], num_seqs: int) -> PenaltyInputs:
    out = penalties.inert_penalty_inputs(num_seqs, BIAS_WIDTH)
    for i, row in enumerate(rows):
        for name in ("slot", "start", "prompt_len", "recount_end", "sample", "frequency", "presence", "repetition"):
            if name in row:
                getattr(out, name)[i] = row[name]
        for j, (token, b) in enumerate(row.get("bias", {}).items()):
            out.bias_ids[i, j], out.bias[i, j] = token, b
    return out


def _packed(chunks: list[tuple[int, list[int]]], num_tokens: int, num_seqs: int):
    """(tokens [T], positions [T], cu_q_lens [S+1]) of chunks (first position, token ids) packed and padded as
    the executor pads a prefill step (padding rows hold no token)."""
    tokens, positions = np.zeros(num_tokens, np.int32), np.zeros(num_tokens, np.int32)
    cu = np.zeros(num_seqs + 1, np.int32)
    at = 0
    for i, (start, ids) in enumerate(chunks):
        tokens[at:at + len(ids)] = ids
        positions[at:at + len(ids)] = np.arange(start, start + len(ids))
        at += len(ids)
        cu[i + 1] = at
    cu[len(chunks) + 1:] = at
    return tokens, positions, cu


class _Row:
    """One sequence's life in a slot, as the scheduler plans it: admitted with `earlier` generated tokens already
    (a recompute after a preemption when there are some), its prompt and those read in two chunks, then decode
    steps that each sample one token."""

    def __init__(self, rng, slot: int, params: dict, prompt_len: int, earlier: int):
        self.slot, self.params = slot, params
        self.prompt = rng.integers(0, VOCAB, prompt_len).tolist()
        self.generated = rng.integers(0, VOCAB, earlier).tolist()
        self.recount_end = prompt_len + earlier
        self.start = 0

    def inputs(self, sample: bool) -> dict:
        return dict(slot=self.slot, start=self.start, prompt_len=len(self.prompt), recount_end=self.recount_end,
                    sample=sample, **self.params)


def _dirty_state(rng) -> PenaltyState:
    """A state whose every slot holds what an earlier owner left."""
    return PenaltyState(jnp.asarray(rng.integers(0, 5, (SLOTS, VOCAB)), jnp.int32),
                        jnp.asarray(rng.random((SLOTS, VOCAB)) < 0.3))


def _params(rng) -> dict:
    return dict(frequency=float(rng.uniform(-2, 2)), presence=float(rng.uniform(-2, 2)),
                repetition=float(rng.choice([rng.uniform(0.3, 1.0), rng.uniform(1.0, 3.0)])),
                bias={int(t): float(rng.uniform(-100, 100)) for t in rng.choice(VOCAB, rng.integers(0, 4), False)})


@pytest.mark.parametrize("case", range(6))
def test_state_and_logits_equal_the_reference_over_a_slots_life(case):
    """Property: rows in random slots (two without penalties, one with a logit bias only) go through a chunked
    prefill (recomputing generated tokens for some) and a few decode steps; after each decode step's input is
    read, every penalized row's processed logits equal the float64 reference over its prompt and its generated
    tokens so far, and the others' equal their logits plus their bias alone."""
    rng = np.random.default_rng([seed(4201), case])
    slots = rng.permutation(SLOTS)[:4]
    rows = [_Row(rng, int(slots[i]), _params(rng), int(rng.integers(1, 12)), int(rng.integers(0, 6)))
            for i in range(4)]
    plain = [dict(), dict(bias={3: 1.5, int(rng.integers(0, VOCAB)): -7.0})]  # rows without a slot
    num_seqs, num_tokens = 8, 64
    state = _dirty_state(rng)
    # Prefill in two chunks: the first samples nothing (its sampled token must not be counted).
    history = [r.prompt + r.generated for r in rows]
    cut = [int(rng.integers(0, len(h))) for h in history]
    for chunk in (0, 1):
        chunks = [(0, h[:c]) if chunk == 0 else (c, h[c:]) for h, c in zip(history, cut)] + [(0, [5]), (0, [9])]
        tokens, positions, cu = _packed(chunks, num_tokens, num_seqs)
        inputs = _inputs([r.inputs(sample=chunk == 1) for r in rows] + [{}, plain[1]], num_seqs)
        state = _read(state, inputs, tokens, positions, cu)
        sampled = rng.integers(0, VOCAB, num_seqs).astype(np.int32)
        if chunk == 1:
            for r, t in zip(rows, sampled):
                r.generated.append(int(t))
        state = _count(state, inputs, jnp.asarray(sampled))
    # Decode steps: each row reads its last token and samples a new one.
    for _ in range(3):
        tokens = np.zeros(num_seqs, np.int32)
        positions = np.zeros(num_seqs, np.int32)
        for i, r in enumerate(rows):
            tokens[i], positions[i] = r.generated[-1], len(r.prompt) + len(r.generated) - 1
        inputs = _inputs([r.inputs(sample=True) for r in rows] + [{}, plain[1]], num_seqs)
        state = _read(state, inputs, tokens, positions, np.arange(num_seqs + 1, dtype=np.int32))
        logits = rng.normal(0, 3, (num_seqs, VOCAB)).astype(np.float32)
        got = np.asarray(_process(logits, state, inputs))
        for i, r in enumerate(rows):
            p = r.params
            want = reference(logits[i], r.prompt, r.generated, p["frequency"], p["presence"], p["repetition"],
                             p["bias"])
            np.testing.assert_allclose(got[i], want, rtol=1e-5, atol=1e-4, err_msg=f"row {i}")
        np.testing.assert_array_equal(got[4], logits[4])  # no penalty, no bias: bitwise the same
        np.testing.assert_allclose(got[5], reference(logits[5], [], [], 0, 0, 1, plain[1]["bias"]), rtol=1e-6)
        np.testing.assert_array_equal(got[6:], logits[6:])  # padding rows
        sampled = rng.integers(0, VOCAB, num_seqs).astype(np.int32)
        for r, t in zip(rows, sampled):
            r.generated.append(int(t))
        state = _count(state, inputs, jnp.asarray(sampled))
    # The state itself: each penalized slot holds its sequence's counts and prompt tokens, others are untouched.
    counts, prompt = np.asarray(state.counts), np.asarray(state.prompt)
    for r in rows:
        np.testing.assert_array_equal(counts[r.slot], np.bincount(r.generated, minlength=VOCAB))
        np.testing.assert_array_equal(prompt[r.slot], np.isin(np.arange(VOCAB), r.prompt))


def test_neutral_penalties_change_no_bit_and_greedy_takes_the_reference_argmax():
    rng = np.random.default_rng(seed(4202))
    logits = rng.normal(0, 4, (5, VOCAB)).astype(np.float32)
    counts = rng.integers(0, 4, (5, VOCAB)).astype(np.int32)
    prompt = rng.random((5, VOCAB)) < 0.5
    zeros, ones = np.zeros(5, np.float32), np.ones(5, np.float32)
    same = np.asarray(penalties.apply_penalties(logits, counts, prompt, zeros, zeros, ones))
    np.testing.assert_array_equal(same, logits)
    f, p, r = rng.uniform(-2, 2, 5), rng.uniform(-2, 2, 5), rng.uniform(0.2, 4, 5)
    got = np.asarray(penalties.apply_penalties(logits, counts, prompt, f.astype(np.float32), p.astype(np.float32),
                                               r.astype(np.float32)))
    for i in range(5):
        history = np.repeat(np.arange(VOCAB), counts[i]).tolist()
        want = reference(logits[i], np.flatnonzero(prompt[i]).tolist(), history, f[i], p[i], r[i], {})
        np.testing.assert_allclose(got[i], want, rtol=1e-5, atol=1e-5)
        # Greedy sampling (temperature 0) of the processed logits is the reference's argmax.
        token = np.asarray(sample_tokens(jnp.asarray(got[i:i + 1]), jnp.zeros(1), jnp.zeros(1, jnp.int32),
                                         jnp.ones(1), jnp.zeros(1, jnp.int32), jnp.zeros(1, jnp.int32)))[0]
        assert want[token] == want.max()


def test_logit_bias_padding_is_dropped_not_wrapped():
    """An id of -1 pads a row's bias: it must not reach the last token (a negative index would wrap)."""
    logits = np.zeros((2, VOCAB), np.float32)
    ids = np.array([[4, -1], [-1, -1]], np.int32)
    bias = np.array([[2.5, 50.0], [50.0, 50.0]], np.float32)
    got = np.asarray(penalties.apply_logit_bias(jnp.asarray(logits), jnp.asarray(ids), jnp.asarray(bias)))
    want = np.zeros((2, VOCAB), np.float32)
    want[0, 4] = 2.5
    np.testing.assert_array_equal(got, want)


def test_state_bytes_and_the_documented_costs():
    assert penalties.state_bytes(256, 32000) == 40_960_000  # ~41 MB
    assert penalties.state_bytes(256, 128256) == 164_167_680  # ~164 MB


def test_sampling_params_name_the_bad_value_and_the_range():
    with pytest.raises(ValueError, match=r"frequency_penalty must be in \[-2, 2\] \(0 disables it\), got 2.5"):
        SamplingParams(frequency_penalty=2.5)
    with pytest.raises(ValueError, match=r"presence_penalty must be in \[-2, 2\] \(0 disables it\), got -3"):
        SamplingParams(presence_penalty=-3)
    for bad in (0, -1.0, float("inf"), float("nan"), True):
        with pytest.raises(ValueError, match="repetition_penalty must be a finite number > 0"):
            SamplingParams(repetition_penalty=bad)
    with pytest.raises(ValueError, match=r"logit_bias\[7\]: the bias must be in \[-100, 100\], got 100.5"):
        SamplingParams(logit_bias={7: 100.5})
    with pytest.raises(ValueError, match="logit_bias: -2 is not a token id"):
        SamplingParams(logit_bias={-2: 1.0})
    with pytest.raises(ValueError, match="logit_bias names token 3 twice"):
        SamplingParams(logit_bias=[(3, 1.0), (3, 2.0)])
    params = SamplingParams(logit_bias={9: -1, 2: 100}, frequency_penalty=-2, presence_penalty=2,
                            repetition_penalty=0.5)
    assert params.logit_bias == ((2, 100.0), (9, -1.0)) and params.penalized
    assert not SamplingParams(logit_bias={1: 1.0}).penalized  # a bias needs no penalty state
