"""multihost.initialize's argument checks and the single-process path (no coordinator is started)."""

import numpy as np
import pytest

from sharding import multihost


def test_single_process_needs_nothing(monkeypatch):
    for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        monkeypatch.delenv(name, raising=False)
    assert multihost.initialize() is False
    assert multihost.initialize(num_processes=1) is False


@pytest.mark.parametrize("kwargs, message", [
    (dict(coordinator="127.0.0.1:1234"), "needs a coordinator"),
    (dict(coordinator="localhost", num_processes=2, process_id=0), "is not HOST:PORT"),
    (dict(coordinator="127.0.0.1:1", num_processes=2, process_id=2), r"process_id 2 is outside \[0, 2\)"),
])
def test_initialize_errors(monkeypatch, kwargs, message):
    for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match=message):
        multihost.initialize(**kwargs)


def test_environment_is_read(monkeypatch):
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "127.0.0.1:5")
    monkeypatch.setenv("JAX_NUM_PROCESSES", "two")
    with pytest.raises(ValueError, match="JAX_NUM_PROCESSES='two' is not an integer"):
        multihost.initialize()


def test_single_process_broadcast_roles():
    b = multihost.StepBroadcast()
    b.send({"tokens": np.arange(3, dtype=np.int32)})  # one process: nothing to hand over, nothing fails
    with pytest.raises(ValueError, match="other than 0"):
        b.receive()
    with pytest.raises(ValueError, match="64-bit leaves"):
        b.send({"tokens": np.arange(3, dtype=np.int64)})
