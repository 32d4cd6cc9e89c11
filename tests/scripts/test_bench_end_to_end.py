"""scripts/bench_end_to_end.py's arithmetic on made-up probe sums and worker results (no process is started)."""

import pytest

from scripts import bench_end_to_end as bench


def test_leader_parts_take_the_nested_sums_apart():
    seconds = dict(core_step=0.9, scheduler=0.1, dispatch=0.3, layout=0.05, send=0.02, wait_tokens=0.4, launch=0.5,
                   results_read=0.1)
    parts = bench.leader_parts(seconds, wall_s=1.0, tokens=100)
    assert parts["scheduler"] == pytest.approx(1.0) and parts["layout"] == pytest.approx(0.5)
    assert parts["dispatch_rest"] == pytest.approx(2.3)  # dispatch less its layout and send
    assert parts["output"] == pytest.approx(1.0)  # core_step less scheduler, dispatch and the wait
    assert parts["outside_step"] == pytest.approx(1.0)
    assert sum(parts[k] for k in bench.LEADER_PARTS) == pytest.approx(10.0)  # the whole call, ms a token
    assert parts["launch"] == pytest.approx(5.0) and parts["results_read"] == pytest.approx(1.0)


def test_a_follower_is_cut_to_process_0s_window():
    samples = [(t, {"receive": 0.001 * t, "launch": 0.002 * t}) for t in range(0, 100, 10)]
    parts = bench.follower_parts(samples, [25, 65], tokens=4)
    # from the sample at 20 (the last before the window) to the one at 60 (the last inside it)
    assert parts["receive"] == pytest.approx(1e3 * 0.04 / 4) and parts["launch"] == pytest.approx(1e3 * 0.08 / 4)
    assert parts["place"] == 0.0


def _arm(ms_list, step_ms, tokens=((1, 2),)):
    calls = [dict(ms_per_token=ms, parts={"scheduler": ms / 10}, followers=[]) for ms in ms_list]
    return dict(processes=1, calls=calls, step_ms=step_ms, tokens=[list(t) for t in tokens], compiles_while_timed=0,
                second_call_unwarmed=dict(ms_per_token=20.0, compiles=2))


def test_the_summary_compares_best_and_median_of_every_timed_call():
    summary = bench.generate_summary({1: [_arm([2.0, 3.0], 1.0), _arm([4.0], 1.2)], 2: [_arm([2.2, 5.0], 1.1)]})
    assert summary["one_process_best_ms"] == 2.0 and summary["one_process_median_ms"] == 3.0
    assert summary["best_ratio"] == pytest.approx(1.1) and summary["median_ratio"] == pytest.approx(3.6 / 3.0)
    assert summary["one_process_token_over_step"] == pytest.approx(3.0 / 1.1)
    assert summary["same_tokens"] and summary["unwarmed_compiles"] == 2


def test_different_greedy_tokens_are_reported():
    summary = bench.generate_summary({1: [_arm([2.0], 1.0)], 2: [_arm([2.0], 1.0, tokens=((1, 3),))]})
    assert not summary["same_tokens"]


def test_stream_timings_and_serve_ratios():
    # a role chunk before any token, then tokens 1, 2 and 4 (two in one chunk)
    assert bench.stream_timings(1.0, [(1.2, 0), (1.5, 1), (1.7, 2), (2.1, 4)]) == pytest.approx((0.5, 0.2))
    assert bench.stream_timings(1.0, [(1.5, 1)]) == (pytest.approx(0.5), None)
    one = [dict(ttft_s=0.10, tpot_s=0.002, chunks=3)]
    two = [dict(ttft_s=0.12, tpot_s=0.003, chunks=3)]
    summary = bench.serve_summary({1: [bench.serve_figures([one])], 2: [bench.serve_figures([two])]})
    assert summary["ttft_ms_best_ratio"] == pytest.approx(1.2) and summary["tpot_ms_median_ratio"] == pytest.approx(1.5)


def test_the_dry_run_goes_through_the_whole_arithmetic(capsys):
    assert bench.main(["--dry-run"]) == 0
    assert "ms a token by part" in capsys.readouterr().out
