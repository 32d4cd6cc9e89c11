"""scripts/bench_host_tier.py --smoke on the CPU with the tiny model: the GPU run's script (copy rates against
the link, the multi-turn and preemption workloads with the host tier on and off, compiles after warm-up) works end
to end and reports what it measured."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("bench_host_tier")]

ROOT = Path(__file__).resolve().parents[2]


def test_bench_host_tier_smoke(tmp_path):
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, str(ROOT / "scripts/bench_host_tier.py"), "--smoke", "--out", str(tmp_path)],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (path,) = tmp_path.glob("*host-tier-smoke.json")
    r = json.loads(path.read_text())
    assert r["smoke"] and r["device"] and r["date"]
    link = r["link"]
    assert link["run_rblocks"] > 1 and all(link["copy_gb_s"][w] > 0 and link["link_gb_s"][w] > 0
                                           for w in ("to_host", "to_device"))
    assert link["stream_rblocks"] >= 1 and all(link["stream_gb_s"][w] > 0 for w in ("to_host", "to_device"))
    turns = r["multi_turn"]
    assert turns["on"]["host_cache_hit_blocks"] > 0 and turns["off"]["host_cache_hit_blocks"] == 0
    assert turns["on"]["generated"] == turns["off"]["generated"] > 0 and turns["on"]["ttft_p50_s"] > 0
    preempt = r["preemption"]
    assert preempt["on"]["swap_outs"] > 0 and preempt["off"]["swap_outs"] == 0 and preempt["off"]["preemptions"] > 0
    assert preempt["on"]["generated"] == preempt["off"]["generated"]
    assert r["decode"]["on"]["ms_per_token"] > 0 and r["decode"]["off"]["ms_per_token"] > 0
    assert r["compiles_after_warm_up"] == 0
    assert (tmp_path / path.name.replace(".json", ".md")).exists()
