"""scripts/bench_mesh.py --dry-run on 8 CPU host devices with the tiny model: the multi-GPU run's script
(longest sequence spread by lending, tensor parallel decode, instances under skew with lending on and off, the
decode step of 8 instances against one) works end to end and reports what it measured."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.workers import repository_env, xla_flags

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("bench_mesh")]

ROOT = Path(__file__).resolve().parents[2]


def test_bench_mesh_dry_run_on_8_host_devices(tmp_path):
    env = repository_env(XLA_FLAGS=xla_flags(8))
    proc = subprocess.run([sys.executable, str(ROOT / "scripts/bench_mesh.py"), "--dry-run", "--out", str(tmp_path)],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (path,) = tmp_path.glob("*mesh-x8-dry-run.json")
    r = json.loads(path.read_text())
    assert r["devices"] == 8 and r["dry_run"]
    longest = r["longest"]
    # One sequence as long as all 8 instances' pools together, prefilled and decoded by borrowing.
    assert longest["ratio_to_one_pool"] == 8.0 and longest["rblocks_lent"] > 0 and longest["preemptions"] == 0
    assert longest["generated"] == 4 and longest["decode_ms_per_token"] > 0
    tensor = r["tensor"]
    assert tensor["tensor_parallel"] == 4 and tensor["rows"][0]["decode_ms_per_token"] > 0
    mixed = tensor["mixed"]  # the mixed load, on the main row's engine, timed after its untimed pass
    assert mixed["requests"] == 2 and mixed["generated"] == 2 * mixed["new_tokens"] and mixed["tokens_per_s"] > 0
    assert mixed["compiles_timed"] == 0, mixed
    assert [row["tensor_parallel"] for row in tensor["sweep"]] == [1, 2]  # TP 4: the main row
    assert all(row["rows"][0]["decode_ms_per_token"] > 0 for row in tensor["sweep"])
    skew = r["skew"]
    assert skew["on"]["preemptions"] == 0 and skew["on"]["rblocks_lent"] > 0
    assert skew["off"]["preemptions"] > 0 and skew["off"]["rblocks_lent"] == 0
    assert skew["on"]["generated"] == skew["off"]["generated"]
    one, eight = r["step"]["rows"]
    assert (one["instances"], eight["instances"]) == (1, 8) and eight["sequences"] == 8 * one["sequences"]
    assert eight["dist_steps"] == 0 and eight["decode_ms_per_step"] > 0 and eight["ratio_to_one_instance"] > 0
