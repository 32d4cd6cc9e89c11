"""A short load from AIPerf (NVIDIA's benchmark client, from PyPI) against a running jaxllm HTTP server: the token
counts and latencies AIPerf read, as a table and JSON.

    python3 -m venv ~/aiperf-venv && ~/aiperf-venv/bin/pip install aiperf==0.13.0
    python3 -m scripts.bench_aiperf --url http://127.0.0.1:8000/v1 --aiperf ~/aiperf-venv/bin/aiperf \
        --requests 16 --concurrency 4 --prompt-tokens 64 --max-tokens 16 --json aiperf.json

It starts no server: it runs `aiperf profile` against --url and reads what AIPerf exported. AIPerf lives in an
environment of its own (it pulls in ~140 packages, matplotlib, dash and optuna among them, and pins pandas 2.x;
no torch). The model name is the server's (GET /v1/models). AIPerf builds its synthetic prompts with a HuggingFace
tokenizer: by default the served model's directory, so serve an HF directory (a preset such as `tiny` has none:
`jaxllm convert tiny DIR` writes one) or pass --tokenizer. Streamed completions, exactly --max-tokens out (jaxllm's
`ignore_eos`), token counts from the server's own `usage` (AIPerf's --use-server-token-count), printed beside the
growth of the server's token counters (its /metrics, read before and after). Exits 1 when a request failed or a
token count AIPerf read is zero.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import urllib.error
import urllib.request

from scripts.common.load_report import read_metric

SUMMARY = "profile_export_aiperf.json"  # AIPerf's summary export, in --artifact-dir
COUNTERS = ("jaxllm_prompt_tokens_total", "jaxllm_generation_tokens_total")


def served_model(base_url: str, api_key: str | None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    request = urllib.request.Request(f"{base_url}/v1/models", headers=headers)
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())["data"][0]["id"]


def aiperf_command(args, base_url: str, model: str, tokenizer: str) -> list[str]:
    cmd = [args.aiperf, "profile", "--model", model, "--url", base_url, "--endpoint-type", "completions",
           "--streaming", "--tokenizer", tokenizer, "--isl", str(args.prompt_tokens), "--isl-stddev", "0",
           "--osl", str(args.max_tokens), "--request-count", str(args.requests), "--concurrency", str(args.concurrency),
           "--random-seed", str(args.seed),
           "--use-server-token-count", "--extra-inputs", "ignore_eos:true", "--ui", "none", "--no-gpu-telemetry",
           "--artifact-dir", args.artifact_dir]
    if args.warmup_requests:  # AIPerf refuses a count of 0
        cmd += ["--warmup-request-count", str(args.warmup_requests)]
    if args.api_key:
        cmd += ["--api-key", args.api_key]
    return cmd


def aiperf_env(tokenizer: str) -> dict:
    env = dict(os.environ)
    if os.path.isdir(tokenizer):
        # AIPerf 0.13 in HF offline mode looks every tokenizer name up in the hub cache, a local directory too, and
        # fails ("Repo id must be in the form ..."); online mode reads a local directory without the hub.
        env.pop("HF_HUB_OFFLINE", None)
        env.pop("TRANSFORMERS_OFFLINE", None)
    return env


def _stat(summary: dict, name: str, key: str = "avg") -> float | None:
    value = summary.get(name)
    return None if value is None else value.get(key)


def server_counters(metrics_url: str | None) -> dict | None:
    """The server's token counters now; None without a URL or when /metrics does not answer."""
    try:
        return {name: read_metric(metrics_url, name) for name in COUNTERS} if metrics_url else None
    except (OSError, urllib.error.URLError):
        return None


def report_from(artifact_dir: str) -> dict:
    """The figures of AIPerf's summary export."""
    with open(os.path.join(artifact_dir, SUMMARY)) as f:
        summary = json.load(f)
    report = {
        "aiperf_version": summary.get("aiperf_version"),
        "requests": _stat(summary, "request_count"),
        "completed": _stat(summary, "completed_request_count"),
        "errors": sum(e.get("count", 1) for e in summary.get("error_summary") or []),
        "prompt_tokens": _stat(summary, "total_usage_prompt_tokens"),
        "completion_tokens": _stat(summary, "total_usage_completion_tokens"),
        "input_sequence_length": _stat(summary, "input_sequence_length"),
        "output_sequence_length": _stat(summary, "output_sequence_length"),
        "duration_s": _stat(summary, "benchmark_duration"),
        "requests_per_s": _stat(summary, "request_throughput"),
        "output_tokens_per_s": _stat(summary, "output_token_throughput"),
    }
    for name in ("time_to_first_token", "inter_token_latency", "request_latency"):
        report[name + "_ms"] = {q: _stat(summary, name, q) for q in ("avg", "p50", "p90", "p99")}
    return report


