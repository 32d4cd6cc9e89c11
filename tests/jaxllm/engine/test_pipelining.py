"""Pipelined decode: step N+1 is queued before step N's tokens are read, and nothing changes.

Every LLM-level test runs the same request twice on one model, pipelined and with
options.pipeline=False (each step waits for its tokens), and requires identical completions; a
counter on ModelRunner.dispatch proves the pipelined run really fed steps from device tokens.
Scheduler-level tests (no device) pin down when plan_continuation may and may not run ahead.
"""

import numpy as np
import pytest

from jaxllm.contract import StepKind
from jaxllm import LLM, EngineOptions
from jaxllm.engine.allocator import BlockAllocator
from jaxllm.contract import SamplingParams
from jaxllm.contract import PENDING_TOKEN
from jaxllm.engine.scheduler import Scheduler
from jaxllm.engine.sequence import Status
from tests.seeds import seed

PROMPTS = ["a", "The quick brown fox", "Ragged batches mix very different lengths: " + "x" * 50, "日本語 🙂"]
GREEDY = dict()
SEEDED = dict(temperature=0.8, top_k=20, top_p=0.95, seed=5)


@pytest.fixture(scope="module")
def llm():
    # Small rBlocks and token budget: chunked prefill, mixed steps, and decode steps that cross rBlocks.
    return LLM("tiny", max_context=256, options=EngineOptions(block_size=4, max_tokens_per_step=24), progress=False)


@pytest.fixture
def continuations(llm, monkeypatch):
    """Appends True for every step dispatched with its tokens taken from the device, False otherwise."""
    calls = []
    real = llm.executor.dispatch

    def dispatch(plan, *, token_source=None):
        calls.append(token_source is not None)
        return real(plan, token_source=token_source)

    monkeypatch.setattr(llm.executor, "dispatch", dispatch)
    return calls


def _with_pipeline(llm, pipeline: bool, fn):
    saved = llm.core.pipeline
    llm.core.pipeline = pipeline
    try:
        return fn()
    finally:
        llm.core.pipeline = saved


def _both(llm, continuations, fn):
    """fn() synchronous, then pipelined; returns both results after checking how steps were fed."""
    continuations.clear()
    sync = _with_pipeline(llm, False, fn)
    assert not any(continuations), "the synchronous reference ran ahead"
    continuations.clear()
    piped = _with_pipeline(llm, True, fn)
    _check_idle(llm)
    return sync, piped


def _check_idle(llm):
    assert not llm.core.has_step_in_flight(), "a step was left in flight"
    assert not llm.scheduler.has_work()
    assert llm.core.stats().scheduler.pool_blocks_free == llm.core.stats().scheduler.pool_blocks, "rBlocks leaked"


