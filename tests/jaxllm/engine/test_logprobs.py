"""Per-token log-probabilities (SamplingParams.logprobs) and prompt log-probabilities (prompt_logprobs) on the
tiny model: the values against the teacher-forced logits, their shape, and that asking for them changes no
token and, after warm-up, compiles nothing."""

import jax
import numpy as np
import pytest

from jaxllm import LLM, EngineOptions
from jaxllm.engine.requests import RequestLimits, sampling_params
from jaxllm.contract import SamplingParams

MAX_LOGPROBS = 5
PROMPTS = ["The quick brown fox", "a", "Ragged batches mix very different lengths: " + "x" * 40]


@pytest.fixture(scope="module")
def llm():
    # Small rBlocks and a small token budget: chunked prefill, mixed steps, pipelined decode.
    options = EngineOptions(block_size=4, max_tokens_per_step=24, max_seqs=4, max_logprobs=MAX_LOGPROBS)
    return LLM("tiny", max_context=128, options=options, progress=False)


def _reference(llm, prompt, token_ids):
    """log_softmax of the teacher-forced logits at each generated token's position [n, vocab]."""
    prompt_ids = llm.tokenizer.encode(prompt)
    full = prompt_ids + token_ids
    logits = llm.logits(full)[len(prompt_ids) - 1:len(full) - 1]
    return np.asarray(jax.nn.log_softmax(logits.astype(np.float32), axis=-1))


def test_greedy_logprobs_equal_teacher_forced_log_softmax(llm):
    outs = llm.generate(PROMPTS, max_new_tokens=8, logprobs=3, ignore_eos=True)
    for prompt, out in zip(PROMPTS, outs):
        assert len(out.logprobs) == len(out.token_ids) == 8
        ref = _reference(llm, prompt, out.token_ids)
        for i, (token, (logprob, top)) in enumerate(zip(out.token_ids, out.logprobs)):
            assert len(top) == 3
            ids = [t for t, _ in top]
            values = [v for _, v in top]
            assert ids[0] == token and values[0] == logprob  # greedy: the token is the top-1
            assert values == sorted(values, reverse=True)
            np.testing.assert_allclose(logprob, ref[i, token], rtol=0, atol=1e-4)
            np.testing.assert_allclose(values, ref[i, ids], rtol=0, atol=1e-4)
            np.testing.assert_allclose(values, np.sort(ref[i])[::-1][:3], rtol=0, atol=1e-4)  # the 3 most likely


def test_logprobs_change_no_sampled_token_and_k_as_asked(llm):
    kwargs = dict(max_new_tokens=10, temperature=0.9, top_k=20, top_p=0.9, seed=1234, ignore_eos=True)
    plain = llm.generate(PROMPTS, **kwargs)
    for k in (0, MAX_LOGPROBS):
        asked = llm.generate(PROMPTS, logprobs=k, **kwargs)
        for p, a, prompt in zip(plain, asked, PROMPTS):
            assert a.token_ids == p.token_ids and p.logprobs is None
            assert all(len(top) == k for _, top in a.logprobs)
            ref = _reference(llm, prompt, a.token_ids)
            np.testing.assert_allclose([lp for lp, _ in a.logprobs], ref[np.arange(len(a.token_ids)), a.token_ids],
                                       rtol=0, atol=1e-4)
    # One request asking beside others that do not: only it gets logprobs, nobody's tokens move.
    from jaxllm.engine.core import Request
    reqs = [Request(llm.tokenizer.encode(p), SamplingParams(max_new_tokens=10, temperature=0.9, top_k=20, top_p=0.9,
                                                            seed=1234, ignore_eos=True, logprobs=2 if i == 1 else None))
            for i, p in enumerate(PROMPTS)]
    outputs = list(llm.run(reqs).values())
    for i, (outs, p) in enumerate(zip(outputs, plain)):
        assert [t for o in outs for t in o.token_ids] == p.token_ids
        if i == 1:
            assert [len(top) for o in outs for _, top in o.logprobs] == [2] * len(p.token_ids)
        else:
            assert all(o.logprobs is None for o in outs)


def test_logprobs_over_the_limit_are_refused(llm):
    with pytest.raises(ValueError, match=f"logprobs {MAX_LOGPROBS + 1} is over the limit {MAX_LOGPROBS}"):
        llm.generate("a", max_new_tokens=2, logprobs=MAX_LOGPROBS + 1)
    limits = RequestLimits(context_limit=64, vocab_size=100)  # max_logprobs 0: logprobs are off
    with pytest.raises(ValueError, match="top_logprobs 0 is over the limit 0"):
        sampling_params(limits, 3, max_tokens=2, logprobs=0, logprobs_name="top_logprobs")
    with pytest.raises(ValueError, match="logprobs must be None"):
        SamplingParams(logprobs=-1)


