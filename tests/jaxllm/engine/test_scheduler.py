"""Scheduler tests without a device: a fake runner samples tokens from a NumPy table.

The fake token of sequence s at position p is table[s, p], fixed before the run, so every
request's final output and finish reason are known in advance whatever the batching, chunking
and preemption did: a re-sampled, dropped or shifted token shows up as a wrong output.
Each run draws a fresh seed and prints it; replay with JAXLLM_TEST_SEED=<seed>.
"""

import dataclasses
import random

import numpy as np
import pytest

from jaxllm.contract import StepKind
from jaxllm.engine.allocator import BlockAllocator
from jaxllm.contract import SamplingParams
from jaxllm.engine.scheduler import Scheduler
from jaxllm.engine.sequence import Sequence, Status
from tests.seeds import seed

EOS = 0


def _seed() -> int:
    return seed(27468)  # fixed: tests/seeds.py


def _expected(seq: Sequence, table: np.ndarray) -> tuple[list[int], str]:
    """The output and finish reason a sequence must end with, given the fake sampler's table."""
    out, p = [], len(seq.prompt_ids)
    while True:
        token = int(table[seq.seq_id, p + len(out)])
        if (token == EOS and not seq.params.ignore_eos) or token in seq.params.stop_token_ids:
            return out, "stop"
        out.append(token)
        if len(out) >= seq.params.max_new_tokens or p + len(out) >= seq.max_len:
            return out, "length"


