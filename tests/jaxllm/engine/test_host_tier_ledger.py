"""The host tier's ledger and the scheduler's swaps without a device.

A mirror of the device pool and the host slots holds, per KV row, a tag naming the token prefix it was computed
for; each plan's HostCopies are applied to it in the executor's order (dropped, out, in) and every step checks
that each KV row it reads holds the tag of its own sequence's prefix: a swap-in into the wrong rBlock, a host
slot reused while still needed, a spill read after it was overwritten all show up as a wrong tag.
"""

import itertools

import numpy as np
import pytest

from jaxllm.contract import SamplingParams
from jaxllm.engine.allocator import BlockAllocator
from jaxllm.engine.host_tier import HostTier
from jaxllm.engine.scheduler import Scheduler
from jaxllm.engine.sequence import Status
from tests.seeds import seed

EOS = 0


def test_swap_out_declines_when_the_tier_is_full_and_takes_nothing():
    host = HostTier(3)
    assert not host.swap_out(1, [10, 11, 12, 13])
    assert host.num_free == 3 and host.take_copies() is None and host.stats().swap_fallbacks_total == 1
    assert host.swap_out(1, [10, 11])
    assert not host.swap_out(2, [20, 21])  # one slot left
    copies = host.take_copies()
    assert copies.out_blocks.tolist() == [10, 11] and len(copies.out_slots) == 2 and copies.num_in == 0


def test_spills_evict_the_oldest_and_swaps_evict_spills():
    host = HostTier(3)
    for key, block in ((b"a", 1), (b"b", 2), (b"c", 3)):
        assert host.spill(key, block)
    assert host.spill(b"d", 4)  # evicts "a", the oldest
    assert host.lookup([b"a"]) == [] and len(host.lookup([b"b", b"c", b"d"])) == 3
    copies = host.take_copies()
    assert len(copies.dropped) == 1 and copies.num_out == 4
    assert host.swap_out(7, [5, 6, 7])  # a swap takes every cached slot
    assert host.lookup([b"b"]) == [] and host.stats().cached_blocks == 0
    assert not host.spill(b"e", 8)  # every slot holds swapped KV: nothing to evict


def test_slots_read_by_pending_copies_are_not_reused_before_the_copies_are_taken():
    host = HostTier(2)
    assert host.swap_out(1, [10, 11])
    host.take_copies()
    host.swap_in(1, [20, 21])
    assert not host.swap_out(2, [30])  # both slots are being read by the pending copies
    copies = host.take_copies()
    assert copies.in_blocks.tolist() == [20, 21]
    assert host.swap_out(2, [30])


def test_claimed_slots_survive_spills_until_restored_or_unclaimed():
    host = HostTier(2)
    host.spill(b"a", 1)
    host.spill(b"b", 2)
    slots = host.lookup([b"a"])
    host.claim(slots)
    assert host.spill(b"c", 3)  # evicts "b", not the claimed "a"
    assert host.lookup([b"b"]) == []
    host.unclaim(slots)
    assert host.lookup([b"a"]) == slots
    host.claim(slots)
    host.restore(slots, [9])
    assert host.lookup([b"a"]) == []  # not before the copy is taken: a spill must not land in the slot it reads
    copies = host.take_copies()
    assert copies.in_blocks.tolist() == [9] and copies.released.tolist() == []
    assert host.lookup([b"a"]) == slots  # inclusive: the hit keeps its slot


def test_a_restored_prefix_evicted_again_is_not_copied_out_again():
    """A multi-turn conversation's history crosses the link once: the device evicting rBlocks it got back from
    the host finds them there (an LRU touch, no copy); a swapped sequence's slots are released when read back."""
    host = HostTier(4)
    host.spill(b"a", 1)
    host.spill(b"b", 2)
    assert host.take_copies().out_slots.tolist() == [0, 1]
    slots = host.lookup([b"a", b"b"])
    host.claim(slots)
    host.restore(slots, [5, 6])
    host.take_copies()
    assert host.spill(b"a", 5) and host.spill(b"b", 6) and host.take_copies() is None
    assert host.stats().blocks_out_total == 2 and host.stats().hit_blocks_total == 2
    assert host.swap_out(7, [8, 9])  # the two free slots
    host.take_copies()
    host.swap_in(7, [10, 11])
    copies = host.take_copies()
    assert sorted(copies.released.tolist()) == sorted(copies.in_slots.tolist()) and host.num_free == 4


