"""Engines of 2, 4 and 8 instances on CPU host devices that lend each other rBlocks (DistKV-LLM) and attend
where the KV lives (DistAttention), against one instance with a pool big enough: the same greedy tokens (up to
float ties: tests/jaxllm/tokens.py) for a sequence longer than any one instance's pool, bf16 and int8 pools;
under a skewed load; across a recall; nothing preempted while the mesh has room; nothing leaked. Seeds are
fixed: every run draws the same prompts. That nothing compiles after warm-up, borrowed steps included: test_meshes.py
(beside its tuner test, whose programs its engine shares).
"""

import numpy as np
import pytest

from jaxllm.contract import SamplingParams
from jaxllm.engine.core import Request
from jaxllm.llm import LLM, EngineOptions
from tests.devices import needs_host_devices
from tests.jaxllm.tokens import assert_same_greedy

pytestmark = [needs_host_devices, pytest.mark.slow, pytest.mark.xdist_group("jaxllm_lending")]

BLOCK = 16
SEED = 20261127


def _engine(kv: str, **options) -> LLM:
    return LLM("tiny", options=EngineOptions(block_size=BLOCK, kv_dtype=kv, **options), progress=False)


def _prompt(rng, n: int) -> list[int]:
    return [int(t) for t in rng.integers(3, 250, n)]


def _greedy(new: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=new, ignore_eos=True)


def _tokens(llm: LLM, requests: list[Request]) -> list[list[int]]:
    outputs = llm.run(requests)
    return [[t for out in outputs[i] for t in out.token_ids] for i in sorted(outputs)]


def _stats(llm: LLM) -> dict:
    s = llm.core.stats()
    queue, ledger = s.scheduler, s.scheduler.lending
    return dict(preemptions=queue.preemptions, loans=ledger.loans_total, borrowed=ledger.borrowed_blocks,
                recalled=ledger.recalled_blocks_total, dist_steps=s.executor.dist_steps_total,
                free=queue.pool_blocks_free, blocks=queue.pool_blocks, lending_instances=ledger.lending_instances)


def _done(r: dict) -> bool:
    """Every rBlock home and free again: nothing borrowed, nothing leaked."""
    return r["borrowed"] == 0 and r["free"] == r["blocks"] and r["lending_instances"] == 0


def _assert_same(reference: LLM, requests: list[Request], got, want) -> None:
    for request, g, w in zip(requests, got, want):
        assert_same_greedy(reference, list(request.prompt_ids), g, w)


@pytest.fixture(scope="module")
def reference():
    return {kv: _engine(kv, num_blocks=160) for kv in ("bfloat16", "int8")}


# (instances, rBlocks an instance, KV dtype, prefill tokens a step: 48 cuts the long prompt into chunks that
# start and end inside runs held by different instances)
LONG = {"2/bfloat16": (2, 12, "bfloat16", None), "4/bfloat16": (4, 8, "bfloat16", 48), "8/int8": (8, 4, "int8", None)}


@pytest.mark.parametrize("case", sorted(LONG))
def test_a_sequence_longer_than_one_pool_generates_by_borrowing(reference, case):
    instances, per_instance, kv, step_tokens = LONG[case]
    rng = np.random.default_rng([SEED, instances])
    long_len = int(per_instance * BLOCK * 1.3) + int(rng.integers(0, 7))
    requests = [Request(_prompt(rng, long_len), _greedy(12)), Request(_prompt(rng, int(rng.integers(5, 30))), _greedy(9)),
                Request(_prompt(rng, int(rng.integers(5, 30))), _greedy(7))]
    llm = _engine(kv, num_blocks=per_instance, instances=instances, max_tokens_per_step=step_tokens)
    got = _tokens(llm, requests)
    _assert_same(reference[kv], requests, got, _tokens(reference[kv], requests))
    r = _stats(llm)
    assert long_len > per_instance * BLOCK
    assert r["loans"] > 0 and r["dist_steps"] > 0, r
    assert r["preemptions"] == 0, r  # the mesh had room for every request
    assert _done(r), r


def _skewed(rng) -> list[Request]:
    """Two long generations land on instance 0 (routing by load sees equal prompts), the short ones on 1;
    instance 0 outgrows its pool while generating."""
    p = [_prompt(rng, 40) for _ in range(4)]
    return [Request(p[0], _greedy(110)), Request(p[1], _greedy(4)), Request(p[2], _greedy(110)),
            Request(p[3], _greedy(4))]


@pytest.mark.parametrize("lending", [True, False])
def test_skewed_load_borrows_instead_of_preempting(reference, lending):
    requests = _skewed(np.random.default_rng([SEED, 100]))
    llm = _engine("bfloat16", num_blocks=16, instances=2, lending=lending)
    got = _tokens(llm, requests)
    # Lending off preempts and recomputes: recompute gives the same tokens (up to ties, as any other shape).
    _assert_same(reference["bfloat16"], requests, got, _tokens(reference["bfloat16"], requests))
    r = _stats(llm)
    if lending:
        assert r["preemptions"] == 0 and r["loans"] > 0 and _done(r), r
    else:
        assert r["preemptions"] > 0 and r["loans"] == 0 and r["dist_steps"] == 0, r


def test_recall_copies_lent_rblocks_home_and_outputs_do_not_change(reference):
    """On instance 0 a long sequence and a shorter one fill the pool; both borrow as they grow; when the short
    one ends its rBlocks free up at home and the long one's borrowed rBlocks are copied home (recalled); it goes
    on generating, borrowing again later. Sequences pinned to instance 0 through its scheduler."""
    rng = np.random.default_rng([SEED, 300])
    llm = _engine("bfloat16", num_blocks=16, instances=2)
    home = llm.scheduler.schedulers[0]
    long_ids, short_ids = _prompt(rng, 150), _prompt(rng, 90)
    a = home.add(long_ids, _greedy(120), max_len=llm.context_limit)
    c = home.add(short_ids, _greedy(40), max_len=llm.context_limit)
    recalled_while_running = 0
    while llm.core.has_work():
        llm.core.step()
        if a.status.value == "running":
            recalled_while_running = llm.core.stats().scheduler.lending.recalled_blocks_total
    requests = [Request(long_ids, _greedy(120)), Request(short_ids, _greedy(40))]
    _assert_same(reference["bfloat16"], requests, [a.output_ids, c.output_ids],
                 _tokens(reference["bfloat16"], requests))
    r = _stats(llm)
    assert recalled_while_running > 0, r
    assert llm.executor.worker.copied_blocks == r["recalled"] > 0, r
    assert r["preemptions"] == 0 and _done(r), r


def test_lending_off_limits_a_sequence_to_its_instance_pool():
    llm = _engine("bfloat16", num_blocks=10, instances=2, lending=False)
    assert llm.context_limit == 160
    with pytest.raises(ValueError, match="context limit 160"):
        llm.generate([list(range(3, 203))], max_new_tokens=2)
    assert llm.executor.warm_up_plan() and not any(call.borrowed for call, _ in llm.executor.warm_up_plan())


def test_a_run_that_borrows_nothing_runs_no_dist_attention(reference):
    rng = np.random.default_rng([SEED, 400])
    requests = [Request(_prompt(rng, 20), _greedy(6)), Request(_prompt(rng, 30), _greedy(6))]
    llm = _engine("bfloat16", num_blocks=16, instances=2)
    _assert_same(reference["bfloat16"], requests, _tokens(llm, requests), _tokens(reference["bfloat16"], requests))
    r = _stats(llm)
    assert r["loans"] == 0 and r["dist_steps"] == 0, r