@pytest.mark.slow
@pytest.mark.xdist_group("logprobs_compiles")
def test_no_new_compiles_after_warm_up_with_logprobs():
    # Few buckets (decode 1 and 2, prefill 8), each in its plain and its logprob variant.
    llm = LLM("tiny", max_context=64, options=EngineOptions(block_size=8, max_seqs=2, max_tokens_per_step=8,
                                                            max_logprobs=2), progress=False)
    llm.warm_up(progress=False)
    warm = llm.compile_count
    assert warm == len(llm.executor.bucket_shapes())
    assert sum(1 for shape in llm.executor.bucket_shapes() if shape[3]) == warm // 2
    rng = np.random.default_rng(0)
    for _ in range(4):
        prompts = ["".join(chr(97 + c) for c in rng.integers(0, 26, size=n)) for n in rng.integers(1, 40, size=3)]
        temperature = 0.7 if rng.random() < 0.5 else 0.0
        for logprobs in (None, int(rng.integers(0, 3))):
            llm.generate(prompts, max_new_tokens=int(rng.integers(1, 8)), temperature=temperature, seed=3,
                         logprobs=logprobs)
        llm.generate(prompts, max_new_tokens=int(rng.integers(0, 3)), prompt_logprobs=int(rng.integers(0, 3)))
    assert llm.compile_count == warm


@pytest.mark.parametrize("instances", [1, 2])
def test_prompt_logprobs_equal_teacher_forced_log_softmax_across_chunks(instances):
    """Property over random prompts longer than a step's token budget (each prompt in several chunks, batched
    with others): every prompt token after the first has the log-probability the teacher-forced logits give
    it, the top k are those logits' k best, the first token's entry is None, generated tokens are those of a
    run without prompt_logprobs; with max_new_tokens 0 the prompt is scored and nothing generated."""
    from tests.devices import HOST_DEVICES
    import jax as _jax

    if instances > _jax.device_count():
        pytest.skip(f"{instances} instances need {instances} devices")
    options = EngineOptions(block_size=4, max_tokens_per_step=12, max_seqs=3, max_logprobs=3, instances=instances,
                            num_blocks=48)
    llm = LLM("tiny", max_context=128, options=options, progress=False)
    rng = np.random.default_rng([17, instances, HOST_DEVICES])
    prompts = [[int(t) for t in rng.integers(3, 250, n)] for n in (30, 7, 19)]
    plain = [c.token_ids for c in llm.generate(prompts, max_new_tokens=3)]
    outs = llm.generate(prompts, max_new_tokens=3, prompt_logprobs=2)
    assert [c.token_ids for c in outs] == plain
    for ids, out in zip(prompts, outs):
        assert len(out.prompt_logprobs) == len(ids) and out.prompt_logprobs[0] is None
        ref = np.asarray(jax.nn.log_softmax(llm.logits(ids).astype(np.float32), axis=-1))
        for i, (logprob, top) in enumerate(out.prompt_logprobs[1:]):
            np.testing.assert_allclose(logprob, ref[i, ids[i + 1]], atol=1e-5)
            assert [t for t, _ in top] == list(np.argsort(-ref[i])[:2])
            np.testing.assert_allclose([v for _, v in top], np.sort(ref[i])[::-1][:2], atol=1e-5)
    scored = llm.generate(prompts, max_new_tokens=0, prompt_logprobs=0)
    assert all(c.token_ids == [] and c.finish_reason == "length" for c in scored)
    for c, out in zip(scored, outs):  # the same values, batched differently (float noise only)
        np.testing.assert_allclose([e[0] for e in c.prompt_logprobs[1:]], [e[0] for e in out.prompt_logprobs[1:]],
                                   atol=1e-5)
    assert all(top == () for c in scored for _, top in c.prompt_logprobs[1:])
    stats = llm.core.stats()
    assert stats.scheduler.pool_blocks_free == stats.scheduler.pool_blocks


def test_prompt_logprobs_are_refused_past_the_limit_and_without_them(llm):
    with pytest.raises(ValueError, match="prompt_logprobs 6 is over the limit 5"):
        llm.generate("abc", max_new_tokens=1, prompt_logprobs=6)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1, got 0"):
        llm.generate("abc", max_new_tokens=0)