def test_a_swapped_sequences_host_cached_rblocks_are_pinned_not_copied_again():
    """A conversation restored from the host cache, then preempted: its history's rBlocks are on the host already,
    so the swap copies only the rest; the pinned slots are neither evicted nor found meanwhile, and rejoin the
    cache when the sequence comes back (or ends)."""
    host = HostTier(4)
    host.spill(b"a", 1)
    host.spill(b"b", 2)
    host.take_copies()
    cached = host.lookup([b"a", b"b"])
    host.claim(cached)
    host.restore(cached, [5, 6])
    host.take_copies()
    assert host.swap_out(7, [5, 6, 8], [b"a", b"b"])
    copies = host.take_copies()
    assert copies.out_blocks.tolist() == [8] and host.swapped(7)[:2] == cached
    assert host.stats().blocks_out_total == 3 and host.stats().swap_cached_blocks_total == 2
    assert host.lookup([b"a"]) == [] and host.stats().cached_blocks == 0  # pinned: not the cache's meanwhile
    assert host.spill(b"a", 9) and host.take_copies() is None  # on the host already: nothing copied
    assert not host.swap_out(8, [1, 2])  # one free slot; the pinned ones are not evictable
    host.swap_in(7, [10, 11, 12])
    assert host.lookup([b"a"]) == []  # not before the copies reading it are taken
    copies = host.take_copies()
    assert copies.in_slots.tolist()[:2] == cached and copies.released.tolist() == copies.in_slots.tolist()[2:]
    assert host.lookup([b"a", b"b"]) == cached and host.num_free == 4
    assert host.swap_out(9, [10, 11], [b"a", b"b"]) and host.take_copies() is None  # all pinned: no copy
    host.discard(9)
    assert host.lookup([b"a", b"b"]) == cached and host.stats().swapped_sequences == 0


def _tags(tokens: list[int]) -> list[int]:
    """Per position, a tag of the token prefix up to it (what the KV row there depends on)."""
    return list(itertools.accumulate(tokens, lambda h, t: hash((h, t)), initial=0))[1:]