def _check_plan(plan, sched: Scheduler, alloc: BlockAllocator, ctx: str) -> None:
    bs = sched.block_size
    num_seqs, num_tokens = plan.num_seqs, plan.num_tokens
    assert len(plan) == num_seqs and plan.seq_ids.shape == (num_seqs,), ctx
    plan_seqs = [sched.sequence(i) for i in plan.seq_ids]
    assert None not in plan_seqs, f"{ctx}: a planned id names no live sequence"
    assert 0 < num_tokens <= sched.max_tokens_per_step, ctx
    assert 0 < num_seqs <= sched.max_seqs and len(sched.running) <= sched.max_seqs, ctx
    assert len(set(plan.seq_ids.tolist())) == num_seqs, f"{ctx}: a sequence is planned twice"
    for arr in (plan.token_ids, plan.positions, plan.slot_mapping, plan.cu_q_lens, plan.kv_lens, plan.block_tables):
        assert arr.dtype == np.int32, ctx
    assert plan.token_ids.shape == plan.positions.shape == plan.slot_mapping.shape == (num_tokens,)
    assert plan.cu_q_lens.shape == (num_seqs + 1,) and plan.kv_lens.shape == plan.sample.shape == (num_seqs,)
    assert plan.block_tables.ndim == 2 and plan.block_tables.shape[0] == num_seqs
    cu = plan.cu_q_lens
    assert cu[0] == 0 and cu[-1] == num_tokens and np.all(np.diff(cu) >= 1), f"{ctx}: cu_q_lens {cu}"
    assert (plan.kind is StepKind.DECODE) == bool(np.all(np.diff(cu) == 1))
    # Every rBlock owned by a sequence: all blocks in use are the running sequences', nothing leaks.
    owners = {k: v for k, v in alloc.owners().items() if v}
    assert set(owners) <= {s.seq_id for s in sched.running}, f"{ctx}: a non-running sequence owns rBlocks"
    held = [b for v in owners.values() for b in v]
    assert len(set(held)) == alloc.num_blocks - alloc.num_free <= alloc.num_blocks, f"{ctx}: rBlocks leaked"
    for block in set(held):  # shared prefix rBlocks: one holder per table that lists them
        assert alloc.holders(block) == held.count(block), ctx
    # A step writes only rBlocks its sequence holds alone, and never one in the prefix cache.
    written = set((plan.slot_mapping // bs).tolist())
    assert all(alloc.holders(b) == 1 and not alloc.is_registered(b) for b in written), f"{ctx}: writes a shared rBlock"
    for s in sched.waiting:
        assert s.status is Status.WAITING and s.num_computed == 0 and not alloc.blocks(s.seq_id), ctx
    for i, seq in enumerate(plan_seqs):
        assert seq.seq_id == plan.seq_ids[i] and seq.status is Status.RUNNING and seq in sched.running, ctx
        p = seq.params  # the sampling arrays are the sequence's SamplingParams
        assert (plan.temperature[i], plan.top_k[i], plan.top_p[i], plan.seed[i]) == (
            np.float32(p.temperature), p.top_k, np.float32(p.top_p), p.seed), ctx
        q0, q1 = int(cu[i]), int(cu[i + 1])
        kv_len, start = int(plan.kv_lens[i]), seq.num_computed
        pos = plan.positions[q0:q1]
        assert np.array_equal(pos, np.arange(start, kv_len)), f"{ctx}: positions {pos} for {start}..{kv_len}"
        assert kv_len == pos[-1] + 1 <= seq.num_tokens, ctx
        assert plan.token_ids[q0:q1].tolist() == seq.token_ids[start:kv_len], f"{ctx}: wrong token ids"
        blocks = alloc.blocks(seq.seq_id)
        assert len(blocks) == -(-kv_len // bs), f"{ctx}: {len(blocks)} rBlocks for {kv_len} tokens"
        table = plan.block_tables[i]
        assert table[:len(blocks)].tolist() == blocks and not np.any(table[len(blocks):]), ctx
        assert np.array_equal(plan.slot_mapping[q0:q1], table[pos // bs] * bs + pos % bs), f"{ctx}: slots"
        assert bool(plan.sample[i]) == (kv_len == seq.num_tokens), ctx
    assert len(np.unique(plan.slot_mapping)) == num_tokens, f"{ctx}: two tokens write one slot"


@dataclasses.dataclass(frozen=True)
class Pool:
    block_size: int
    num_blocks: int
    max_tokens_per_step: int
    max_seqs: int


POOLS = [
    Pool(block_size=4, num_blocks=16, max_tokens_per_step=32, max_seqs=8),
    Pool(block_size=1, num_blocks=40, max_tokens_per_step=16, max_seqs=4),
    Pool(block_size=8, num_blocks=9, max_tokens_per_step=64, max_seqs=16),
    Pool(block_size=3, num_blocks=23, max_tokens_per_step=7, max_seqs=3),
]


@pytest.mark.parametrize("pool", POOLS, ids=lambda p: f"bs{p.block_size}-nb{p.num_blocks}-tb{p.max_tokens_per_step}"
                         f"-ms{p.max_seqs}")
def test_random_workload(pool):
    seed = _seed()
    rng = np.random.default_rng(seed)
    num_requests, vocab = 750, 40
    pool_tokens = pool.num_blocks * pool.block_size
    max_len = min(int(rng.integers(pool_tokens // 2, 2 * pool_tokens)), pool_tokens)  # as LLM._submit
    table = rng.integers(0, vocab, size=(num_requests, max_len + 1)).astype(np.int32)
    alloc = BlockAllocator(pool.num_blocks)
    sched = Scheduler(alloc, pool.block_size, max_tokens_per_step=pool.max_tokens_per_step, max_seqs=pool.max_seqs)

    seqs: list[Sequence] = []
    total_work = 0
    steps = preemptions = resumed_with_outputs = cancels = 0
    preempted_outputs: dict[int, list[int]] = {}  # seq id -> its outputs when last preempted
    last_preemptions: dict[int, int] = {}
    while len(seqs) < num_requests or sched.has_work():
        ctx = f"seed={seed} step={steps}"
        # Requests arrive in bursts between steps.
        if len(seqs) < num_requests and rng.random() < 0.3:
            for _ in range(int(rng.integers(1, 6))):
                if len(seqs) == num_requests:
                    break
                prompt_len = int(rng.integers(1, max_len + 1)) if rng.random() < 0.2 else int(rng.integers(1, 12))
                stop_ids = tuple(int(t) for t in rng.integers(1, vocab, size=int(rng.integers(0, 3))))
                params = SamplingParams(max_new_tokens=int(rng.integers(1, 40)), ignore_eos=bool(rng.random() < 0.2),
                                        stop_token_ids=stop_ids)
                seq = sched.add(rng.integers(1, vocab, size=prompt_len).tolist(), params, max_len=max_len)
                assert seq.seq_id == len(seqs)
                seqs.append(seq)
                last_preemptions[seq.seq_id] = 0
                total_work += prompt_len + params.max_new_tokens
        # Now and then a client goes away: the rBlocks it alone held come back at once; those of a
        # shared prefix stay with their other holders.
        live = sched.running + sched.waiting
        if live and rng.random() < 0.01:
            victim = live[int(rng.integers(len(live)))]
            holders = {b: alloc.holders(b) for b in alloc.blocks(victim.seq_id)}
            free_before = alloc.num_free
            sched.cancel(victim)
            assert victim.status is Status.FINISHED and victim.finish_reason == "cancelled"
            alone = sum(h == 1 for h in holders.values())
            assert alloc.num_free == free_before + alone and not alloc.blocks(victim.seq_id), ctx
            assert all(alloc.holders(b) == h - 1 for b, h in holders.items()), ctx
            assert victim not in sched.running and victim not in sched.waiting
            cancels += 1
        if not sched.has_work():
            continue
        running_before = list(sched.running)
        plan = sched.plan()
        assert plan is not None, f"{ctx}: work is waiting but nothing was planned (deadlock)"
        plan_seqs = [seqs[int(i)] for i in plan.seq_ids]
        planned = {s.seq_id: i for i, s in enumerate(plan_seqs)}
        victims = [s for s in running_before if s.num_preemptions != last_preemptions[s.seq_id]]
        # Preemption takes the youngest first: the victims are the tail of the running list ...
        assert victims == running_before[len(running_before) - len(victims):], f"{ctx}: an older sequence preempted"
        # ... and those not resumed at once wait at the front of the queue, ahead of new requests.
        still_waiting = [s for s in victims if s.status is Status.WAITING]
        assert set(sched.waiting[:len(still_waiting)]) == set(still_waiting), f"{ctx}: preempted not first in line"
        for seq in victims:
            assert seq.num_preemptions == last_preemptions[seq.seq_id] + 1, ctx
            last_preemptions[seq.seq_id] = seq.num_preemptions
            preemptions += 1
            preempted_outputs[seq.seq_id] = list(seq.output_ids)
            # Waiting with no rBlocks, or resumed in this very step: from 0 or from what the prefix cache
            # still held of it (whole rBlocks, never its last token).
            resumed_from = seq.num_cached_prompt if seq.status is Status.RUNNING else 0
            assert seq.num_computed == resumed_from and resumed_from % pool.block_size == 0, ctx
            assert resumed_from < seq.num_tokens, ctx
        for seq_id, outputs in list(preempted_outputs.items()):
            seq = seqs[seq_id]
            assert seq.output_ids == outputs, f"{ctx}: a preempted sequence lost its outputs"
            if seq_id in planned:
                i = planned[seq_id]
                # The recompute chunk runs over prompt + outputs; the next token is sampled only at its end.
                if int(plan.kv_lens[i]) > len(seq.prompt_ids) and outputs:
                    resumed_with_outputs += 1
                if int(plan.kv_lens[i]) == seq.num_tokens:
                    del preempted_outputs[seq_id]
        _check_plan(plan, sched, alloc, ctx)
        sampled = np.array([table[s.seq_id, int(plan.kv_lens[i])] for i, s in enumerate(plan_seqs)], np.int32)
        lengths = {s.seq_id: len(s.output_ids) for s in plan_seqs}
        advanced = sched.update(plan, sampled, EOS)
        for i, seq in enumerate(plan_seqs):
            assert seq.num_computed == int(plan.kv_lens[i]), ctx
            assert len(seq.output_ids) - lengths[seq.seq_id] == (seq in advanced), ctx
            assert bool(plan.sample[i]) or seq not in advanced, ctx
        steps += 1
        assert steps <= 4 * total_work + 100, f"{ctx}: no end in sight (livelock?)"

    assert alloc.num_free == pool.num_blocks and not alloc.owners(), f"seed={seed}: rBlocks not returned"
    assert not sched.running and not sched.waiting
    reasons = {"length": 0, "stop": 0, "cancelled": 0}
    for seq in seqs:
        assert seq.status is Status.FINISHED, f"seed={seed}"
        want_ids, want_reason = _expected(seq, table)
        if seq.finish_reason == "cancelled":
            assert seq.output_ids == want_ids[:len(seq.output_ids)], f"seed={seed} seq={seq.seq_id}"
        else:
            assert (seq.output_ids, seq.finish_reason) == (want_ids, want_reason), f"seed={seed} seq={seq.seq_id}"
        reasons[seq.finish_reason] += 1
    print(dict(steps=steps, preemptions=preemptions, resumed_with_outputs=resumed_with_outputs,
               cached_tokens=sched.cached_tokens, **reasons))
    # The workload must actually exercise what it checks.
    assert reasons["length"] > 0 and reasons["stop"] > 0, reasons
    assert preemptions > 0 and resumed_with_outputs > 0, (preemptions, resumed_with_outputs)
    assert sched.cached_tokens > 0  # admissions and resumes that found their prefix cached


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_youngest_is_preempted_and_recomputes_prompt_plus_outputs(prefix_caching):
    # 4 rBlocks of 2 tokens. A (3 tokens) and B (4 tokens) fill 2 + 2 rBlocks. Next step A's decode
    # fits its rBlocks but B's needs a 5th: B, the youngest, is preempted and waits.
    alloc = BlockAllocator(4)
    sched = Scheduler(alloc, 2, max_tokens_per_step=16, max_seqs=4, prefix_caching=prefix_caching)
    a = sched.add([1, 2, 3], SamplingParams(max_new_tokens=4, ignore_eos=True), max_len=8)
    b = sched.add([4, 5, 6, 7], SamplingParams(max_new_tokens=8, ignore_eos=True), max_len=8)

    plan = sched.plan()
    assert plan.seq_ids.tolist() == [a.seq_id, b.seq_id] and plan.token_ids.tolist() == [1, 2, 3, 4, 5, 6, 7]
    sched.update(plan, np.array([10, 20]), EOS)
    assert a.output_ids == [10] and b.output_ids == [20] and alloc.num_free == 0

    plan = sched.plan()  # A writes position 3 (its 2nd rBlock), B needs a 3rd rBlock: none free, B is youngest
    assert plan.seq_ids.tolist() == [a.seq_id]
    assert b.status is Status.WAITING and b.num_preemptions == 1 and sched.waiting == [b]
    assert not alloc.blocks(b.seq_id) and b.output_ids == [20]
    sched.update(plan, np.array([11]), EOS)

    plan = sched.plan()  # A takes a 3rd rBlock (position 4); B (3 rBlocks for 5 tokens) still does not fit
    assert plan.seq_ids.tolist() == [a.seq_id] and sched.waiting == [b]
    sched.update(plan, np.array([12]), EOS)
    plan = sched.plan()
    assert plan.seq_ids.tolist() == [a.seq_id]
    sched.update(plan, np.array([13]), EOS)
    assert a.finish_reason == "length" and a.output_ids == [10, 11, 12, 13] and alloc.num_free == 4

    plan = sched.plan()  # B resumes: one chunk recomputes its prompt and its kept output, then samples
    assert plan.seq_ids.tolist() == [b.seq_id]
    if prefix_caching:
        # A's growth evicted B's released rBlocks last first: B's first rBlock ([4, 5]) is still cached.
        assert b.num_cached_prompt == 2
        assert plan.token_ids.tolist() == [6, 7, 20] and plan.positions.tolist() == [2, 3, 4]
    else:
        assert plan.token_ids.tolist() == [4, 5, 6, 7, 20] and plan.positions.tolist() == [0, 1, 2, 3, 4]
    assert plan.sample.tolist() == [True] and plan.kv_lens.tolist() == [5]
    sched.update(plan, np.array([21]), EOS)
    assert b.output_ids == [20, 21]


def test_cancel_frees_blocks_immediately_and_update_skips_it():
    alloc = BlockAllocator(8)
    sched = Scheduler(alloc, 4, max_tokens_per_step=64, max_seqs=4)
    a = sched.add(list(range(1, 10)), SamplingParams(max_new_tokens=5), max_len=32)
    b = sched.add([1, 2], SamplingParams(max_new_tokens=5), max_len=32)
    plan = sched.plan()
    assert alloc.num_free == 8 - 3 - 1
    sched.cancel(a)  # between plan and update, as a client disconnect would
    assert alloc.num_free == 8 - 1 and a.finish_reason == "cancelled" and a not in sched.running
    advanced = sched.update(plan, np.array([7, 8]), EOS)
    assert advanced == [b] and a.output_ids == [] and b.output_ids == [8]
    c = sched.add([3], SamplingParams(), max_len=32)
    sched.cancel(c)  # a waiting sequence: never allocated, simply gone
    assert c.status is Status.FINISHED and c not in sched.waiting
    sched.cancel(b)
    assert alloc.num_free == 8 and not sched.has_work() and sched.plan() is None


def test_bad_limits():
    with pytest.raises(ValueError):
        Scheduler(BlockAllocator(4), 4, max_tokens_per_step=0, max_seqs=4)
    with pytest.raises(ValueError):
        Scheduler(BlockAllocator(4), 4, max_tokens_per_step=8, max_seqs=0)


def test_token_slice_equals_slicing_the_whole_list():
    from jaxllm.engine.sequence import Sequence

    rng = np.random.default_rng(seed(27469))
    for _ in range(200):
        seq = Sequence(0, rng.integers(0, 100, size=int(rng.integers(1, 20))).tolist(), SamplingParams(), 100)
        seq.output_ids = rng.integers(0, 100, size=int(rng.integers(0, 20))).tolist()
        start = int(rng.integers(0, seq.num_tokens + 1))
        end = int(rng.integers(start, seq.num_tokens + 1))
        assert seq.token_slice(start, end) == seq.token_ids[start:end]


# ----- edge cases that random draws only sometimes hit, made deterministic -----

def test_first_sequence_writes_kv_slot_zero():
    alloc = BlockAllocator(4)
    sched = Scheduler(alloc, 4, max_tokens_per_step=16, max_seqs=2)
    sched.add([5, 6, 7], SamplingParams(max_new_tokens=4), max_len=16)
    plan = sched.plan()
    assert plan.block_tables[0, 0] == 0 and plan.slot_mapping.tolist() == [0, 1, 2]
    assert plan.positions.tolist() == [0, 1, 2] and plan.kv_lens.tolist() == [3]


def test_preempted_sequence_computed_length_resets_to_zero():
    alloc = BlockAllocator(3)
    sched = Scheduler(alloc, 4, max_tokens_per_step=16, max_seqs=2, prefix_caching=False)
    old = sched.add([1, 2, 3, 4, 5], SamplingParams(max_new_tokens=10), max_len=16)  # 2 rBlocks
    young = sched.add([6, 7, 8], SamplingParams(max_new_tokens=10), max_len=16)  # 1 rBlock
    plan = sched.plan()
    sched.update(plan, np.array([9, 9]), eos_id=0)
    assert young.num_computed == 3 and young.status is Status.RUNNING
    sched.update(sched.plan(), np.array([9, 9]), eos_id=0)  # young fills its rBlock (4 tokens)
    plan = sched.plan()  # young needs a second rBlock, old a third: none is free, so young goes
    assert young.status is Status.WAITING and young.num_computed == 0 and young.num_preemptions == 1
    assert sched.waiting[0] is young and not alloc.blocks(young.seq_id)
    assert [s.seq_id for s in sched.running] == [old.seq_id]


def _assert_no_record(sched: Scheduler, alloc: BlockAllocator, seq: Sequence, ctx) -> None:
    assert seq.status is Status.FINISHED, ctx
    assert sched.sequence(seq.seq_id) is None, f"{ctx}: sequence {seq.seq_id} is still in the live map"
    assert seq not in sched.waiting and seq not in sched.running, ctx
    assert seq.seq_id not in alloc.owners() and not alloc.blocks(seq.seq_id), f"{ctx}: it still owns rBlocks"


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_a_finished_or_cancelled_sequence_leaves_no_record(prefix_caching):
    """Property: once a sequence ends (EOS, length, a stop string via finish, or a cancel while waiting, running
    or between plan and update), the scheduler holds nothing of it: not in its live map, its waiting or
    running lists, nor the allocator's tables; rBlocks come back only to the pool or the prefix cache."""
    ends = {"cancel-waiting": 0, "cancel-running": 0, "cancel-in-step": 0, "finish": 0, "update": 0}
    for seed in range(6):
        rng = np.random.default_rng(seed)
        alloc = BlockAllocator(int(rng.integers(6, 20)))
        sched = Scheduler(alloc, 4, max_tokens_per_step=int(rng.integers(4, 24)), max_seqs=int(rng.integers(1, 6)),
                          prefix_caching=prefix_caching)
        ended: dict[int, Sequence] = {}
        for step in range(400):
            ctx = f"seed={seed} step={step}"
            for _ in range(int(rng.integers(0, 3))):
                prompt = rng.integers(1, 6, size=int(rng.integers(1, 20))).tolist()  # few ids: shared prefixes
                sched.add(prompt, SamplingParams(max_new_tokens=int(rng.integers(1, 12))), max_len=alloc.num_blocks * 4)
            now_ended = []
            live = sched.waiting + sched.running
            if live and rng.random() < 0.2:
                victim = live[int(rng.integers(len(live)))]
                kind = "cancel-waiting" if victim.status is Status.WAITING else "cancel-running"
                if rng.random() < 0.5:
                    sched.cancel(victim)
                else:
                    sched.finish(victim, "stop")  # a stop string matched
                    kind = "finish"
                ends[kind] += 1
                now_ended.append(victim)
            plan = sched.plan()
            if plan is not None:
                in_step = [sched.sequence(i) for i in plan.seq_ids]
                if rng.random() < 0.1:  # a client leaves while the step runs
                    victim = in_step[int(rng.integers(len(in_step)))]
                    sched.cancel(victim)
                    ends["cancel-in-step"] += 1
                    now_ended.append(victim)
                sched.update(plan, rng.integers(0, 6, size=plan.num_seqs), EOS)  # 0 is EOS
                for seq in in_step:
                    if seq.status is Status.FINISHED and seq not in now_ended:
                        ends["update"] += 1
                        now_ended.append(seq)
            for seq in now_ended:
                _assert_no_record(sched, alloc, seq, ctx)
                ended[seq.seq_id] = seq
            assert set(alloc.owners()) <= {s.seq_id for s in sched.waiting + sched.running}, ctx
        for seq in sched.waiting + sched.running:
            sched.cancel(seq)
            ended[seq.seq_id] = seq
        for seq in ended.values():
            _assert_no_record(sched, alloc, seq, f"seed={seed} at the end")
        assert not sched.has_work() and not alloc.owners() and alloc.num_free == alloc.num_blocks
    assert min(ends.values()) > 20, ends  # every way of ending, many times
