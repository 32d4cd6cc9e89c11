"""Every command-line script answers --help on a CPU and imports only scripts.common of scripts/; the harness's
device floor, spread and files."""

import ast
import json
import os
import runpy
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SCRIPTS = os.path.join(ROOT, "scripts")
COMMON = os.path.join(SCRIPTS, "common")

from scripts.common import harness  # noqa: E402  (after the paths above, which it is checked against)

# scripts/*.py are the command-line scripts; the code they share is the package scripts/common.
CLI_SCRIPTS = sorted(f for f in os.listdir(SCRIPTS) if f.endswith(".py") and f != "__init__.py")
SHARED = sorted(f[:-3] for f in os.listdir(COMMON) if f.endswith(".py") and f != "__init__.py")
SOURCES = [os.path.join("scripts", f) for f in ["__init__.py", *CLI_SCRIPTS]] + [
    os.path.join("scripts", "common", m + ".py") for m in ["__init__", *SHARED]]


def test_scripts_and_shared_modules_are_found():
    assert len(CLI_SCRIPTS) >= 11, CLI_SCRIPTS
    assert {"harness", "attention_cases", "gpu_state", "device_trace", "load_report"} <= set(SHARED), SHARED


@pytest.mark.parametrize("script", CLI_SCRIPTS)
def test_script_help_runs_on_the_cpu(script, monkeypatch, capsys):
    """`python scripts/X.py --help`, in this process (jax imported once; the repository root on sys.path, as
    PYTHONPATH=$PWD or `python -m` puts it): a broken import fails here."""
    path = os.path.join(SCRIPTS, script)
    monkeypatch.setattr(sys, "argv", [path, "--help"])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(path, run_name="__main__")
    assert exit_.value.code in (0, None)
    assert "usage:" in capsys.readouterr().out


@pytest.mark.parametrize("module", SHARED)
def test_shared_modules_have_no_command_line(module):
    """A module with a command line belongs in scripts/, not among the code the scripts share."""
    text = open(os.path.join(COMMON, module + ".py")).read()
    assert "argparse" not in text and "__main__" not in text, f"scripts/common/{module}.py has a command line"


def _imported_modules(tree) -> list[tuple[str, list[str]]]:
    """(module, names imported from it) of every absolute import; `import a.b` gives ("a.b", [])."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.module, [a.name for a in node.names]))
    return out


@pytest.mark.parametrize("source", SOURCES)
def test_scripts_import_only_the_shared_package(source):
    """A script imports public names of scripts.common, never another script (nor its _helpers), and spells the
    package one way (`scripts.common`, from the repository root: never `common` off scripts/ on sys.path); so do
    the shared modules."""
    scripts = {f[:-3] for f in CLI_SCRIPTS}
    for module, names in _imported_modules(ast.parse(open(os.path.join(ROOT, source)).read())):
        parts = module.split(".")
        assert parts[0] not in scripts | {"common"}, f"{source} imports {module} (scripts/ on sys.path)"
        if parts[0] != "scripts":
            continue
        assert len(parts) >= 2 and parts[1] == "common", f"{source} imports {module}, not scripts.common"
        assert len(parts) == 2 or parts[2] in SHARED, f"{source} imports {module}, not in scripts/common"
        if len(parts) == 2:
            assert set(names) <= set(SHARED), f"{source}: from {module} import {names}: not modules of scripts/common"
        assert not any(n.startswith("_") for n in names), f"{source}: private import from {module}"


def test_hbm_floor_known_devices_and_none_for_others(capsys):
    assert harness.hbm_floor_tb_s("NVIDIA H100 80GB HBM3") == 3.35
    assert harness.hbm_floor_tb_s("NVIDIA H200") == 4.8
    assert harness.hbm_floor_tb_s("cpu") is None
    assert "no HBM bandwidth known for 'cpu'" in capsys.readouterr().out


def test_no_script_hard_codes_a_bandwidth():
    for f in SOURCES:
        if f != os.path.join("scripts", "common", "harness.py"):
            text = open(os.path.join(ROOT, f)).read()
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


def test_results_go_to_the_repositorys_benchmarks_results():
    """Every script's default --out: the directory BENCHMARKS.md's JSON lives in (it once pointed at a
    scripts/benchmarks/results/ that nothing reads)."""
    assert harness.RESULTS_DIR == os.path.join(ROOT, "benchmarks", "results")
