"""The CPU host devices conftest.py asks for, for the mesh tests that run in the test process."""

import jax
import pytest

HOST_DEVICES = 8

needs_host_devices = pytest.mark.skipif(jax.device_count() < HOST_DEVICES,
                                        reason=f"needs {HOST_DEVICES} CPU host devices (a GPU platform hides them)")
