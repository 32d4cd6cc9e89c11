"""Context-parallel prefill's scheduling (jaxllm.engine.spread), without devices: the pieces of a spread step, the
striped placement (never recalled), the rule for several long prompts, alternation with other work, the reports."""

import numpy as np
import pytest

from jaxllm.contract import SamplingParams, StepKind
from jaxllm.engine.instances import InstanceSchedulers
from jaxllm.engine.spread import piece_sizes

BLOCK, POOL, CHUNK = 16, 8, 32


def _instances(n: int = 4, **options) -> InstanceSchedulers:
    return InstanceSchedulers(n, POOL, BLOCK, max_tokens_per_step=CHUNK, max_seqs=4, **options)


def _add(s: InstanceSchedulers, tokens: int, new: int = 2):
    return s.add(list(range(3, 3 + tokens)), SamplingParams(max_new_tokens=new), max_len=tokens + new + 1)


def _step(s: InstanceSchedulers):
    plan = s.plan()
    s.update(plan, np.full(plan.num_seqs, 5), eos_id=2)
    return plan


def test_piece_sizes_split_a_step_evenly_and_refuse_what_does_not_fit():
    assert piece_sizes(128, 4, 32) == [32] * 4
    assert piece_sizes(66, 4, 32) == [17, 17, 16, 16]
    assert piece_sizes(3, 4, 32) == [1, 1, 1]
    with pytest.raises(ValueError, match="1 .. 4 x 32 tokens, got 129"):
        piece_sizes(129, 4, 32)


def test_a_long_prompt_runs_one_piece_an_instance_on_striped_rblocks_and_reports_its_share():
    s = _instances()
    seq = _add(s, 448)  # 3.5 pools, 14 chunks
    plans = [_step(s) for _ in range(4)]
    for plan in plans:
        assert plan.kind is StepKind.PREFILL and list(plan.instances) == [0, 1, 2, 3]
        assert set(plan.seq_ids.tolist()) == {seq.seq_id} and np.all(np.diff(plan.positions) == 1)
    assert [bool(p.sample[-1]) for p in plans] == [False, False, False, True] and not plans[-1].sample[:-1].any()
    assert seq.num_computed == 448 and len(seq.output_ids) == 1
    table = s.schedulers[0].allocator.blocks(seq.seq_id)
    assert [b // POOL for b in table] == [e % 4 for e in range(len(table))]  # striped
    assert not s.gmanager.plan_recalls().moves  # placed on purpose: never recalled home
    report = s.prefill_reports.finished[-1]
    assert report.spread and report.steps == 4 and report.matmul_tokens == (112,) * 4
    assert sum(report.attention) == 448 * 449 // 2 and report.attention_balance <= 1.15
    while s.has_work():
        _step(s)
    assert s.gmanager.loans() == () and sum(a.rmanager.num_free for a in s.allocators) == 4 * POOL


def test_spreading_off_prefills_chunk_by_chunk_on_the_home():
    s = _instances(spread_prompts=False)
    _add(s, 448)
    while s.has_work():
        _step(s)
    report = s.prefill_reports.finished[-1]
    assert not report.spread and report.steps == 14 and report.matmul_tokens == (448, 0, 0, 0)


def test_as_many_long_prompts_as_instances_are_not_spread():
    s = _instances(2)
    a, b = _add(s, 100), _add(s, 100)
    plan = _step(s)
    assert sorted(plan.seq_ids.tolist()) == sorted([a.seq_id, b.seq_id])  # one row each, on its own home
    assert s.spread.seq is None


def test_fewer_long_prompts_than_instances_spread_the_oldest_and_alternate_with_other_work():
    s = _instances()
    long_a, long_b, short = _add(s, 200), _add(s, 200), _add(s, 10, new=20)
    first = _step(s)
    assert set(first.seq_ids.tolist()) == {long_a.seq_id} and len(first) == 4  # the oldest, spread
    second = _step(s)
    assert long_a.seq_id not in second.seq_ids and {long_b.seq_id, short.seq_id} <= set(second.seq_ids.tolist())
    third = _step(s)
    assert set(third.seq_ids.tolist()) == {long_a.seq_id}
    while s.has_work():
        _step(s)
    reports = {r.seq_id: r for r in s.prefill_reports.finished}
    assert reports[long_a.seq_id].spread and not reports[short.seq_id].spread
