"""Run a test worker script in a fresh Python process and read the JSON line it prints last.

Mesh tests need a device count set before jax is imported, which a shared pytest process cannot do: each
runs its cases in one worker subprocess (the repository on PYTHONPATH, no inherited XLA_FLAGS: the worker
sets its own) and asserts on what it reports.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_json_worker(script: str, *args: str, timeout: int = 900) -> dict:
    """`script` (relative to the repository root) run with args; the dict its last stdout line holds."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, str(ROOT / script), *args], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