@pytest.mark.parametrize("host_slots", [2, 7, 40])
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_random_workload_reads_only_its_own_kv(host_slots, prefix_caching):
    run_seed = seed(35035)
    rng = np.random.default_rng(run_seed)
    bs, num_blocks, vocab = 4, 20, 6  # a small vocabulary: prompts share prefixes
    host = HostTier(host_slots)
    alloc = BlockAllocator(num_blocks, on_evict=host.spill if prefix_caching else None)
    sched = Scheduler(alloc, bs, max_tokens_per_step=24, max_seqs=6, prefix_caching=prefix_caching, host_tier=host)
    device = {b: [None] * bs for b in range(num_blocks)}
    slots: dict[int, list] = {}
    table = rng.integers(0, vocab, size=(400, 200)).astype(np.int32)
    seqs, steps = [], 0
    while len(seqs) < 300 or sched.has_work():
        ctx = f"seed={run_seed} step={steps}"
        if len(seqs) < 300 and rng.random() < 0.4:
            for _ in range(int(rng.integers(1, 4))):
                prompt = [1, 2, 3, 1, 2] * int(rng.integers(0, 3)) + rng.integers(1, vocab, size=int(
                    rng.integers(1, 30))).tolist()
                seqs.append(sched.add(prompt, SamplingParams(max_new_tokens=int(rng.integers(1, 30))), max_len=78))
        live = sched.running + sched.waiting
        if live and rng.random() < 0.02:
            sched.cancel(live[int(rng.integers(len(live)))])
        if not sched.has_work():
            continue
        plan = sched.plan()
        assert plan is not None, ctx
        copies = plan.host_copies
        if copies is not None:  # the executor's order: dropped, out (reads the pool as it was), in
            for slot in copies.dropped.tolist():
                slots.pop(slot, None)
            outs = [(b, s, list(device[b])) for b, s in zip(copies.out_blocks.tolist(), copies.out_slots.tolist())]
            for _, slot, rows in outs:
                slots[slot] = rows
            for slot, block in zip(copies.in_slots.tolist(), copies.in_blocks.tolist()):
                device[block] = list(slots[slot])
            for slot in copies.released.tolist():  # read for the last time
                del slots[slot]
        for i, seq_id in enumerate(plan.seq_ids.tolist()):
            seq = sched.sequence(seq_id)
            tags = _tags(seq.token_ids)
            start, end = int(plan.positions[plan.cu_q_lens[i]]), int(plan.kv_lens[i])
            blocks = plan.block_tables[i]
            for p in range(start):  # KV the step reads: computed before, restored or shared
                assert device[int(blocks[p // bs])][p % bs] == tags[p], f"{ctx}: seq {seq_id} reads stale KV at {p}"
            for p in range(start, end):  # KV the step writes
                device[int(blocks[p // bs])][p % bs] = tags[p]
        sampled = np.array([table[int(i) % 400, int(k)] for i, k in zip(plan.seq_ids, plan.kv_lens)], np.int32)
        sched.update(plan, sampled, EOS)
        steps += 1
        assert steps < 20000, f"{ctx}: no end in sight"
    assert all(s.status is Status.FINISHED for s in seqs)
    stats = host.stats()
    assert stats.swapped_sequences == 0 and stats.blocks_used == stats.cached_blocks, stats
    assert alloc.num_free == num_blocks
    if host_slots >= 40:
        assert stats.swap_outs_total > 0 and 0 < stats.swap_ins_total <= stats.swap_outs_total, stats  # cancels
        assert not prefix_caching or stats.hit_blocks_total > 0 and stats.swap_cached_blocks_total > 0, stats
    if host_slots == 2:
        assert stats.swap_fallbacks_total > 0, stats


def test_unclaiming_a_key_spilled_again_meanwhile_keeps_one_copy_and_frees_the_other():
    host = HostTier(3)
    host.spill(b"a", 1)
    slots = host.lookup([b"a"])
    host.claim(slots)
    host.spill(b"a", 2)  # the device evicted its own copy of the same prefix meanwhile
    host.unclaim(slots)
    assert len(host.lookup([b"a"])) == 1
    host.take_copies()
    assert host.num_used == 1 and host.num_free == 3  # nothing leaked: one used (evictable), two free


def _apply_copies(plan, device: dict, slots: dict) -> None:
    """The executor's order: host drops and copies out, the recall copies (all reads first), host copies in."""
    host = plan.host_copies
    if host is not None:
        for slot in host.dropped.tolist():
            slots.pop(slot, None)
        outs = [(s, list(device[b])) for b, s in zip(host.out_blocks.tolist(), host.out_slots.tolist())]
        for slot, rows in outs:
            slots[slot] = rows
    if plan.block_copies is not None:
        moved = [(int(dst), list(device[int(src)])) for src, dst in plan.block_copies]
        for dst, rows in moved:
            device[dst] = rows
    if host is not None:
        for slot, block in zip(host.in_slots.tolist(), host.in_blocks.tolist()):
            device[block] = list(slots[slot])
        for slot in host.released.tolist():
            del slots[slot]


@pytest.mark.parametrize("host_slots", [3, 12, 60])
@pytest.mark.parametrize("lending", [True, False])
def test_instances_with_host_tiers_read_only_their_own_kv(host_slots, lending):
    """Three instances lending each other rBlocks (recalls, loans that make creditors evict and spill), each with
    its own host tier: every KV row a step reads is its own sequence's."""
    from jaxllm.engine.instances import InstanceSchedulers

    run_seed = seed(35036)
    rng = np.random.default_rng(run_seed)
    bs, nb, instances, vocab = 4, 8, 3, 6
    sched = InstanceSchedulers(instances, nb, bs, max_tokens_per_step=16, max_seqs=4, lending=lending,
                               host_blocks=host_slots)
    device = {b: [None] * bs for b in range(instances * nb)}
    slots: dict[int, list] = {}
    table = rng.integers(0, vocab, size=(2000, 200)).astype(np.int32)
    seqs, steps = [], 0
    while len(seqs) < 200 or sched.has_work():
        ctx = f"seed={run_seed} step={steps}"
        if len(seqs) < 200 and rng.random() < 0.4:
            for _ in range(int(rng.integers(1, 4))):
                prompt = [1, 2, 3, 1, 2] * int(rng.integers(0, 3)) + rng.integers(1, vocab, size=int(
                    rng.integers(1, 40 if lending else 20))).tolist()
                seqs.append(sched.add(prompt, SamplingParams(max_new_tokens=int(rng.integers(1, 25))),
                                      max_len=nb * bs * (instances if lending else 1) - 1))
        live = sched.running + sched.waiting
        if live and rng.random() < 0.02:
            sched.cancel(live[int(rng.integers(len(live)))])
        if not sched.has_work():
            continue
        plan = sched.plan()
        assert plan is not None, ctx
        _apply_copies(plan, device, slots)
        for i, seq_id in enumerate(plan.seq_ids.tolist()):
            tags = _tags(sched.sequence(seq_id).token_ids)
            start, end = int(plan.positions[plan.cu_q_lens[i]]), int(plan.kv_lens[i])
            blocks = plan.block_tables[i]
            for p in range(start):
                assert device[int(blocks[p // bs])][p % bs] == tags[p], f"{ctx}: seq {seq_id} reads stale KV at {p}"
            for p in range(start, end):
                device[int(blocks[p // bs])][p % bs] = tags[p]
        sampled = np.array([table[int(i) % 2000, int(k)] for i, k in zip(plan.seq_ids, plan.kv_lens)], np.int32)
        sched.update(plan, sampled, EOS)
        steps += 1
        assert steps < 20000, f"{ctx}: no end in sight"
    assert all(s.status is Status.FINISHED for s in seqs)
    stats = sched.stats()
    assert stats.host.swapped_sequences == 0 and stats.host.blocks_used == stats.host.cached_blocks, stats.host
    if host_slots == 60:
        assert stats.host.swap_outs_total > 0 and stats.host.hit_blocks_total > 0, stats.host
    if lending:
        assert stats.lending.loans_total > 0 and stats.lending.recalled_blocks_total > 0, stats.lending
