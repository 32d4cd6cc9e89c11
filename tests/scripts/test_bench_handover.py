"""scripts/bench_handover.py's arithmetic on made-up worker results: a follower's figures cut to process 0's timed
window, the hand-over's share, the arms' medians (no process is started)."""

import pytest

from scripts import bench_handover


def _leader(decode_ms: float, send_cpu_ms: float = 0.0, messages=(10, 30)) -> dict:
    return dict(process=0, device_kind="cpu", steps=20, decode_steps=18, prefill_steps=2, decode_ms=decode_ms,
                decode_spread={}, prefill_ms=50.0, compiles_while_timed=0, messages=list(messages),
                host_cpu_ms_per_step={"engine": 1.0, "thread1": 0.5, "zmq_io": 0.1}, process_cpu_ms_per_step=4.0,
                wall_ms_per_step=5.0, send_ms_per_step=4 * send_cpu_ms, send_cpu_ms_per_step=send_cpu_ms)


def _follower() -> dict:
    # sample i after message i + 1: (arrival ns, loop CPU ns, wait ns, late ns, process CPU ns), 1 ms of loop CPU,
    # 2 ms of wait and 0.25 ms past the sends a message
    samples = [(i, i * 1_000_000, i * 2_000_000, i * 250_000, i * 3_000_000) for i in range(1, 41)]
    return dict(process=1, calls=40, samples=samples, zmq_io_ns=4_000_000)


def test_a_follower_is_cut_to_process_0s_window_and_the_share_named():
    row = bench_handover._arm_row([_leader(4.0, send_cpu_ms=0.1), _follower()])
    (f,) = row["followers"]
    # messages 11..30 of the window over its 20 steps
    assert f["host_ms_per_step"] == pytest.approx(1.0) and f["wait_ms_per_step"] == pytest.approx(2.0)
    assert f["late_ms_per_step"] == pytest.approx(0.25) and f["process_cpu_ms_per_step"] == pytest.approx(3.0)
    assert row["handover_ms_per_step"] == pytest.approx(0.35)
    assert row["handover_share"] == pytest.approx(0.35 / 4.0)
    assert row["handover_wall_share"] == pytest.approx((0.4 + 0.25) / 4.0)
    assert row["leader_host_ms_per_step"] == pytest.approx(1.6)


def test_a_follower_that_missed_steps_is_an_error():
    follower = _follower()
    follower["samples"] = follower["samples"][:25]
    with pytest.raises(RuntimeError, match="received 25 steps, process 0 sent 30"):
        bench_handover._arm_row([_leader(4.0), follower])


def test_the_summary_compares_the_arms_medians():
    one = [bench_handover._arm_row([_leader(ms)]) for ms in (3.0, 3.2, 5.0)]
    many = [bench_handover._arm_row([_leader(ms, 0.1), _follower()]) for ms in (3.6, 3.9, 4.0)]
    summary = bench_handover._summary({1: one, 2: many})
    assert summary["one_process_decode_ms"] == 3.2 and summary["processes_decode_ms"] == 3.9
    assert summary["decode_ratio"] == pytest.approx(3.9 / 3.2)
    assert summary["late_ms_per_step"] == pytest.approx(0.25)
