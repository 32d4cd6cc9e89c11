"""What the load tests (gRPC: load_test.py, HTTP: load_test_http.py) share: a request's result, percentiles,
the server's compile counter, and the printed report."""

from __future__ import annotations

import dataclasses
import urllib.request

from serve.metrics import parse


@dataclasses.dataclass
class Result:
    ok: bool
    code: str
    latency_s: float
    ttft_s: float | None
    tpot_s: float | None
    tokens: int


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated q-th percentile (q in [0, 100]) of values; NaN when empty."""
    if not values:
        return float("nan")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def read_metric(url: str | None, name: str) -> float | None:
    """The unlabelled sample `name` scraped from url; None without a url or without that sample."""
    if not url:
        return None
    with urllib.request.urlopen(url, timeout=10) as response:
        return parse(response.read().decode()).get(name)


def print_table(report: dict) -> None:
    s = report["server"]
    print(f"server {s['target']}: {s['model']} ({s['architecture']}, {s['dtype']}, {s['backend']}), "
          f"max_context {s['max_context']}, {s['kv_num_blocks']} rBlocks x {s['kv_block_size']}")
    c = report["config"]
    mode = f"open loop {c['rate']} req/s" if c["rate"] else f"closed loop, concurrency {c['concurrency']}"
    print(f"{report['requests']} requests ({mode}), prompt {c['prompt_tokens']} tokens, "
          f"output {c['max_tokens']} tokens; status {report['codes']}")
    print(f"duration {report['duration_s']:.2f} s | {report['requests_per_s']:.2f} req/s | "
          f"{report['output_tokens_per_s']:.1f} output tok/s | compiles during run: "
          f"{report['compiles_during_run'] if report['compiles_during_run'] is not None else 'n/a'}")
    print(f"{'metric':<10}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}   (ms)")
    for key, name in (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("latency_s", "latency")):
        m = report[key]
        print(f"{name:<10}" + "".join(f"{m[q] * 1e3:>10.1f}" for q in ("mean", "p50", "p90", "p99")))


def add_load_arguments(p, metrics_example: str) -> None:
    """The load's command-line options, the same for both load tests."""
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=32, help="streams in flight (closed loop)")
    p.add_argument("--rate", type=float, default=None, help="open loop: Poisson arrivals at this many req/s")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup-requests", type=int, default=1, help="sent (one at a time) before timing starts")
    p.add_argument("--metrics-url", default=None, help=f"e.g. {metrics_example}")
    p.add_argument("--json", default=None, help="write the report here")


def check_load_arguments(p, args, positive: tuple[str, ...] = ()) -> None:
    for name in ("requests", "concurrency", "prompt_tokens", "max_tokens") + positive:
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.rate is not None and args.rate <= 0:
        p.error(f"--rate must be positive, got {args.rate}")


def finish(report: dict, json_path: str | None) -> int:
    """Print the report, write it where asked; the exit status: 0 when every request succeeded."""
    import json

    print_table(report)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {json_path}")
    return 0 if report["ok"] == report["requests"] else 1
