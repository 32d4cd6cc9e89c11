"""Penalties and logit bias through the engine on the tiny model: greedy tokens equal the float64 reference of the
documented semantics replayed over the teacher-forced logits (chunked prefill, batched with requests without
penalties, across a preemption and its recompute, on two instances); sampled tokens survive a preemption; the
request checks name the value and the limit; and after warm-up nothing compiles with penalties on."""

from __future__ import annotations

import numpy as np
import pytest

from jaxllm import LLM, EngineOptions
from jaxllm.contract import SamplingParams
from jaxllm.engine.core import Request
from jaxllm.engine.requests import RequestLimits, sampling_params
from tests.devices import needs_host_devices
from tests.jaxllm.penalty_reference import assert_greedy_replays
from tests.seeds import seed

MAX_LOGIT_BIAS = 4
# Each request's params: a mix of penalties, one request without any (its tokens must not move), one with a bias.
PARAMS = [dict(frequency_penalty=1.5, presence_penalty=0.5),
          dict(repetition_penalty=1.8),
          dict(),
          dict(frequency_penalty=-0.5, presence_penalty=2.0, repetition_penalty=0.7, logit_bias={65: 3.0, 100: -2.5}),
          dict(logit_bias={66: 2.5})]


def _prompts(rng, lengths) -> list[list[int]]:
    return [[int(t) for t in rng.integers(3, 259, n)] for n in lengths]


def _run(llm, prompts, params, **common) -> list[list[int]]:
    requests = [Request(p, SamplingParams(ignore_eos=True, **common, **kw)) for p, kw in zip(prompts, params)]
    return [[t for out in outs for t in out.token_ids] for outs in llm.run(requests).values()]


@pytest.fixture(scope="module")
def llm():
    # A token budget smaller than the longest prompt: chunked prefill, mixed steps, pipelined decode.
    options = EngineOptions(block_size=4, max_tokens_per_step=24, max_seqs=6, max_logit_bias=MAX_LOGIT_BIAS)
    return LLM("tiny", max_context=128, options=options, progress=False)


def _assert_replays(llm, prompts, got, params) -> None:
    clear = sum(assert_greedy_replays(llm, p, g, SamplingParams(**kw)) for p, g, kw in zip(prompts, got, params))
    assert clear >= 0.8 * sum(len(g) for g in got)  # near-ties are rare: most steps have a clear winner


def test_greedy_tokens_equal_the_reference_replayed_over_teacher_forced_logits(llm):
    rng = np.random.default_rng(seed(4301))
    prompts = _prompts(rng, (30, 5, 17, 9, 12))
    got = _run(llm, prompts, PARAMS, max_new_tokens=12)
    _assert_replays(llm, prompts, got, PARAMS)
    plain = _run(llm, prompts, [{}] * len(prompts), max_new_tokens=12)
    assert got[2] == plain[2]  # a request without penalties beside penalized ones: its tokens as alone
    assert all(g != p for g, p, kw in zip(got, plain, PARAMS) if kw)  # each penalty or bias changed something
    stats = llm.core.stats()
    assert stats.scheduler.pool_blocks_free == stats.scheduler.pool_blocks and not llm.scheduler.running
    assert sorted(llm.scheduler._free_slots) == list(range(6))  # every penalty slot went back


def test_a_slot_left_by_a_finished_request_starts_clean(llm):
    """The same requests again, in another order, after others used the slots: the same tokens."""
    rng = np.random.default_rng(seed(4302))
    prompts = _prompts(rng, (8, 21, 3))
    params = [PARAMS[0], PARAMS[1], PARAMS[3]]
    first = _run(llm, prompts, params, max_new_tokens=10)
    _run(llm, _prompts(rng, (6, 6, 6)), params, max_new_tokens=20)  # dirty every slot
    again = _run(llm, prompts[::-1], params[::-1], max_new_tokens=10)[::-1]
    assert again == first


def test_penalized_sequences_survive_a_preemption_and_its_recompute():
    """24 rBlocks of 4 tokens cannot hold five sequences growing to ~40 tokens: the youngest are preempted and
    recompute their prompt and generated tokens, which the penalty state must count again, exactly once."""
    options = EngineOptions(block_size=4, num_blocks=24, max_tokens_per_step=32, max_logit_bias=MAX_LOGIT_BIAS)
    tight = LLM("tiny", max_context=96, options=options, progress=False)
    preempted = []
    real_preempt = tight.scheduler._preempt
    tight.scheduler._preempt = lambda seq: (preempted.append(seq.params), real_preempt(seq))
    rng = np.random.default_rng(seed(4303))
    prompts = _prompts(rng, (17, 9, 14, 6, 11))
    got = _run(tight, prompts, PARAMS, max_new_tokens=28)
    assert any(p.penalized for p in preempted), "no sequence with penalties was preempted: the test tests nothing"
    _assert_replays(tight, prompts, got, PARAMS)
    # Sampled tokens, too, are those of a pool that never preempts (the same seeds and penalties).
    roomy = LLM("tiny", max_context=96, options=EngineOptions(block_size=4, max_tokens_per_step=32,
                                                              max_logit_bias=MAX_LOGIT_BIAS), progress=False)
    preempted.clear()
    sampled = dict(max_new_tokens=28, temperature=0.8, top_p=0.95, seed=11)
    assert _run(tight, prompts, PARAMS, **sampled) == _run(roomy, prompts, PARAMS, **sampled)
    assert any(p.penalized for p in preempted)
    stats = tight.core.stats()
    assert stats.scheduler.pool_blocks_free == stats.scheduler.pool_blocks


