"""multihost.initialize's argument checks, the single-process path and the launchers' environments read by jax's
cluster detection (no coordinator is started)."""

import sys

import pytest

from sharding import multihost, step_channel

_JAX_VARIABLES = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "JAX_COORDINATOR_PORT",
                  "JAX_LOCAL_DEVICE_IDS")
# What jax's detection reads (jax._src.clusters): Open MPI's mpirun, SLURM's srun.
_OMPI = ("OMPI_MCA_orte_hnp_uri", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK")
_SLURM = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")


@pytest.fixture
def no_run(monkeypatch):
    """An environment that names no run: none of the JAX_* variables, no launcher's."""
    for name in _JAX_VARIABLES + _OMPI + _SLURM + ("SLURM_STEP_NUM_NODES",):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_single_process_needs_nothing(no_run):
    assert multihost.launcher_run() is None
    assert multihost.initialize() is False
    assert multihost.initialize(num_processes=1) is False


@pytest.mark.parametrize("kwargs, message", [
    (dict(coordinator="127.0.0.1:1234"), "needs a coordinator"),
    (dict(coordinator="localhost", num_processes=2, process_id=0), "is not HOST:PORT"),
    (dict(coordinator="127.0.0.1:1", num_processes=2, process_id=2), r"process_id 2 is outside \[0, 2\)"),
])
def test_initialize_errors(no_run, kwargs, message):
    with pytest.raises(ValueError, match=message):
        multihost.initialize(**kwargs)


def test_environment_is_read(monkeypatch):
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "127.0.0.1:5")
    monkeypatch.setenv("JAX_NUM_PROCESSES", "two")
    with pytest.raises(ValueError, match="JAX_NUM_PROCESSES='two' is not an integer"):
        multihost.initialize()


def test_one_process_has_no_step_channel(no_run):
    assert multihost.step_channel() is None


def test_open_mpi_environment_names_the_run(no_run):
    """mpirun's variables, read by jax's own detection: the job's size and this rank, the coordinator on the
    launcher's host at the port jax derives from the job id (or JAX_COORDINATOR_PORT), the device of the local
    rank."""
    no_run.setenv("OMPI_MCA_orte_hnp_uri", "2961768448.0;tcp://10.1.2.3,172.17.0.1:41234")
    no_run.setenv("OMPI_COMM_WORLD_SIZE", "4")
    no_run.setenv("OMPI_COMM_WORLD_RANK", "3")
    no_run.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "1")
    run = multihost.launcher_run()
    port = 2961768448 // 2**12 % 2**12 + 65535 - 2**12 + 1
    assert run == multihost.LauncherRun("Open MPI", f"10.1.2.3:{port}", 4, 3, [1])
    no_run.setenv("JAX_COORDINATOR_PORT", "5555")
    assert multihost.launcher_run().coordinator == "10.1.2.3:5555"
    # What the caller gives wins over the launcher's (as in jax.distributed.initialize).
    assert multihost.launcher_run("h:1", 4, 2, [0, 1]) == multihost.LauncherRun("Open MPI", "h:1", 4, 2, [0, 1])


def test_slurm_environment_names_the_run(no_run):
    for name, value in (("SLURM_JOB_ID", "4242"), ("SLURM_STEP_NODELIST", "gpu[007-008],big1"),
                        ("SLURM_NTASKS", "16"), ("SLURM_PROCID", "9"), ("SLURM_LOCALID", "1")):
        no_run.setenv(name, value)
    port = 4242 % 2**12 + 65535 - 2**12 + 1
    assert multihost.launcher_run() == multihost.LauncherRun("SLURM", f"gpu007:{port}", 16, 9, [1])


def test_a_launchers_single_task_is_one_process(no_run):
    """`srun -n 1`: nothing to join (no coordinator is started)."""
    for name, value in (("SLURM_JOB_ID", "7"), ("SLURM_STEP_NODELIST", "node1"), ("SLURM_NTASKS", "1"),
                        ("SLURM_PROCID", "0"), ("SLURM_LOCALID", "0")):
        no_run.setenv(name, value)
    assert multihost.initialize() is False


def test_a_missing_pyzmq_is_named(no_run):
    no_run.setitem(sys.modules, "zmq", None)  # import zmq now raises ImportError
    with pytest.raises(ValueError, match="pyzmq package is not installed here: pip install pyzmq"):
        step_channel.require_zmq()
    with pytest.raises(ValueError, match="pip install pyzmq"):  # said before joining anything
        multihost.initialize("127.0.0.1:1", 2, 1)


def test_an_mpirun_run_jax_cannot_read_is_no_silent_single_process(no_run):
    """Open MPI 5's mpirun sets the ranks but not the URI jax reads: every rank would serve alone."""
    no_run.setenv("OMPI_COMM_WORLD_SIZE", "2")
    no_run.setenv("OMPI_COMM_WORLD_RANK", "1")
    assert multihost.launcher_run() is None
    with pytest.raises(ValueError, match="mpirun started 2 processes .*JAX_COORDINATOR_ADDRESS"):
        multihost.initialize()
