"""Two processes x two CPU devices through scripts/launch.py: the step-input broadcast and a sharded matmul."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.workers import repository_env

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.xdist_group("sharding_multihost")
def test_two_processes_broadcast_and_matmul():
    # launch.py sets each process's device count (repository_env: the suite's other XLA flags)
    proc = subprocess.run([sys.executable, str(ROOT / "scripts/launch.py"), "--num-processes", "2", "--cpu-devices", "2",
                           "--timeout", "240", "--", sys.executable, str(ROOT / "tests/sharding/multihost_worker.py")],
                          env=repository_env(), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "[0] worker 0 ok" in proc.stdout and "[1] worker 1 ok" in proc.stdout, proc.stdout[-4000:]


def test_launch_reports_a_failed_process():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts/launch.py"), "--num-processes", "2", "--no-flags", "--",
                           sys.executable, "-c", "import os, sys, time; "
                           "sys.exit(3) if os.environ['JAX_PROCESS_ID'] == '1' else time.sleep(60)"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3, proc.stdout + proc.stderr
