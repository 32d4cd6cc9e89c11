"""Every benchmark script imports and answers --help on a CPU; the harness's device floor, spread and files."""

import ast
import json
import os
import runpy
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SCRIPTS = os.path.join(ROOT, "scripts")
sys.path.insert(0, SCRIPTS)

import harness  # noqa: E402

# Scripts with a command line; the rest of scripts/*.py are shared modules (harness, attention_cases, ...).
CLI_SCRIPTS = sorted(f for f in os.listdir(SCRIPTS)
                     if f.endswith(".py") and "argparse" in open(os.path.join(SCRIPTS, f)).read())
SHARED = {"harness", "attention_cases", "gpu_state", "device_trace", "load_report", "tuning_collector"}


def test_every_script_with_a_command_line_is_listed():
    assert set(CLI_SCRIPTS) | {m + ".py" for m in SHARED} == {f for f in os.listdir(SCRIPTS) if f.endswith(".py")}
    assert len(CLI_SCRIPTS) >= 11, CLI_SCRIPTS


@pytest.mark.parametrize("script", CLI_SCRIPTS)
def test_script_help_runs_on_the_cpu(script, monkeypatch, capsys):
    """`python scripts/X.py --help`, in this process (jax imported once): a broken import fails here."""
    path = os.path.join(SCRIPTS, script)
    monkeypatch.setattr(sys, "argv", [path, "--help"])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(path, run_name="__main__")
    assert exit_.value.code in (0, None)
    assert "usage:" in capsys.readouterr().out


@pytest.mark.parametrize("script", sorted(f for f in os.listdir(SCRIPTS) if f.endswith(".py")))
def test_scripts_import_only_shared_modules_of_scripts(script):
    """A script imports harness-like shared modules, never another benchmark script (nor its _helpers)."""
    tree = ast.parse(open(os.path.join(SCRIPTS, script)).read())
    local = {f[:-3] for f in os.listdir(SCRIPTS) if f.endswith(".py")}
    for node in ast.walk(tree):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                 [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
        for name in names:
            top = name.split(".")[0]
            assert top not in local or top in SHARED, f"{script} imports the script {name}"
        if isinstance(node, ast.ImportFrom) and node.module in local:
            assert not any(a.name.startswith("_") for a in node.names), f"{script}: private import from {node.module}"


def test_hbm_floor_known_devices_and_none_for_others(capsys):
    assert harness.hbm_floor_tb_s("NVIDIA H100 80GB HBM3") == 3.35
    assert harness.hbm_floor_tb_s("NVIDIA H200") == 4.8
    assert harness.hbm_floor_tb_s("cpu") is None
    assert "no HBM bandwidth known for 'cpu'" in capsys.readouterr().out


def test_no_script_hard_codes_a_bandwidth():
    for f in os.listdir(SCRIPTS):
        if f.endswith(".py") and f != "harness.py":
            text = open(os.path.join(SCRIPTS, f)).read()
            for literal in ("4.8e12", "= 4.8", "3.35"):
                assert literal not in text, f"{f} hard-codes {literal}"


def test_spread():
    s = harness.spread([4.0, 1.0, 3.0, 2.0, 5.0])
    assert s == dict(median=3.0, min=1.0, max=5.0, iqr=2.0)
    with pytest.raises(ValueError, match="empty"):
        harness.spread([])


def test_write_json_stamps_device_date_and_floor(tmp_path):
    path = tmp_path / "sub" / harness.result_stem("NVIDIA H200", "x.json", "2026-01-02")
    assert path.name.startswith("nvidia-h200-2026-01-02-") and path.name.endswith("-x.json")
    harness.write_json(str(path), {"device": "NVIDIA H200", "rows": [1]})
    saved = json.loads(path.read_text())
    assert saved["hbm_floor_tb_s"] == 4.8 and saved["date"] == harness.today() and saved["rows"] == [1]
    harness.write_json(str(path), {"device": "cpu"})
    assert json.loads(path.read_text())["hbm_floor_tb_s"] is None


def test_time_calls_counts_reps_and_divides_by_per():
    calls = []

    def step(x):
        calls.append(x)
        return x

    times, per_rep = harness.time_calls(step, (1,), reps=3, target_s=0.0, max_calls=5, per=2)
    assert len(times) == 3 and per_rep == 1 and len(calls) == 1 + 3  # one sizing call, then 3 reps of 1
    assert all(t >= 0 for t in times)


def test_markdown_table_and_ratio():
    assert harness.markdown_table(["a", "b"], [[1, None]]) == "| a | b |\n| --- | --- |\n| 1 | - |\n"
    assert harness.ratio(3.0, 2.0) == "1.50" and harness.ratio(None, 2.0) == "-"
    rows = [dict(case="c", impl="i", us=2.0)]
    assert harness.row_value(rows, "c", "i", "us") == 2.0 and harness.row_value(rows, "c", "j", "us") is None
