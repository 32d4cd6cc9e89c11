"""Two processes x two CPU devices: the step channel and a sharded matmul, started by scripts/launch.py and as
Open MPI's mpirun would start them (its environment, read by jax's cluster detection)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.workers import free_port, repository_env, xla_flags

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.xdist_group("sharding_multihost")
def test_two_processes_step_channel_and_matmul():
    # launch.py sets each process's device count (repository_env: the suite's other XLA flags)
    proc = subprocess.run([sys.executable, str(ROOT / "scripts/launch.py"), "--num-processes", "2", "--cpu-devices", "2",
                           "--timeout", "240", "--", sys.executable, str(ROOT / "tests/sharding/multihost_worker.py")],
                          env=repository_env(), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "[0] worker 0 of 2 ok" in proc.stdout and "[1] worker 1 of 2 ok" in proc.stdout, proc.stdout[-4000:]


@pytest.mark.slow
@pytest.mark.xdist_group("sharding_multihost")
def test_two_processes_started_as_mpirun_starts_them():
    """No flags and no JAX_* variables: each process has only what Open MPI's mpirun puts in its environment (its
    rank, the job's size, the launcher's URI, from which jax derives the coordinator's host; the port through
    JAX_COORDINATOR_PORT, as a user sets it to avoid the one jax derives from the job id), and joins as that
    rank."""
    port = free_port()
    procs = []
    for rank in (1, 0):  # ranks come up in any order
        env = repository_env(JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(2), JAX_COORDINATOR_PORT=str(port),
                             OMPI_MCA_orte_hnp_uri="2961768448.0;tcp://127.0.0.1:41234", OMPI_COMM_WORLD_SIZE="2",
                             OMPI_COMM_WORLD_RANK=str(rank), OMPI_COMM_WORLD_LOCAL_RANK=str(rank))
        for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
            env.pop(name, None)
        procs.append(subprocess.Popen([sys.executable, str(ROOT / "tests/sharding/multihost_worker.py")], env=env,
                                      cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        for rank, proc in zip((1, 0), procs):
            out, err = proc.communicate(timeout=240)
            assert proc.returncode == 0, err[-4000:]
            assert out.strip().splitlines()[-1] == f"worker {rank} of 2 ok", out + err[-2000:]
            assert f"waiting for the coordinator at 127.0.0.1:{port} (process {rank} of 2, started by Open MPI)" \
                in err, err[-2000:]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_launch_reports_a_failed_process():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts/launch.py"), "--num-processes", "2", "--no-flags", "--",
                           sys.executable, "-c", "import os, sys, time; "
                           "sys.exit(3) if os.environ['JAX_PROCESS_ID'] == '1' else time.sleep(60)"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3, proc.stdout + proc.stderr
