"""Suite-wide settings.

Mesh tests run in this process on CPU host devices: the device count must be set before jax is imported, so it is
set here, once for the whole run (8 host devices; a test that needs them skips where a GPU platform hides them:
tests/devices.py), with the suite's other XLA flags (tests/workers.py: compiled at -O0 on the CPU). Tests that need
several processes start them (tests/workers.py).

On a GPU, XLA's default float32 matmuls round like TF32 (~1e-3 relative), which the float64 oracle
comparisons (1e-5) would read as errors: there the suite runs its float32 matmuls at full precision.
The CPU (CI) already computes them exactly, so nothing changes there.

Most of the suite's time is XLA compiling: one persistent compilation cache serves the whole run, the xdist workers
and the processes tests start (they inherit $JAXLLM_COMPILE_CACHE), so a program that several tests build (the
same engine options) is compiled once. It is a fresh directory each run, removed at the end; set
$JAXLLM_COMPILE_CACHE to keep one across runs. Tests that count compiles count XLA compiles and cache reads apart
(jaxllm.tuner.compile_cache), and the tests of the cache itself use their own directories.
"""

import os
import shutil
import tempfile

from tests.workers import xla_flags  # imports no jax: the flags are set before jax is

HOST_DEVICES = 8
_flags = [f for f in xla_flags(HOST_DEVICES).split() if f not in os.environ.get("XLA_FLAGS", "").split()]
if _flags:
    os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *_flags]).strip()

import jax  # noqa: E402

from jaxllm.tuner.compile_cache import ENV_VAR, enable_persistent_cache  # noqa: E402

_RUN_CACHE = None  # the directory this process made for the run (the xdist controller's), removed at the end
if not os.environ.get(ENV_VAR):
    _RUN_CACHE = os.environ[ENV_VAR] = tempfile.mkdtemp(prefix="jaxllm-test-compile-cache-")
enable_persistent_cache(os.environ[ENV_VAR])


def pytest_unconfigure(config):
    if _RUN_CACHE is not None:
        shutil.rmtree(_RUN_CACHE, ignore_errors=True)


if any(device.platform == "gpu" for device in jax.devices()):
    jax.config.update("jax_default_matmul_precision", "highest")
