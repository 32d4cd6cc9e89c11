"""Properties of the instance set's host logic, through its public API only (constructors, add / plan / update /
cancel, is_borrowed and the input layout's borrowed step, grow / free, num_free): routing by load, lending off at the
pool's edge, what counts as borrowed, and that an ended sequence leaves no record. Pure Python over fixed-seed random workloads, no device.
"""

import dataclasses

import numpy as np
import pytest

from jaxllm.contract import SamplingParams
from jaxllm.engine.allocator import OutOfBlocks
from jaxllm.engine.distkv import GManager, InstanceSpec, RManager
from jaxllm.engine.instances import InstanceSchedulers
from jaxllm.engine.lending import LendingAllocator
from jaxllm.engine.sequence import Status
from jaxllm.executor.inputs import InputLayout, is_borrowed
from jaxllm.tuner.buckets import Buckets

EOS = 0
BLOCK = 4


def _instance_set(rng, *, lending: bool = True, blocks: tuple[int, int] = (4, 16)) -> InstanceSchedulers:
    return InstanceSchedulers(int(rng.integers(2, 5)), int(rng.integers(*blocks)), BLOCK,
                              max_tokens_per_step=int(rng.integers(8, 40)), max_seqs=int(rng.integers(1, 5)),
                              lending=lending)


def _add(rng, scheds: InstanceSchedulers, max_prompt: int = 30):
    prompt = rng.integers(1, 50, size=int(rng.integers(1, max_prompt + 1))).tolist()
    return scheds.add(prompt, SamplingParams(max_new_tokens=int(rng.integers(1, 16))),
                      max_len=scheds.blocks_per_instance * BLOCK)


def _step(rng, scheds: InstanceSchedulers):
    """One planned and recorded step (its recalls ride on the plan; no device here: their copies are assumed
    done); the plan, or None."""
    plan = scheds.plan()
    if plan is not None:
        scheds.update(plan, rng.integers(0, 50, size=plan.num_seqs), EOS)
    return plan


# ----- lending off: a sequence needing exactly the free rBlocks fits -----

