"""The GPU's clock and power state while a benchmark times something, sampled by nvidia-smi.

Why: an H200 running a tensor-core-heavy kernel back to back sits at its 700 W power cap and lowers
its SM clock (session 7: the Mosaic prefill kernel at 1.6-1.74 GHz, the Triton one at 1.74-1.92 GHz,
both capped), so a sustained timing measures energy per call as much as speed. Benchmarks record,
for each implementation's timed batches, the median SM clock and power and the share of samples
with the software power cap active, beside its time.

    sampler = GpuSampler.start()          # None where there is no nvidia-smi (CPU machines)
    t0 = time.time(); ...; t1 = time.time()
    sampler.summary([(t0, t1)])           # {"sm_mhz": ..., "power_w": ..., "power_capped": ..., ...}
"""

from __future__ import annotations

import atexit
import datetime
import shutil
import subprocess
import threading
import time

import numpy as np

# nvidia-smi's clocks_event_reasons bit for the software power cap (NVML's SwPowerCap).
_SW_POWER_CAP = 0x4
# power.draw is a one-second average on recent drivers, which smears one implementation's power over the
# next one's batches; power.draw.instant (drivers >= 530) is the sample itself.
_POWER_FIELDS = ("power.draw.instant", "power.draw")


def _fields(power: str) -> str:
    return f"timestamp,clocks.sm,{power},clocks_event_reasons.active"


def _power_field(exe: str) -> str | None:
    """The first power field this nvidia-smi accepts, or None if it answers none of them."""
    for power in _POWER_FIELDS:
        try:
            done = subprocess.run([exe, "-i", "0", f"--query-gpu={_fields(power)}", "--format=csv,noheader,nounits"],
                                  capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.TimeoutExpired):
            return None
        lines = done.stdout.splitlines()
        if done.returncode == 0 and lines and _parse(lines[0]) is not None:
            return power
    return None


class GpuSampler:
    """nvidia-smi sampling GPU 0 every interval_ms in a background process, read by a thread."""

    def __init__(self, proc: subprocess.Popen, power_field: str = "power.draw.instant"):
        self._proc = proc
        self.power_field = power_field
        self._samples: list[tuple[float, float, float, int]] = []  # (unix time, MHz, W, reasons)
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    @classmethod
    def start(cls, interval_ms: int = 100) -> GpuSampler | None:
        exe = shutil.which("nvidia-smi")
        power = _power_field(exe) if exe is not None else None
        if power is None:
            return None
        try:
            proc = subprocess.Popen([exe, "-i", "0", f"--query-gpu={_fields(power)}", "--format=csv,noheader,nounits",
                                     "-lms", str(interval_ms)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                    text=True, bufsize=1)
        except OSError:
            return None
        sampler = cls(proc, power)
        atexit.register(sampler.stop)  # nvidia-smi -lms never ends by itself
        return sampler

    def _read(self) -> None:
        for line in self._proc.stdout:
            sample = _parse(line)
            if sample is not None:
                with self._lock:
                    self._samples.append(sample)

    def summary(self, windows: list[tuple[float, float]]) -> dict | None:
        """Median SM clock (MHz) and power (W), and the share of samples power-capped, over the samples
        that fall inside any of the (start, end) unix-time windows; None when none do."""
        end = max((b for _, b in windows), default=0.0)
        deadline = time.time() + 2.0  # nvidia-smi may still hold the last lines in its pipe buffer
        while time.time() < deadline and self._proc.poll() is None:
            with self._lock:
                if self._samples and self._samples[-1][0] >= end:
                    break
            time.sleep(0.05)
        with self._lock:
            inside = [s for s in self._samples if any(a <= s[0] <= b for a, b in windows)]
        if not inside:
            return None
        mhz, watts, reasons = (np.array([s[i] for s in inside]) for i in (1, 2, 3))
        return dict(sm_mhz=int(np.median(mhz)), power_w=round(float(np.median(watts)), 1),
                    power_capped=round(float(np.mean((reasons.astype(np.int64) & _SW_POWER_CAP) != 0)), 2),
                    samples=len(inside), power_field=self.power_field)

    def stop(self) -> None:
        if self._proc.poll() is not None:
            return
        self._proc.terminate()
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()


def _parse(line: str) -> tuple[float, float, float, int] | None:
    """One `timestamp, MHz, W, 0x..` line (local time, as nvidia-smi prints it), or None if malformed."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != 4:
        return None
    try:
        stamp = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
        return stamp, float(parts[1]), float(parts[2]), int(parts[3], 16)
    except ValueError:  # "[N/A]" fields, a header
        return None
