"""Penalty slots in the scheduler, without a device: a NumPy mirror of the device's penalty state
(jaxllm.executor.penalties: clear at a row's start position, prompt tokens into `prompt`, recomputed generated
tokens and sampled tokens into `counts`) is driven by the plans, in dispatch order (continuations included, their
input tokens the previous step's samples), and at every row that samples, the slot holds exactly its sequence's
generated-token counts (and its prompt's tokens, with a repetition penalty), through chunked prefill, prefix
caching, preemption and recompute, cancels and slots reused dirty."""

from __future__ import annotations

import numpy as np
import pytest

from jaxllm.contract import SamplingParams
from jaxllm.engine.allocator import BlockAllocator
from jaxllm.engine.scheduler import Scheduler
from jaxllm.engine.sequence import Status
from tests.seeds import seed

VOCAB = 12  # small: tokens repeat, so counts above 1 are common
EOS = 0


class _Mirror:
    """The device's penalty state and its step rules, in NumPy, starting dirty."""

    def __init__(self, rng, slots: int):
        self.counts = rng.integers(0, 3, (slots, VOCAB))
        self.prompt = rng.random((slots, VOCAB)) < 0.5
        self.checked = 0

    def run(self, sched: Scheduler, plan, tokens: np.ndarray, sampled: np.ndarray) -> None:
        rows = plan.penalties
        if rows is None:
            return
        for i in range(plan.num_seqs):
            slot = int(rows.slot[i])
            if slot < 0:
                continue
            first, last = int(plan.cu_q_lens[i]), int(plan.cu_q_lens[i + 1])
            if plan.positions[first] == rows.start[i]:
                self.counts[slot], self.prompt[slot] = 0, False
            for t in range(first, last):
                position, token = int(plan.positions[t]), int(tokens[t])
                if position < rows.prompt_len[i]:
                    self.prompt[slot, token] = True
                elif position < rows.recount_end[i]:
                    self.counts[slot, token] += 1
            seq = sched.sequence(plan.seq_ids[i])
            if plan.sample[i] and seq is not None and seq.status is Status.RUNNING:
                assert seq.penalty_slot == slot
                np.testing.assert_array_equal(self.counts[slot], np.bincount(seq.output_ids, minlength=VOCAB))
                if seq.params.repetition_penalty != 1:
                    np.testing.assert_array_equal(self.prompt[slot], np.isin(np.arange(VOCAB), seq.prompt_ids))
                self.checked += 1
            if plan.sample[i]:
                self.counts[slot, int(sampled[i])] += 1


def _params(rng) -> SamplingParams:
    kind = rng.integers(0, 4)
    penalties = [{}, dict(frequency_penalty=0.5), dict(repetition_penalty=1.3),
                 dict(presence_penalty=-1.0, repetition_penalty=0.8)][kind]
    return SamplingParams(max_new_tokens=int(rng.integers(1, 25)), ignore_eos=bool(rng.random() < 0.7),
                          **penalties)


@pytest.mark.parametrize("case", range(8))
def test_every_sampling_row_sees_exactly_its_sequences_history(case):
    rng = np.random.default_rng([seed(4501), case])
    max_seqs = 4
    # Room for the longest sequence (22 + 24 tokens) and little more: preemptions.
    sched = Scheduler(BlockAllocator(int(rng.integers(12, 16))), 4, max_tokens_per_step=int(rng.integers(6, 20)),
                      max_seqs=max_seqs)
    mirror = _Mirror(rng, max_seqs)
    table = rng.integers(0, VOCAB, (1000, 128))  # the fake sampler: token of sequence s at position p
    # Half the prompts share a prefix, so the prefix cache has something to give.
    shared = rng.integers(1, VOCAB, 9).tolist()
    for _ in range(12):
        prompt = (shared if rng.random() < 0.5 else []) + rng.integers(1, VOCAB, int(rng.integers(1, 14))).tolist()
        sched.add(prompt, _params(rng), max_len=64)
    inflight, tokens, steps = None, None, 0
    while sched.has_work() or inflight is not None:
        if inflight is None:
            inflight = sched.plan()
            tokens = inflight.token_ids
        following = sched.plan_continuation(inflight) if rng.random() < 0.7 else None
        sampled = table[inflight.seq_ids, inflight.kv_lens].astype(np.int32)
        mirror.run(sched, inflight, tokens, sampled)
        sched.update(inflight, sampled, EOS)
        if rng.random() < 0.05 and sched.running:  # a client goes away, perhaps with a continuation in flight
            sched.cancel(sched.running[int(rng.integers(0, len(sched.running)))])
        inflight, tokens = following, sampled
        steps += 1
        assert steps < 2000
    assert mirror.checked > 20 and sched.preemptions > 0, (mirror.checked, sched.preemptions)
    assert sorted(sched._free_slots) == list(range(max_seqs))  # every slot came back


