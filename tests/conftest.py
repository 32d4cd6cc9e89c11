"""Suite-wide settings.

Mesh tests run in this process on CPU host devices: the device count must be set before jax is imported,
so it is set here, once for the whole run (8 host devices; a test that needs them skips where a GPU
platform hides them: tests/devices.py). Tests that need several processes start them (tests/workers.py).

On a GPU, XLA's default float32 matmuls round like TF32 (~1e-3 relative), which the float64 oracle
comparisons (1e-5) would read as errors: there the suite runs its float32 matmuls at full precision.
The CPU (CI) already computes them exactly, so nothing changes there.
"""

import os

HOST_DEVICES = 8
_flag = f"--xla_force_host_platform_device_count={HOST_DEVICES}"
if _flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_flag}".strip()

import jax  # noqa: E402

if any(device.platform == "gpu" for device in jax.devices()):
    jax.config.update("jax_default_matmul_precision", "highest")
