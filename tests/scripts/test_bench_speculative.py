"""scripts/bench_speculative.py's arithmetic (the derived speedups, the replay's fixed point) and its draft-model
run on the CPU with the tiny model (the GPU run's code path end to end: same tokens, acceptance counted)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from scripts import bench_speculative as bench

ROOT = Path(__file__).resolve().parents[2]


def test_derived_speedups_follow_the_expected_tokens_a_verify():
    rows = bench.derived_speedups(decode_ms=10.0, verify_ms=12.5, k=4, rates=(0.5, 0.9))
    assert [r["tokens_per_verify"] for r in rows] == pytest.approx([1.9375, 4.0951])
    assert [r["speedup"] for r in rows] == pytest.approx([1.9375 * 0.8, 4.0951 * 0.8])


def test_the_replay_replays_its_own_tokens_until_they_repeat(monkeypatch):
    # A fake engine whose verify steps part from what they are shown at positions 3 and 7, once each.
    truth = [1, 2, 3, 40, 5, 6, 7, 80, 9]
    expected_seen = []

    class Proposer:
        def expect(self, prompt, tokens):
            expected_seen.append(list(tokens))

    def drive(llm, prompt, new_tokens, k):
        shown = expected_seen[-1]
        first = next((i for i, (a, b) in enumerate(zip(shown, truth)) if a != b), None)
        return {"tokens": list(truth) if first is None else shown[:first] + truth[first:first + 1] + shown[first + 1:]}

    monkeypatch.setattr(bench, "_drive", drive)
    run, passes = bench._replay_to_fixed_point(None, Proposer(), [0], [1, 2, 3, 4, 5, 6, 7, 8, 9], 9)
    assert run["tokens"] == truth and passes == 3


@pytest.mark.slow
@pytest.mark.xdist_group("bench_speculative")
def test_bench_speculative_draft_model_on_the_cpu(tmp_path):
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, str(ROOT / "scripts/bench_speculative.py"), "--model", "tiny",
                           "--draft-model", "tiny", "--contexts", "48", "--new-tokens", "12", "--out", str(tmp_path)],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (path,) = tmp_path.glob("*speculative-draft-model.json")
    (row,) = json.loads(path.read_text())["draft_rows"]
    assert row["same_tokens"] and row["acceptance_rate"] == 1.0  # the target drafting for itself
    assert row["compiles_timed"] == {"plain": 0, "drafted": 0}
