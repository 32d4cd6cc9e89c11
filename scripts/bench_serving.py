"""gRPC and the OpenAI HTTP API side by side on one server: requests/s, TTFT and TPOT under the same load.

  XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 PYTHONPATH=$PWD python3 scripts/bench_serving.py \
      --model llama2-7b --requests 256 --concurrency 32 --prompt-tokens 512 --max-tokens 128 --rounds 2

Starts `python -m jaxllm.serve` with both front ends on one engine, waits until /health says it is warm,
then runs `scripts/load_test.py` (gRPC) and `scripts/load_test_http.py` (SSE streams of
/v1/completions) in turns, --rounds times each (gRPC, HTTP, HTTP, gRPC, ...: neither always goes
first), with identical loads (random prompt token ids, greedy, exactly --max-tokens new tokens each).
Writes `<device>-<date>-<HHMM>-serving.json` with every run and a table of medians over rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from scripts.common import harness
from scripts.common.server_process import free_port, wait_healthy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIGURES = ("requests_per_s", "output_tokens_per_s", "ttft_ms_p50", "ttft_ms_p90", "ttft_ms_p99",
           "tpot_ms_p50", "tpot_ms_p90", "tpot_ms_p99")


def _load(script: str, target: list[str], args, out: str) -> dict:
    argv = [sys.executable, os.path.join(ROOT, "scripts", script), *target, "--requests", str(args.requests),
            "--concurrency", str(args.concurrency), "--prompt-tokens", str(args.prompt_tokens),
            "--max-tokens", str(args.max_tokens), "--json", out]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=args.load_timeout)
    print(proc.stdout[-2000:], proc.stderr[-2000:], file=sys.stderr, flush=True)
    if proc.returncode != 0:
        return {"error": f"{script} exited {proc.returncode}"}
    with open(out) as f:
        return json.load(f)


def _figures(report: dict) -> dict:
    """The table's figures from either load test's JSON (both write the same report shape)."""
    row = {"requests_per_s": report.get("requests_per_s"), "output_tokens_per_s": report.get("output_tokens_per_s")}
    for name in ("ttft", "tpot"):
        seconds = report.get(f"{name}_s", {})
        for q in (50, 90, 99):
            value = seconds.get(f"p{q}")
            row[f"{name}_ms_p{q}"] = None if value is None else value * 1e3
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama2-7b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--startup-timeout", type=float, default=900.0)
    p.add_argument("--load-timeout", type=float, default=600.0)
    p.add_argument("--out", default=harness.RESULTS_DIR)
    args = p.parse_args(argv)

    grpc_port, http_port = free_port(), free_port()
    server = subprocess.Popen([sys.executable, "-m", "jaxllm.serve", "--model", args.model, "--dtype", args.dtype,
                               "--port", str(grpc_port), "--http-port", str(http_port)], cwd=ROOT)
    runs = []
    try:
        wait_healthy(f"http://127.0.0.1:{http_port}/health", server, args.startup_timeout, poll_s=2)
        device = harness.device_kind()
        grpc_target = ["--port", str(grpc_port), "--metrics-url", f"http://127.0.0.1:{grpc_port + 1}/metrics"]
        http_target = ["--url", f"http://127.0.0.1:{http_port}/v1"]
        with tempfile.TemporaryDirectory() as tmp:
            for rnd in range(args.rounds):
                order = [("grpc", "load_test.py", grpc_target), ("http", "load_test_http.py", http_target)]
                for api, script, target in (order if rnd % 2 == 0 else order[::-1]):
                    report = _load(script, target, args, os.path.join(tmp, f"{api}-{rnd}.json"))
                    runs.append({"api": api, "round": rnd, "report": report})
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()

    table = {}
    for api in ("grpc", "http"):
        reports = [_figures(r["report"]) for r in runs if r["api"] == api and "error" not in r["report"]]
        table[api] = {k: statistics.median(v for rep in reports if (v := rep.get(k)) is not None)
                      if any(rep.get(k) is not None for rep in reports) else None for k in FIGURES}
    print(f"\n{'api':6s} " + " ".join(f"{k:>20s}" for k in FIGURES))
    for api, row in table.items():
        print(f"{api:6s} " + " ".join(f"{v:20.2f}" if v is not None else f"{'-':>20s}" for v in row.values()))
    result = {"script": "scripts/bench_serving.py", "argv": sys.argv[1:], "device": device, "model": args.model,
              "load": {k: getattr(args, k) for k in ("requests", "concurrency", "prompt_tokens", "max_tokens")},
              "runs": runs, "medians": table}
    path = os.path.join(args.out, harness.result_stem(device, "serving") + ".json")
    harness.write_json(path, result)
    print(f"wrote {path}")
    return 0 if all("error" not in r["report"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