@pytest.mark.parametrize("kwargs", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_ragged_batch_matches_synchronous(llm, continuations, kwargs):
    sync, piped = _both(llm, continuations, lambda: llm.generate(PROMPTS, max_new_tokens=14, **kwargs))
    assert sum(continuations) >= 8, f"pipelining barely engaged: {continuations}"
    assert piped == sync
    assert all(c.finish_reason == "length" and len(c.token_ids) == 14 for c in sync if c.finish_reason != "stop")


def test_stop_strings_and_stop_tokens_match_synchronous(llm, continuations):
    base = _with_pipeline(llm, False, lambda: llm.generate(PROMPTS, max_new_tokens=16, **SEEDED))
    stop = base[1].text[3:5]  # ends prompt 1 early, maybe others too
    stop_token = base[0].token_ids[4]  # ends prompt 0 after four tokens, maybe others too
    assert stop and stop_token not in base[0].token_ids[:4]
    sync, piped = _both(llm, continuations, lambda: llm.generate(PROMPTS, max_new_tokens=16, stop=[stop], **SEEDED))
    assert any(continuations)
    assert piped == sync and sync[1].finish_reason == "stop" and len(sync[1].text) < len(base[1].text)
    sync, piped = _both(llm, continuations,
                        lambda: llm.generate(PROMPTS, max_new_tokens=16, stop_token_ids=[stop_token], **SEEDED))
    assert any(continuations)
    assert piped == sync and sync[0].finish_reason == "stop" and sync[0].token_ids == base[0].token_ids[:4]
    # Alone, it is the last to finish, with its continuation still in flight: generate must drain it.
    sync, piped = _both(llm, continuations,
                        lambda: llm.generate(PROMPTS[0], max_new_tokens=16, stop_token_ids=[stop_token], **SEEDED))
    assert any(continuations)
    assert piped == sync and sync[0].token_ids == base[0].token_ids[:4]


@pytest.mark.parametrize("max_new_tokens", [1, 2, 3])
def test_few_new_tokens_match_synchronous(llm, continuations, max_new_tokens):
    sync, piped = _both(llm, continuations, lambda: llm.generate(PROMPTS[:2], max_new_tokens=max_new_tokens))
    assert piped == sync
    assert [len(c.token_ids) for c in sync] == [max_new_tokens] * 2
    # A step after a sequence's last token would be wasted: none is queued once its length ends it.
    assert sum(continuations) == (1 if max_new_tokens == 3 else 0)


def test_preemption_matches_synchronous():
    # 24 rBlocks of 4 tokens cannot hold all four sequences: continuations find no rBlock and stop,
    # then plan() preempts the youngest (as in test_generate.py).
    tight = LLM("tiny", max_context=96, options=EngineOptions(block_size=4, num_blocks=24, max_tokens_per_step=32),
                progress=False)
    prompts = ["first prompt here", "second one", "third prompt, longer than the rest", "fourth"]
    preempted, fed = [], []
    real_preempt, real_dispatch = tight.scheduler._preempt, tight.executor.dispatch
    tight.scheduler._preempt = lambda seq: (preempted.append(seq.seq_id), real_preempt(seq))
    tight.executor.dispatch = lambda plan, token_source=None: (fed.append(token_source is not None),
                                                             real_dispatch(plan, token_source=token_source))[1]
    run = lambda: tight.generate(prompts, max_new_tokens=30, temperature=0.7, seed=7)  # noqa: E731
    sync = _with_pipeline(tight, False, run)
    assert preempted and not any(fed)
    preempted.clear()
    piped = _with_pipeline(tight, True, run)
    assert preempted and sum(fed) >= 5, (preempted, fed)
    assert piped == sync
    _check_idle(tight)


def test_stream_matches_synchronous(llm, continuations):
    # ignore_eos: the random tiny model may sample EOS within a few tokens, leaving nothing to pipeline.
    kwargs = dict(max_new_tokens=12, ignore_eos=True, **SEEDED)
    sync, piped = _both(llm, continuations, lambda: list(llm.stream(PROMPTS[3], **kwargs)))
    assert sum(continuations) >= 5
    assert piped == sync
    assert "".join(piped) == llm.generate([PROMPTS[3]], **kwargs)[0].text


def test_abandoned_stream_with_a_step_in_flight(llm, continuations):
    reference = _with_pipeline(llm, False, lambda: llm.generate(PROMPTS, max_new_tokens=10, **SEEDED))
    it = llm.stream(PROMPTS[1], max_new_tokens=100)
    for _ in range(20):
        next(it)
        if llm.core.has_step_in_flight():
            break
    assert llm.core.has_step_in_flight(), "no step was ever in flight"
    it.close()
    _check_idle(llm)
    # The dropped step wrote KV into rBlocks now free: later requests must not see it.
    assert llm.generate(PROMPTS, max_new_tokens=10, **SEEDED) == reference
    _check_idle(llm)


def test_engine_pipelines_and_cancels(llm, continuations):
    from jaxllm.engine.threaded import Engine

    params = SamplingParams(max_new_tokens=12, **SEEDED)
    reference = _with_pipeline(llm, False, lambda: llm.generate(PROMPTS[:3], max_new_tokens=12, **SEEDED))
    continuations.clear()
    engine = Engine(llm.core, llm.tokenizer, llm.info())
    try:
        victim = engine.submit(PROMPTS[3], SamplingParams(max_new_tokens=200))
        streams = [engine.submit(p, params) for p in PROMPTS[:3]]
        victim_events = []
        for event in victim:
            victim_events.append(event)
            if len(victim_events) == 3:
                victim.cancel()  # arrives between steps, usually with a continuation in flight
        tokens = [[t for event in s for t in event.token_ids] for s in streams]
    finally:
        engine.shutdown(grace_s=5.0)
    assert victim_events[-1].finish_reason == "cancelled" and len(victim_events) < 200
    assert tokens == [c.token_ids for c in reference]
    assert any(continuations)
    assert engine.idle()
    _check_idle(llm)


def test_engine_rejects_bad_token_ids(llm):
    from jaxllm.engine.threaded import Engine

    engine = Engine(llm.core, llm.tokenizer, llm.info())
    before = engine.stats().core.requests_total  # the core's count since start-up: generate()'s requests too
    try:
        for ids, message in (([], "prompt is empty"), ([5, llm.config.vocab_size], "outside the vocabulary"),
                             ([5, -1], "token id -1"), ([5] * (llm.context_limit + 1), "more than")):
            with pytest.raises(ValueError, match=message):
                engine.submit(ids, SamplingParams(max_new_tokens=2))
        assert engine.stats().core.requests_total == before  # nothing was accepted
    finally:
        engine.shutdown(grace_s=1.0)


# ----- Scheduler.plan_continuation, no device -----

def _scheduler(num_blocks: int, max_seqs: int = 4, block_size: int = 4):
    alloc = BlockAllocator(num_blocks)
    return Scheduler(alloc, block_size, max_tokens_per_step=32, max_seqs=max_seqs), alloc


def _decode_plan(sched, prompts, rng, max_new_tokens=50):
    """Admit and prefill the prompts, then plan their first decode step."""
    seqs = [sched.add(p, SamplingParams(max_new_tokens=max_new_tokens), max_len=100) for p in prompts]
    plan = sched.plan()
    assert plan.kind is StepKind.PREFILL and plan.sample.all()
    sched.update(plan, rng.integers(1, 100, size=len(seqs)), eos_id=0)
    plan = sched.plan()
    assert plan.kind is StepKind.DECODE and plan.seq_ids.tolist() == [s.seq_id for s in seqs]
    return seqs, plan


def test_continuation_plan_and_results():
    rng = np.random.default_rng(seed(52299))
    sched, alloc = _scheduler(num_blocks=16)
    seqs, prev = _decode_plan(sched, [[5, 6, 7], [8] * int(rng.integers(4, 9))], rng)
    cont = sched.plan_continuation(prev)
    assert cont is not None and cont.kind is StepKind.DECODE and cont.seq_ids.tolist() == [s.seq_id for s in seqs]
    assert cont.token_ids.tolist() == [PENDING_TOKEN] * 2 and cont.sample.all()
    assert cont.positions.tolist() == [s.num_tokens for s in seqs] == prev.kv_lens.tolist()
    assert cont.kv_lens.tolist() == [s.num_tokens + 1 for s in seqs]
    for i, seq in enumerate(seqs):
        blocks, p = alloc.blocks(seq.seq_id), int(cont.positions[i])
        assert len(blocks) == p // 4 + 1 and cont.block_tables[i, :len(blocks)].tolist() == blocks
        assert cont.slot_mapping[i] == blocks[p // 4] * 4 + p % 4
    assert sched.plan_continuation(prev) is not None  # idempotent: tables only grow to the same size
    first, second = rng.integers(1, 100, size=2), rng.integers(1, 100, size=2)
    sched.update(prev, first, eos_id=0)
    assert sched.plan_continuation(prev) is None  # prev already recorded: not the step to continue
    nxt = sched.plan_continuation(cont)
    assert nxt is not None and nxt.positions.tolist() == cont.kv_lens.tolist()
    for p in (prev, cont, nxt):  # carried forward, not recomputed: it must equal what the arrays say
        assert p.kv_extent == (sum(p.kv_lens.tolist()), max(p.kv_lens.tolist()))
    sched.update(cont, second, eos_id=0)
    for i, seq in enumerate(seqs):
        assert seq.output_ids[-2:] == [first[i], second[i]] and seq.num_computed == seq.num_tokens - 1


def test_continuation_result_of_a_finished_sequence_is_dropped():
    rng = np.random.default_rng(seed(52300))
    sched, alloc = _scheduler(num_blocks=16)
    seqs, prev = _decode_plan(sched, [[5, 6, 7], [8] * 6], rng)
    cont = sched.plan_continuation(prev)
    sched.update(prev, np.array([0, 42]), eos_id=0)  # EOS ends the first sequence
    assert seqs[0].status is Status.FINISHED and not alloc.blocks(seqs[0].seq_id)
    assert sched.plan_continuation(cont) is None
    before = list(seqs[0].output_ids)
    sched.update(cont, np.array([77, 43]), eos_id=0)
    assert seqs[0].output_ids == before and seqs[1].output_ids[-2:] == [42, 43]


def test_no_continuation_while_someone_waits():
    rng = np.random.default_rng(seed(52301))
    sched, _ = _scheduler(num_blocks=16, max_seqs=1)
    seqs, prev = _decode_plan(sched, [[5, 6, 7]], rng)
    waiter = sched.add([1, 2], SamplingParams(), max_len=100)
    assert sched.waiting == [waiter] and sched.plan_continuation(prev) is None


def test_no_continuation_past_the_length_limit():
    rng = np.random.default_rng(seed(52302))
    sched, _ = _scheduler(num_blocks=16)
    _, prev = _decode_plan(sched, [[5, 6, 7], [9]], rng, max_new_tokens=2)  # prev samples the last token
    assert sched.plan_continuation(prev) is None


@pytest.mark.parametrize("num_blocks", [2, 3])
def test_no_continuation_when_rblocks_run_out_and_nobody_is_preempted(num_blocks):
    # Two sequences of 3 prompt tokens + 1 sampled fill one rBlock of 4 each; the continuation
    # writes position 4, so each needs a second rBlock: 2 needed, 0 or 1 free.
    rng = np.random.default_rng(seed(52303))
    sched, alloc = _scheduler(num_blocks=num_blocks)
    seqs, prev = _decode_plan(sched, [[5, 6, 7], [8, 9, 10]], rng)
    owners, free = alloc.owners(), alloc.num_free
    assert sched.plan_continuation(prev) is None
    assert alloc.owners() == owners and alloc.num_free == free, "a failed continuation changed the tables"
    assert sched.running == seqs and not sched.waiting and all(s.num_preemptions == 0 for s in seqs)


def test_runner_refuses_placeholders_without_a_matching_source(llm):
    sched = llm.scheduler
    seq = sched.add([5, 6, 7], SamplingParams(max_new_tokens=20), max_len=100)
    try:
        prefill = llm.executor.dispatch(sched.plan())
        sched.update(prefill.plan, prefill.tokens(), eos_id=-1)
        decode = llm.executor.dispatch(sched.plan())
        cont = sched.plan_continuation(decode.plan)
        assert cont is not None
        with pytest.raises(ValueError, match="placeholders"):
            llm.executor.dispatch(cont)
        with pytest.raises(ValueError, match="same sequences"):
            llm.executor.dispatch(cont, token_source=prefill)
        follow = llm.executor.dispatch(cont, token_source=decode)
        assert follow.tokens().shape == (1,) and decode.tokens().shape == (1,)
    finally:
        sched.cancel(seq)
    _check_idle(llm)


_PLAN_FIELDS = ("seq_ids", "positions", "slot_mapping", "cu_q_lens", "kv_lens", "block_tables", "sample",
                "temperature", "top_k", "top_p", "seed", "logprobs", "instances", "targets")


def test_a_continuation_equals_the_plan_assembled_anew():
    """StepPlan.next_decode (what plan_continuation returns) against plan() after the source is recorded: the same
    step, every field equal but the placeholder tokens, over decode steps that cross rBlocks (block_size 4) and rows
    whose sampling, logprobs and penalties differ."""
    rng = np.random.default_rng(seed(52304))
    sched, alloc = _scheduler(num_blocks=40)
    params = [SamplingParams(max_new_tokens=30), SamplingParams(max_new_tokens=30, temperature=0.7, top_k=5, seed=3),
              SamplingParams(max_new_tokens=30, top_p=0.5, temperature=1.0, logprobs=2, frequency_penalty=0.5)]
    seqs = [sched.add(rng.integers(1, 100, size=n).tolist(), p, max_len=100) for n, p in zip((3, 6, 9), params)]
    n = len(seqs)
    logprobs = (np.zeros(n, np.float32), np.zeros((n, 2), np.int32), np.zeros((n, 2), np.float32))
    plan = sched.plan()
    sched.update(plan, rng.integers(1, 100, size=n), eos_id=0, logprobs=logprobs)
    prev, crossed = sched.plan(), 0
    for _ in range(12):
        cont = sched.plan_continuation(prev)
        assert cont is not None and cont.token_ids.tolist() == [PENDING_TOKEN] * len(seqs)
        crossed += cont.block_tables is not prev.block_tables
        sched.update(prev, rng.integers(1, 100, size=n), eos_id=0, logprobs=logprobs)
        anew = sched.plan()
        for name in _PLAN_FIELDS:
            a, b = getattr(cont, name), getattr(anew, name)
            assert (a is None) == (b is None) and (a is None or np.array_equal(a, b)), name
        assert cont.kv_extent == anew.kv_extent and cont.kind is anew.kind is StepKind.DECODE
        for field in ("slot", "start", "prompt_len", "recount_end", "frequency", "presence", "repetition"):
            assert np.array_equal(getattr(cont.penalties, field), getattr(anew.penalties, field)), field
        prev = anew
    assert crossed >= 3  # some steps grew a table: their new entries came from the allocator


def test_next_decode_refuses_what_it_cannot_continue():
    rng = np.random.default_rng(seed(52305))
    sched, _ = _scheduler(num_blocks=16)
    seqs = [sched.add([5, 6, 7], SamplingParams(max_new_tokens=10), max_len=100)]
    prefill = sched.plan()
    with pytest.raises(ValueError, match="continues a decode step, not a prefill step"):
        prefill.next_decode(4)
    sched.update(prefill, rng.integers(1, 100, size=1), eos_id=0)
    decode = sched.plan()
    with pytest.raises(ValueError, match="only grow"):
        decode.next_decode(4, np.zeros((len(seqs), 0), np.int32))
