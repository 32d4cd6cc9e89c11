"""The stats tree's plumbing: parts add up, counters since a snapshot, a producer's zeroed counters, and the checks
on what leaves declare (serve's tests/serve/test_metrics.py checks the tree against /metrics)."""

import dataclasses

import pytest

from jaxllm.contract import CoreStats, EngineStats, HostTierStats, LendingStats, SchedulerStats, stats


def test_parts_add_leaf_by_leaf_nested_parts_included():
    a = SchedulerStats(waiting=1, pool_blocks=10, host=HostTierStats(blocks=4, swap_outs_total=2),
                       lending=LendingStats(borrowed_by_instance=(1,)))
    b = SchedulerStats(waiting=2, pool_blocks=6, host=HostTierStats(blocks=4, swap_outs_total=1),
                       lending=LendingStats(borrowed_by_instance=(0,)))
    total = sum((a, b), SchedulerStats())
    assert (total.waiting, total.pool_blocks, total.host.blocks, total.host.swap_outs_total) == (3, 16, 8, 3)
    assert total.lending.borrowed_by_instance == (1, 0)


def test_since_subtracts_counters_and_keeps_gauges():
    before = EngineStats(core=CoreStats(steps_total=5), scheduler=SchedulerStats(waiting=3, preemptions=2))
    now = EngineStats(core=CoreStats(steps_total=9, ttft_sum_s=1.5),
                      scheduler=SchedulerStats(waiting=1, preemptions=6, host=HostTierStats(swap_ins_total=4)))
    delta = stats.since(now, before)
    assert (delta.core.steps_total, delta.core.ttft_sum_s, delta.scheduler.preemptions) == (4, 1.5, 4)
    assert delta.scheduler.waiting == 1 and delta.scheduler.host.swap_ins_total == 4


def test_counters_are_a_parts_counter_leaves_at_zero():
    assert stats.counters(HostTierStats) == {f.name: 0 for f in dataclasses.fields(HostTierStats)
                                             if f.name.endswith("_total")}
    assert stats.counters(CoreStats)["ttft_sum_s"] == 0.0 and isinstance(stats.counters(CoreStats)["ttft_sum_s"],
                                                                        float)


def test_two_leaves_declaring_one_metric_differently_or_twice_are_refused():
    @dataclasses.dataclass(frozen=True)
    class Clash:
        a: int = stats.counter("jaxllm_x_total", "one help")
        b: int = stats.counter("jaxllm_x_total", "another help")

    @dataclasses.dataclass(frozen=True)
    class Twice:
        a: int = stats.counter("jaxllm_x_total", "help")
        b: int = stats.counter("jaxllm_x_total", "help")

    with pytest.raises(ValueError, match="declared twice, differently"):
        stats.exports(Clash)
    with pytest.raises(ValueError, match="clashing sources"):
        stats.exports(Twice)


def test_a_metric_names_every_label():
    with pytest.raises(ValueError, match="takes labels"):
        stats.KV_TIER_BLOCKS.at(direction="out")
    with pytest.raises(ValueError, match="kind must be one of"):
        stats.Metric("jaxllm_x", "histogram", "help")