def test_slots_are_held_while_running_and_freed_at_finish_cancel_and_preemption():
    sched = Scheduler(BlockAllocator(6), 4, max_tokens_per_step=64, max_seqs=3)
    a = sched.add([1, 2, 3, 4, 5], SamplingParams(max_new_tokens=20, ignore_eos=True, frequency_penalty=1.0), 64)
    b = sched.add([6, 7], SamplingParams(max_new_tokens=20, ignore_eos=True), 64)
    c = sched.add([8, 9, 10], SamplingParams(max_new_tokens=20, ignore_eos=True, repetition_penalty=1.2), 64)
    plan = sched.plan()
    assert (a.penalty_slot, b.penalty_slot, c.penalty_slot) == (0, -1, 1)
    np.testing.assert_array_equal(plan.penalties.slot, [0, -1, 1])
    np.testing.assert_array_equal(plan.penalties.start, [0, 0, 0])
    np.testing.assert_array_equal(plan.penalties.prompt_len, [5, 0, 3])
    np.testing.assert_array_equal(plan.penalties.recount_end, [5, 0, 3])
    np.testing.assert_allclose(plan.penalties.frequency, [1.0, 0.0, 0.0])
    np.testing.assert_allclose(plan.penalties.repetition, [1.0, 1.0, 1.2])
    assert plan.logit_bias is None
    sched.update(plan, np.array([11, 11, 11]), EOS)
    # Growing past 6 rBlocks preempts the youngest (c): its slot goes back, and at readmission it recounts the
    # tokens it had generated (recount_end covers them) from position 0.
    while c.status is not Status.WAITING:
        plan = sched.plan()
        sched.update(plan, np.full(plan.num_seqs, 11), EOS)
    assert c.penalty_slot == -1 and sorted(sched._free_slots) == [1, 2]
    sched.cancel(a)
    assert a.penalty_slot == -1 and sorted(sched._free_slots) == [0, 1, 2]
    plan = sched.plan()
    row = list(plan.seq_ids).index(c.seq_id)
    assert c.penalty_slot == 0 and plan.penalties.start[row] == 0
    assert plan.penalties.recount_end[row] == c.num_tokens > len(c.prompt_ids)
    sched.finish(c, "stop")
    sched.finish(b, "stop")
    assert sorted(sched._free_slots) == [0, 1, 2] and not sched.has_work()


def test_logit_bias_rows_are_padded_to_the_widest_and_need_no_slot():
    sched = Scheduler(BlockAllocator(16), 4, max_tokens_per_step=64, max_seqs=3)
    sched.add([1, 2], SamplingParams(logit_bias={5: 1.5, 2: -3.0}), 64)
    sched.add([3], SamplingParams(), 64)
    sched.add([4, 5, 6], SamplingParams(logit_bias={9: 100.0}), 64)
    plan = sched.plan()
    assert plan.penalties is None
    np.testing.assert_array_equal(plan.logit_bias.ids, [[2, 5], [-1, -1], [9, -1]])
    np.testing.assert_array_equal(plan.logit_bias.values, np.float32([[-3.0, 1.5], [0, 0], [100.0, 0]]))
    one = plan.rows(2, 3)
    np.testing.assert_array_equal(one.logit_bias.ids, [[9, -1]])