def test_frequency_alone_takes_the_prompts_cached_rblocks_repetition_none():
    options = EngineOptions(block_size=4, max_tokens_per_step=64, max_logit_bias=MAX_LOGIT_BIAS)
    llm = LLM("tiny", max_context=128, options=options, progress=False)
    prompt = [int(t) for t in np.random.default_rng(seed(4304)).integers(3, 259, 22)]
    llm.generate([prompt], max_new_tokens=2)  # its 5 full rBlocks go to the prefix cache
    cached = []
    for kw, want in ((dict(frequency_penalty=1.0), 20), (dict(repetition_penalty=1.3), 0), ({}, 20)):
        before = llm.core.stats().scheduler.cached_tokens
        out = llm.generate([prompt], max_new_tokens=6, **kw)[0]
        cached.append(llm.core.stats().scheduler.cached_tokens - before)
        assert_greedy_replays(llm, prompt, out.token_ids, SamplingParams(**kw))
    assert cached == [20, 0, 20]


@needs_host_devices
def test_two_instances_give_the_reference_tokens():
    options = EngineOptions(block_size=4, max_tokens_per_step=24, max_seqs=3, instances=2, num_blocks=48,
                            max_logit_bias=MAX_LOGIT_BIAS)
    llm = LLM("tiny", max_context=128, options=options, progress=False)
    rng = np.random.default_rng(seed(4305))
    prompts = _prompts(rng, (30, 5, 17, 9, 12))
    got = _run(llm, prompts, PARAMS, max_new_tokens=10)
    _assert_replays(llm, prompts, got, PARAMS)
    homes = {llm.scheduler.home(seq_id) for seq_id in range(5)}
    assert homes == {0, 1}  # sequences ran on both instances (ids are strided by instance)


def test_request_checks_name_the_value_and_the_limit(llm):
    with pytest.raises(ValueError, match=rf"logit_bias has 5 entries, over the limit {MAX_LOGIT_BIAS}"):
        llm.generate("a", max_new_tokens=2, logit_bias={i: 1.0 for i in range(5)})
    with pytest.raises(ValueError, match=r"logit_bias: token id 259 is outside the vocabulary \[0, 259\)"):
        llm.generate("a", max_new_tokens=2, logit_bias={259: 1.0})
    with pytest.raises(ValueError, match=r"frequency_penalty must be in \[-2, 2\] \(0 disables it\), got 2.5"):
        llm.generate("a", max_new_tokens=2, frequency_penalty=2.5)
    with pytest.raises(ValueError, match=r"logit_bias\[3\]: the bias must be in \[-100, 100\], got -101"):
        llm.generate("a", max_new_tokens=2, logit_bias={3: -101})
    off = RequestLimits(context_limit=64, vocab_size=259, penalties=False)
    for kw in (dict(presence_penalty=0.5), dict(repetition_penalty=1.2), dict(logit_bias={1: 1.0})):
        with pytest.raises(ValueError, match=r"not served: this engine was started without penalties "
                                             r"\(EngineOptions.penalties False, --no-penalties\)"):
            sampling_params(off, 3, max_tokens=2, **kw)
    assert sampling_params(off, 3, max_tokens=2, frequency_penalty=0.0).frequency_penalty == 0.0


def test_an_engine_without_penalties_refuses_them_and_keeps_no_state():
    llm = LLM("tiny", max_context=64, options=EngineOptions(block_size=4, max_seqs=2, penalties=False),
              progress=False)
    assert not llm.executor.worker.has_penalties
    with pytest.raises(ValueError, match="frequency_penalty 1 is not served"):
        llm.generate("abc", max_new_tokens=2, frequency_penalty=1.0)
    assert len(llm.generate("abc", max_new_tokens=2)[0].token_ids) <= 2


@pytest.mark.slow
def test_no_new_compiles_after_warm_up_with_penalties():
    llm = LLM("tiny", max_context=64, options=EngineOptions(block_size=8, max_seqs=2, max_tokens_per_step=8,
                                                            max_logprobs=2, max_logit_bias=3), progress=False)
    llm.warm_up(progress=False)
    warm = llm.compile_count
    assert warm == len(llm.executor.warm_up_plan())  # penalties add no program
    rng = np.random.default_rng(seed(4306))
    for _ in range(4):
        prompts = _prompts(rng, rng.integers(1, 30, size=3))
        kw = dict(frequency_penalty=float(rng.uniform(-2, 2)), presence_penalty=float(rng.uniform(-2, 2)),
                  repetition_penalty=float(rng.uniform(0.5, 2)),
                  logit_bias={int(t): float(rng.uniform(-100, 100)) for t in rng.integers(0, 259, 2)})
        for temperature in (0.0, 0.8):
            llm.generate(prompts, max_new_tokens=int(rng.integers(1, 8)), temperature=temperature, seed=3,
                         logprobs=int(rng.integers(0, 3)), **kw)
        llm.generate(prompts, max_new_tokens=3)  # and without, greedy: the greedy variant again
    assert llm.compile_count == warm
