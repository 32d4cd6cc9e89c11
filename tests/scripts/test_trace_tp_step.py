"""scripts/trace_tp_step.py --dry-run on 4 CPU host devices with the tiny model: one engine per tensor-parallel
size (here 2) serves every context asked for, and each row reports its step times, the step's collectives and what
the host threads did."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.workers import repository_env, xla_flags

pytestmark = [pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def test_trace_tp_step_dry_run_rows_per_context(tmp_path):
    env = repository_env(XLA_FLAGS=xla_flags(4))
    proc = subprocess.run([sys.executable, str(ROOT / "scripts/trace_tp_step.py"), "--dry-run", "--tp-sizes", "2",
                           "--contexts", "40", "150", "--reps", "2", "--out", str(tmp_path)],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (path,) = tmp_path.glob("*trace-tp-dry-run.json")
    r = json.loads(path.read_text())
    assert [(row["tensor_parallel"], row["context"]) for row in r["rows"]] == [(2, 40), (2, 150)]
    assert all(row["engine_ms"] > 0 and row["bare_ms"] > 0 for row in r["rows"])
    # The step all-reduces (two a layer) and reshards nothing.
    assert all(row["hlo"]["by_kind"].get("all-reduce", 0) >= 2 and row["hlo"]["resharding"] == 0 for row in r["rows"])
    assert r["xla_flags"] == xla_flags(4)  # no tensor-parallel XLA flags on a CPU machine
    # What the host threads did: XLA's runtime events (the CPU client executes the step's thunks), no Python calls.
    for row in r["rows"]:
        names = [e["name"] for e in row["host"]["events"]]
        assert row["host"]["threads_us_per_step"] and any("Execute" in n for n in names), row["host"]
        assert not any(n.startswith("$") for n in names), names  # the Python tracer's events start with $
