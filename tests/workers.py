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


def repository_env(**extra: str) -> dict:
    """The environment for a subprocess of the repository's code: this one with the repository on PYTHONPATH and
    no inherited XLA_FLAGS or JAXLLM_COORDINATOR_TIMEOUT (the subprocess or the test sets its own), then `extra`."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.pop("XLA_FLAGS", None)
    env.pop("JAXLLM_COORDINATOR_TIMEOUT", None)
    env.update(extra)
    return env


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_json_worker(script: str, *args: str, timeout: int = 900) -> dict:
    """`script` (relative to the repository root) run with args; the dict its last stdout line holds."""
    proc = subprocess.run([sys.executable, str(ROOT / script), *args], env=repository_env(), cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
