"""Run a test worker script in a fresh Python process and read the JSON line it prints last.

Mesh tests need a device count set before jax is imported, which a shared pytest process cannot do: each
runs its cases in one worker subprocess (the repository on PYTHONPATH, no inherited XLA_FLAGS: the worker
sets its own) and asserts on what it reports.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The suite's programs are tiny and compiled once or twice each: on the CPU, LLVM's optimizations were ~45% of every
# XLA compile, and the suite ran ~30% faster at -O0 (the same results: XLA's CPU code uses no fast-math either way).
# Eigen's thread pool off: the suite runs two workers on two cores (and processes tests start beside them), each
# with 8 host devices; with the pool on, a warm-up of 18 tiny programs took 18.7 s, without it 12.6 s (the same
# results: one thread computes what the pool's threads would).
# Not where a GPU is present (its XLA kernels would run slower for the GPU tests' timings and tolerances).
SUITE_XLA_FLAGS = () if os.path.exists("/dev/nvidiactl") else ("--xla_backend_optimization_level=0",
                                                                 "--xla_cpu_multi_thread_eigen=false")


def xla_flags(host_devices: int | None = None) -> str:
    """XLA_FLAGS for a process of the suite: its flags, and `host_devices` CPU devices where given."""
    devices = () if host_devices is None else (f"--xla_force_host_platform_device_count={host_devices}",)
    return " ".join(SUITE_XLA_FLAGS + devices)


def repository_env(**extra: str) -> dict:
    """The environment for a subprocess of the repository's code: this one with the repository on PYTHONPATH, the
    suite's XLA_FLAGS instead of this process's (no device count: the subprocess or the test sets its own) and no
    inherited JAXLLM_COORDINATOR_TIMEOUT, then `extra`."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env["XLA_FLAGS"] = xla_flags()
    env.pop("JAXLLM_COORDINATOR_TIMEOUT", None)
    env.update(extra)
    return env


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_json_worker(script: str, *args: str, timeout: int = 900, env: dict | None = None) -> dict:
    """`script` (relative to the repository root) run with args (in `env`, default repository_env()); the dict its
    last stdout line holds."""
    proc = subprocess.run([sys.executable, str(ROOT / script), *args], env=env or repository_env(), cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
