"""The benchmarks' clock/power sampler (scripts/common/gpu_state.py) on canned nvidia-smi output."""

import datetime
import io

from scripts.common.gpu_state import GpuSampler, _parse


class _FakeProcess:
    def __init__(self, text: str):
        self.stdout = io.StringIO(text)

    def poll(self):
        return None  # still running, as nvidia-smi -lms would be

    def terminate(self):
        pass

    def wait(self, timeout=None):
        return 0


def _stamp(seconds: float) -> str:
    t = datetime.datetime(2026, 11, 24, 7, 52, 0) + datetime.timedelta(seconds=seconds)
    return t.strftime("%Y/%m/%d %H:%M:%S.%f")[:-3]


def _unix(seconds: float) -> float:
    return (datetime.datetime(2026, 11, 24, 7, 52, 0) + datetime.timedelta(seconds=seconds)).timestamp()


def test_parse_reads_nvidia_smi_lines_and_rejects_others():
    assert _parse(f"{_stamp(1.5)}, 1635, 698.52, 0x0000000000000004") == (_unix(1.5), 1635.0, 698.52, 4)
    assert _parse("timestamp, clocks.current.sm [MHz], power.draw [W], clocks_event_reasons.active") is None
    assert _parse(f"{_stamp(0)}, [N/A], 100.0, 0x0") is None
    assert _parse("garbage") is None


def test_summary_keeps_only_samples_inside_the_windows():
    # Idle before, capped at 1,700 MHz inside the first window, uncapped at 1,900 inside the second,
    # idle between and after: the summary sees the six samples inside the windows only.
    rows = [(0.0, 1980, 100.0, 0x0), (0.1, 1980, 110.0, 0x0),
            (1.0, 1700, 690.0, 0x4), (1.1, 1710, 695.0, 0x4), (1.2, 1690, 700.0, 0x4), (1.3, 1700, 692.0, 0x4),
            (2.0, 1980, 150.0, 0x0),
            (3.0, 1900, 600.0, 0x0), (3.1, 1900, 610.0, 0x1),
            (9.0, 1980, 90.0, 0x0)]
    text = "".join(f"{_stamp(t)}, {mhz}, {w}, {reasons:#018x}\n" for t, mhz, w, reasons in rows)
    sampler = GpuSampler(_FakeProcess(text))
    sampler._thread.join(timeout=5)
    got = sampler.summary([(_unix(0.95), _unix(1.35)), (_unix(2.95), _unix(3.15))])
    assert got == dict(sm_mhz=1705, power_w=691.0, power_capped=round(4 / 6, 2), samples=6,
                      power_field="power.draw.instant")
    assert sampler.summary([(_unix(5.0), _unix(6.0))]) is None
    sampler.stop()


def test_start_without_nvidia_smi_gives_none(monkeypatch):
    from scripts.common import gpu_state

    monkeypatch.setattr(gpu_state.shutil, "which", lambda name: None)
    assert GpuSampler.start() is None
