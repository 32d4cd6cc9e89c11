"""scripts/load_test.py's twin for the OpenAI-compatible HTTP API: requests/s, TTFT and TPOT over SSE streams.

    python -m scripts.load_test_http --url http://127.0.0.1:8000/v1 --requests 256 --concurrency 32 \
        --prompt-tokens 128 --max-tokens 128 --json load_http.json

The same load as the gRPC script, so the two tables sit side by side: prompts of exactly
--prompt-tokens random token ids (OpenAI's list-of-ints prompt), exactly --max-tokens out
(jaxllm's `ignore_eos` extra field), streamed with usage. Plain `http.client`, one connection per
request, one thread per stream in flight: the client adds as little as it can to what it measures.
TTFT: request sent -> first chunk with text. TPOT: (last text chunk - first) / (tokens - 1), tokens
from the final usage chunk. With --api-key (or $JAXLLM_API_KEY) it sends the bearer key.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import sys
import threading
import time
import urllib.parse
import urllib.request

from scripts.common.load_report import (Result, add_load_arguments, check_load_arguments, finish, percentile,
                                        read_metric)


class Api:
    def __init__(self, url: str, api_key: str | None):
        parts = urllib.parse.urlsplit(url.rstrip("/"))
        if parts.scheme != "http" or not parts.hostname:
            raise SystemExit(f"--url must look like http://HOST:PORT/v1, got {url!r}")
        self.host, self.port, self.base = parts.hostname, parts.port or 80, parts.path
        self.headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"

    def models(self) -> dict:
        request = urllib.request.Request(f"http://{self.host}:{self.port}{self.base}/models", headers=self.headers)
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.loads(response.read())["data"][0]

    def one_request(self, body: dict, timeout: float | None) -> Result:
        start = time.monotonic()
        first = last = None
        tokens = 0
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        try:
            conn.request("POST", f"{self.base}/completions", body=json.dumps(body), headers=self.headers)
            response = conn.getresponse()
            if response.status != 200:
                response.read()
                return Result(False, str(response.status), time.monotonic() - start, None, None, 0)
            for raw in response:  # SSE: "data: {...}" lines, blank lines between events
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return Result(False, "stream_error", time.monotonic() - start, None, None, tokens)
                # Every chunk carries the tokens so far (continuous_usage_stats): time tokens, not text,
                # which random-weight models often decode to nothing.
                usage = chunk.get("usage") or {}
                if usage.get("completion_tokens", 0) > tokens:
                    now = time.monotonic()
                    first = first if first is not None else now
                    last = now
                    tokens = usage["completion_tokens"]
        except (OSError, http.client.HTTPException) as e:
            return Result(False, type(e).__name__, time.monotonic() - start, None, None, tokens)
        finally:
            conn.close()
        ttft = first - start if first is not None else None
        tpot = (last - first) / (tokens - 1) if tokens > 1 and first is not None else None
        return Result(True, "200", time.monotonic() - start, ttft, tpot, tokens)


def run(args: argparse.Namespace) -> dict:
    api = Api(args.url, args.api_key)
    model = api.models()
    if args.prompt_tokens + args.max_tokens > model["max_model_len"]:
        raise SystemExit(f"--prompt-tokens {args.prompt_tokens} + --max-tokens {args.max_tokens} is over the "
                         f"server's context limit {model['max_model_len']}")
    rng = random.Random(args.seed)
    vocab = model["vocab_size"]
    bodies = [{"model": model["id"], "prompt": [rng.randrange(3, vocab) for _ in range(args.prompt_tokens)],
               "max_tokens": args.max_tokens, "temperature": args.temperature, "seed": i, "ignore_eos": True,
               "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}} for i in range(args.requests)]
    for i in range(args.warmup_requests):  # first-shape compiles should not count as load latency
        api.one_request(bodies[i % len(bodies)], args.timeout)

    compiles_before = read_metric(args.metrics_url, "jaxllm_compiles_total")
    results: list[Result | None] = [None] * len(bodies)
    next_index = iter(range(len(bodies)))
    lock = threading.Lock()

    def worker() -> None:
        while True:
            with lock:
                i = next(next_index, None)
            if i is None:
                return
            results[i] = api.one_request(bodies[i], args.timeout)

    start = time.monotonic()
    if args.rate:  # open loop: Poisson arrivals
        threads = []
        for i in range(len(bodies)):
            t = threading.Thread(target=lambda i=i: results.__setitem__(i, api.one_request(bodies[i], args.timeout)),
                                 daemon=True)
            t.start()
            threads.append(t)
            time.sleep(rng.expovariate(args.rate))
    else:
        threads = [threading.Thread(target=worker, daemon=True) for _ in range(args.concurrency)]
        for t in threads:
            t.start()
    for t in threads:
        t.join()
    duration = time.monotonic() - start
    compiles_after = read_metric(args.metrics_url, "jaxllm_compiles_total")

    ok = [r for r in results if r is not None and r.ok]
    codes: dict[str, int] = {}
    for r in results:
        if r is not None:
            codes[r.code] = codes.get(r.code, 0) + 1
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    tpot = [r.tpot_s for r in ok if r.tpot_s is not None]

    def summary(xs):
        return {"mean": sum(xs) / len(xs) if xs else float("nan"),
                **{f"p{q}": percentile(xs, q) for q in (50, 90, 99)}}

    return {
        "server": {"target": args.url, "model": model["id"], "architecture": "-", "dtype": "-", "backend": "http",
                   "max_context": model["max_model_len"], "kv_block_size": "-", "kv_num_blocks": "-"},
        "config": {k: v for k, v in vars(args).items() if k not in ("json", "api_key")},
        "requests": len(bodies), "ok": len(ok), "codes": codes, "duration_s": duration,
        "requests_per_s": len(ok) / duration, "output_tokens_per_s": sum(r.tokens for r in ok) / duration,
        "ttft_s": summary(ttft), "tpot_s": summary(tpot), "latency_s": summary([r.latency_s for r in ok]),
        "compiles_during_run": (compiles_after - compiles_before) if compiles_before is not None else None,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8000/v1", help="the API's base URL")
    p.add_argument("--api-key", default=os.environ.get("JAXLLM_API_KEY"))
    p.add_argument("--timeout", type=float, default=600.0, help="per-request socket timeout, seconds")
    add_load_arguments(p, "http://127.0.0.1:8000/metrics")
    args = p.parse_args(argv)
    check_load_arguments(p, args)
    return finish(run(args), args.json)

if __name__ == "__main__":
    sys.exit(main())
