"""scripts/bench_aiperf.py without AIPerf: a stand-in `aiperf` records the command and environment it was given and
writes a summary export shaped like AIPerf 0.13's; the script must read its token counts and fail on zero ones.
(The real client against a real server is run by hand, as the script's docstring and the README show.)"""

from __future__ import annotations

import json
import stat
import sys

import pytest

from scripts import bench_aiperf

FAKE = """#!{python}
import json, os, sys
args = sys.argv[1:]
out = args[args.index("--artifact-dir") + 1]
os.makedirs(out, exist_ok=True)
json.dump({{"argv": args, "offline": os.environ.get("HF_HUB_OFFLINE")}}, open(os.path.join(out, "called.json"), "w"))
completion = float(os.environ["FAKE_COMPLETION_TOKENS"])
stat = lambda avg, **more: dict(avg=avg, p50=avg, p90=avg, p99=avg, **more)
json.dump({{"aiperf_version": "0.13.0", "request_count": {{"avg": 4.0}}, "completed_request_count": {{"avg": 4.0}},
           "error_summary": [], "total_usage_prompt_tokens": {{"avg": 260.0}},
           "total_usage_completion_tokens": {{"avg": completion}}, "input_sequence_length": stat(65.0),
           "output_sequence_length": stat(completion / 4), "benchmark_duration": {{"avg": 2.0}},
           "request_throughput": {{"avg": 2.0}}, "output_token_throughput": {{"avg": completion / 2}},
           "time_to_first_token": stat(100.0), "inter_token_latency": stat(5.0), "request_latency": stat(180.0)}},
          open(os.path.join(out, "profile_export_aiperf.json"), "w"))
sys.exit(int(os.environ.get("FAKE_EXIT", "0")))
"""


@pytest.fixture
def fake_aiperf(tmp_path):
    path = tmp_path / "aiperf"
    path.write_text(FAKE.format(python=sys.executable))
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def _run(tmp_path, fake_aiperf, monkeypatch, completion: int, exit_code: int = 0, metrics_url: str = "") \
        -> tuple[int, dict]:
    tokenizer = tmp_path / "tiny-hf"
    tokenizer.mkdir(exist_ok=True)
    monkeypatch.setenv("FAKE_COMPLETION_TOKENS", str(completion))
    monkeypatch.setenv("FAKE_EXIT", str(exit_code))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "art"
    rc = bench_aiperf.main(["--url", "http://127.0.0.1:8000/v1/", "--aiperf", fake_aiperf, "--model", "m",
                            "--tokenizer", str(tokenizer), "--requests", "4", "--concurrency", "2",
                            "--artifact-dir", str(out), "--json", str(tmp_path / "report.json"),
                            "--metrics-url", metrics_url])
    return rc, json.loads((out / "called.json").read_text())


def test_reads_the_token_counts_and_passes_the_load_as_asked(tmp_path, fake_aiperf, monkeypatch, capsys):
    scrapes = iter([100.0, 10.0, 360.0, 74.0])  # prompt, generation tokens before; the same after
    monkeypatch.setattr(bench_aiperf, "read_metric", lambda url, name: next(scrapes))
    rc, called = _run(tmp_path, fake_aiperf, monkeypatch, completion=64, metrics_url="http://server/metrics")
    assert rc == 0
    argv = called["argv"]
    assert argv[0] == "profile" and argv[argv.index("--url") + 1] == "http://127.0.0.1:8000"  # AIPerf adds /v1
    assert argv[argv.index("--endpoint-type") + 1] == "completions" and "--streaming" in argv
    assert "--use-server-token-count" in argv and argv[argv.index("--extra-inputs") + 1] == "ignore_eos:true"
    assert [argv[argv.index(f) + 1] for f in ("--request-count", "--concurrency", "--isl", "--osl")] == \
        ["4", "2", "64", "16"]
    assert called["offline"] is None  # AIPerf 0.13 cannot load a local tokenizer directory in HF offline mode
    printed = capsys.readouterr().out
    assert "prompt 260 (65.0 a request), completion 64 (16.0 a request)" in printed
    report = json.loads((tmp_path / "report.json").read_text())
    assert (report["prompt_tokens"], report["completion_tokens"], report["errors"]) == (260, 64, 0)
    assert report["server_counted"] == {"jaxllm_prompt_tokens_total": 260, "jaxllm_generation_tokens_total": 64}
    assert "jaxllm_prompt_tokens_total +260, jaxllm_generation_tokens_total +64" in printed


def test_zero_tokens_or_a_failed_run_exit_1(tmp_path, fake_aiperf, monkeypatch, capsys):
    assert _run(tmp_path, fake_aiperf, monkeypatch, completion=0)[0] == 1
    assert "FAIL: completion_tokens is 0.0" in capsys.readouterr().err
    assert _run(tmp_path, fake_aiperf, monkeypatch, completion=64, exit_code=3)[0] == 1
    assert "aiperf exited 3" in capsys.readouterr().err
