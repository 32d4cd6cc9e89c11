"""What the benchmarks that run each arm as processes of their own share (bench_handover.py, bench_end_to_end.py):
one arm run to its end, its output kept, a failure raised with the end of what it printed."""

from __future__ import annotations

import subprocess

__all__ = ["run_arm"]


def run_arm(cmd: list[str], env: dict, cwd: str, timeout_s: float, what: str) -> subprocess.CompletedProcess:
    """Run `cmd` (an arm: one process, or scripts/launch.py's several) with its stdout and stderr captured;
    RuntimeError naming `what` and the end of both where it exits non-zero."""
    proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return proc