def problems(report: dict) -> list[str]:
    out = [f"{name} is {report[name]!r}" for name in ("prompt_tokens", "completion_tokens")
           if not report[name]]
    if report["errors"]:
        out.append(f"{report['errors']} requests failed (AIPerf's log is in --artifact-dir)")
    if report["completed"] != report["requests"]:
        out.append(f"{report['completed']} of {report['requests']} requests completed")
    return out


def print_table(report: dict) -> None:
    fmt = lambda v, spec: "n/a" if v is None else format(v, spec)  # noqa: E731
    print(f"AIPerf {report['aiperf_version']}: {fmt(report['requests'], '.0f')} requests, "
          f"{fmt(report['completed'], '.0f')} completed, {report['errors']} failed, "
          f"{fmt(report['duration_s'], '.2f')} s")
    print(f"tokens (server usage): prompt {fmt(report['prompt_tokens'], '.0f')} "
          f"({fmt(report['input_sequence_length'], '.1f')} a request), completion "
          f"{fmt(report['completion_tokens'], '.0f')} ({fmt(report['output_sequence_length'], '.1f')} a request)")
    if report.get("server_counted"):
        s = report["server_counted"]
        print(f"the server's /metrics over the run (warm-up and other clients' requests included): "
              + ", ".join(f"{name} +{fmt(s[name], '.0f')}" for name in COUNTERS))
    print(f"{fmt(report['requests_per_s'], '.2f')} req/s | {fmt(report['output_tokens_per_s'], '.1f')} output tok/s")
    print(f"{'metric':<10}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}   (ms)")
    for key, name in (("time_to_first_token_ms", "TTFT"), ("inter_token_latency_ms", "ITL"),
                      ("request_latency_ms", "latency")):
        print(f"{name:<10}" + "".join(f"{fmt(report[key][q], '>10.1f'):>10}" for q in ("avg", "p50", "p90", "p99")))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8000/v1", help="the server's API base URL (/v1 optional)")
    p.add_argument("--aiperf", default="aiperf", help="the aiperf executable")
    p.add_argument("--model", default=None, help="the served model name (default: GET /v1/models)")
    p.add_argument("--tokenizer", default=None, help="HF tokenizer directory or id (default: the model)")
    p.add_argument("--api-key", default=os.environ.get("JAXLLM_API_KEY"))
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--warmup-requests", type=int, default=0, help="sent before timing starts")
    p.add_argument("--metrics-url", default=None, help="the server's /metrics, read before and after "
                   "(default: the API's, on the same port; '' reads none)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--artifact-dir", default="aiperf-artifacts", help="where AIPerf writes its exports and log")
    p.add_argument("--json", default=None, help="write the report here")
    args = p.parse_args(argv)
    for name in ("requests", "concurrency", "prompt_tokens", "max_tokens"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    base_url = args.url.rstrip("/").removesuffix("/v1")  # AIPerf appends /v1/completions itself
    model = args.model or served_model(base_url, args.api_key)
    tokenizer = args.tokenizer or model
    cmd = aiperf_command(args, base_url, model, tokenizer)
    print("running: " + " ".join(cmd), flush=True)
    os.makedirs(args.artifact_dir, exist_ok=True)
    log = os.path.join(args.artifact_dir, "aiperf.stdout")
    metrics_url = f"{base_url}/metrics" if args.metrics_url is None else args.metrics_url
    before = server_counters(metrics_url)
    with open(log, "w") as out:
        rc = subprocess.run(cmd, env=aiperf_env(tokenizer), stdout=out, stderr=subprocess.STDOUT).returncode
    after = server_counters(metrics_url)
    if rc != 0 or not os.path.exists(os.path.join(args.artifact_dir, SUMMARY)):
        with open(log) as f:
            print(f.read()[-4000:], file=sys.stderr)
        print(f"aiperf exited {rc} (its output: {log})", file=sys.stderr)
        return 1
    report = report_from(args.artifact_dir) | {"url": base_url, "model": model, "tokenizer": tokenizer,
                                               "command": cmd}
    if before and after and None not in before.values() and None not in after.values():
        report["server_counted"] = {name: after[name] - before[name] for name in COUNTERS}
    print_table(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    bad = problems(report)
    for line in bad:
        print(f"FAIL: {line}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