def test_lending_off_a_sequence_needing_exactly_the_free_rblocks_fits():
    """Property: with lending off, growing a table by exactly the instance's free rBlocks succeeds (taking every
    one, borrowing none, whatever the other instances have free); one more is refused and takes nothing."""
    rng = np.random.default_rng(3)
    for _ in range(300):
        gm = GManager()
        sizes = rng.integers(1, 12, size=int(rng.integers(2, 5)))
        allocators = [LendingAllocator(RManager(InstanceSpec(i, 0, int(n)), gm), gm, lending=False)
                      for i, n in enumerate(sizes)]
        next_id = 0
        for a in allocators:  # other sequences hold part of every pool
            while rng.random() < 0.5 and a.num_free:
                a.grow(next_id, int(rng.integers(1, a.num_free + 1)))
                next_id += 1
        a = allocators[int(rng.integers(len(allocators)))]
        grown = a.rmanager.requests()
        seq = int(rng.choice(grown)) if grown and rng.random() < 0.5 else next_id  # grow one, or start one
        have = len(a.blocks(seq))
        free, others = a.num_free, gm.total_free() - a.num_free
        if free == 0:
            continue
        with pytest.raises(OutOfBlocks, match="lending is off"):
            a.grow(seq, have + free + 1)
        assert len(a.blocks(seq)) == have and a.num_free == free and gm.total_free() == free + others
        table = a.grow(seq, have + free)
        assert len(table) == have + free and a.num_free == 0, (sizes, have, free)
        assert all(block // a.blocks_per_instance == a.instance for block in table)  # nothing borrowed
        assert not gm.loans() and gm.total_free() == others
        a.free(seq)
        assert a.num_free == free + have and not a.blocks(seq)


# ----- routing -----

def test_a_burst_of_equal_requests_goes_round_the_instances():
    """Requests added back to back, before any step runs, are all waiting: routing sees them as load, so
    equal prompts go 0, 1, ..., n-1, 0, 1, ..."""
    for instances in (2, 3, 4):
        scheds = InstanceSchedulers(instances, 16, BLOCK, max_tokens_per_step=32, max_seqs=4)
        homes = [scheds.home(scheds.add([5] * 7, SamplingParams(max_new_tokens=4), max_len=64).seq_id)
                 for _ in range(3 * instances)]
        assert homes == list(range(instances)) * 3


def test_routing_counts_waiting_and_running_tokens():
    """Property: every request goes to the instance with the fewest tokens queued and running (prompts and
    outputs so far), the lowest id on a tie, through bursts, steps, preemptions, finishes and cancels."""
    rng = np.random.default_rng(4)
    mixed = 0  # placements where an instance had both waiting and running sequences
    for _ in range(20):
        scheds = _instance_set(rng)
        seqs = []
        for _ in range(60):
            for _ in range(int(rng.integers(1, 6))):  # a burst, no step between its requests
                live = [s for s in seqs if s.status is not Status.FINISHED]
                load = [sum(s.num_tokens for s in live if scheds.home(s.seq_id) == i) for i in range(scheds.instances)]
                want = min(range(scheds.instances), key=lambda i: (load[i], i))
                seq = _add(rng, scheds)
                assert scheds.home(seq.seq_id) == want, (load, want, scheds.home(seq.seq_id))
                seqs.append(seq)
                mixed += bool(scheds.running) and bool(scheds.waiting)
            for _ in range(int(rng.integers(0, 4))):
                _step(rng, scheds)
            live = scheds.waiting + scheds.running
            if live and rng.random() < 0.2:
                scheds.cancel(live[int(rng.integers(len(live)))])
    assert mixed > 200, mixed


# ----- what counts as borrowed -----

def _borrowing(scheds: InstanceSchedulers, plan) -> bool:
    """Ground truth from the ledger: some sequence of the plan holds a lent rBlock."""
    planned = set(plan.seq_ids.tolist())
    return any(loan.request in planned for loan in scheds.gmanager.loans())


def _layout(scheds: InstanceSchedulers, plan) -> InputLayout:
    """The executor's input layout for this instance set, its buckets large enough for any of its plans."""
    buckets = Buckets(max_seqs=scheds.max_seqs, max_tokens_per_step=scheds.max_tokens_per_step,
                      table_width=max(plan.block_tables.shape[1], 1))
    return InputLayout(instances=scheds.instances, blocks_per_instance=scheds.blocks_per_instance, block_size=BLOCK,
                       buckets=buckets)


def test_a_plan_is_borrowed_exactly_when_a_sequence_holds_a_lent_rblock():
    """Property: is_borrowed(plan), and the borrowed step the executor's input layout builds of it (the one that runs
    DistAttention and its collectives), say whether some planned sequence holds an rBlock of another instance (the
    ledger's loans), whatever the table padding past each sequence's length holds: zeros (the joined plan's
    padding, which names instance 0's rBlock 0), any other instance's ids, or ids of no instance."""
    rng = np.random.default_rng(5)
    seen = {True: 0, False: 0}
    padded_elsewhere = 0  # plans with padding that names another instance than the row's home
    for _ in range(40):
        scheds = _instance_set(rng, blocks=(3, 10))
        nb = scheds.blocks_per_instance
        for _ in range(40):
            for _ in range(int(rng.integers(0, 3))):
                _add(rng, scheds, max_prompt=2 * nb * BLOCK)
            plan = scheds.plan()
            if plan is None:
                continue
            want = _borrowing(scheds, plan)
            assert is_borrowed(plan, nb, BLOCK) == want
            batch = _layout(scheds, plan).build(plan)
            assert batch.borrowed == want and (batch.inputs.parts is not None) == want
            seen[want] += 1
            used = -(-plan.kv_lens.astype(np.int64) // BLOCK)
            past = np.arange(plan.block_tables.shape[1])[None, :] >= used[:, None]
            padded_elsewhere += bool(np.any(past & (plan.block_tables // nb != plan.instances[:, None])))
            for _ in range(3):  # the padding rewritten to random ids of any instance, or of none (-1, past the mesh)
                noise = rng.integers(-1, (scheds.instances + 1) * nb, size=plan.block_tables.shape).astype(np.int32)
                tables = np.where(past, noise, plan.block_tables)
                noisy = dataclasses.replace(plan, block_tables=tables)
                assert is_borrowed(noisy, nb, BLOCK) == want == _layout(scheds, noisy).build(noisy).borrowed
            scheds.update(plan, rng.integers(0, 50, size=plan.num_seqs), EOS)
    assert min(seen.values()) > 100 and padded_elsewhere > 100, (seen, padded_elsewhere)


# ----- an ended sequence leaves no record -----

def _assert_no_record(scheds: InstanceSchedulers, seq, ctx) -> None:
    home = scheds.home(seq.seq_id)
    assert seq.status is Status.FINISHED, ctx
    assert scheds.sequence(seq.seq_id) is None, f"{ctx}: sequence {seq.seq_id} is still live"
    assert seq not in scheds.waiting and seq not in scheds.running, ctx
    assert not scheds.allocators[home].blocks(seq.seq_id), f"{ctx}: it still has an rBlock table"
    assert scheds.gmanager.home_of(seq.seq_id) is None, ctx
    assert all(loan.request != seq.seq_id for loan in scheds.gmanager.loans()), f"{ctx}: it still owes rBlocks"


@pytest.mark.parametrize("lending", [True, False])
def test_a_finished_or_cancelled_sequence_leaves_no_record_in_the_instance_set(lending):
    """Property: once a sequence of the instance set ends (EOS, length, finish, or a cancel while waiting,
    running or between plan and update), no scheduler lists it, its home allocator has no table for it, and the
    ledger neither homes it nor holds a loan to it; when all have ended, every rBlock is free and nothing is
    borrowed."""
    rng = np.random.default_rng(10 + lending)
    ends = {"cancel": 0, "cancel-in-step": 0, "finish": 0, "update": 0}
    for trial in range(12):
        scheds = _instance_set(rng, lending=lending, blocks=(3, 10))
        ended = []
        for step in range(80):
            ctx = f"trial {trial} step {step}"
            now = []
            for _ in range(int(rng.integers(0, 3))):
                _add(rng, scheds, max_prompt=scheds.blocks_per_instance * BLOCK - 1)
            live = scheds.waiting + scheds.running
            if live and rng.random() < 0.2:
                victim = live[int(rng.integers(len(live)))]
                if rng.random() < 0.5:
                    scheds.cancel(victim)
                    ends["cancel"] += 1
                else:
                    scheds.finish(victim, "stop")
                    ends["finish"] += 1
                now.append(victim)
            plan = scheds.plan()
            if plan is not None:
                in_step = [scheds.sequence(i) for i in plan.seq_ids]
                if rng.random() < 0.15:
                    victim = in_step[int(rng.integers(len(in_step)))]
                    scheds.cancel(victim)
                    ends["cancel-in-step"] += 1
                    now.append(victim)
                scheds.update(plan, rng.integers(0, 50, size=plan.num_seqs), EOS)
                finished = [s for s in in_step if s.status is Status.FINISHED and s not in now]
                ends["update"] += len(finished)
                now += finished
            for seq in now:
                _assert_no_record(scheds, seq, ctx)
            ended += now
        for seq in scheds.waiting + scheds.running:
            scheds.cancel(seq)
            ended.append(seq)
        for seq in ended:
            _assert_no_record(scheds, seq, f"trial {trial} at the end")
        assert not scheds.has_work() and scheds.stats().pool_blocks_free == scheds.stats().pool_blocks
        assert scheds.stats().lending.borrowed_blocks == 0
    assert min(ends.values()) > 5, ends
