"""Load a running `python -m jaxllm.serve` with concurrent streams; report requests/s, TTFT and TPOT.

    python -m scripts.load_test --port 50051 --requests 256 --concurrency 32 \
        --prompt-tokens 128 --max-tokens 128 --json load.json

Prompts are random token ids of exactly --prompt-tokens (sent as prompt_token_ids) and every
request generates exactly --max-tokens (ignore_eos), so runs are comparable across models and
servers. Closed loop by default (--concurrency streams always in flight); --rate R sends
requests as a Poisson process of R requests/s instead (open loop, concurrency unbounded).

TTFT: request sent -> first token received. TPOT: (last token - first token) / (tokens - 1),
per request. Percentiles are over requests that finished OK. With --metrics-url, the server's
compile counter is read before and after, so compiles during the run show up. With --api-key (or
$JAXLLM_API_KEY) every call carries the metadata "authorization: Bearer KEY".
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import threading
import time

import grpc

from scripts.common.load_report import (Result, add_load_arguments, check_load_arguments, finish, percentile,
                                        read_metric)
from serve import jaxllm_pb2 as pb
from serve import jaxllm_pb2_grpc as pb_grpc
from serve.client import auth_metadata, grpc_target


def one_request(stub, request: pb.GenerateRequest, timeout: float | None, metadata=()) -> Result:
    start = time.monotonic()
    first = last = None
    tokens = 0
    try:
        for message in stub.Generate(request, timeout=timeout, metadata=metadata):
            if message.token_ids:
                now = time.monotonic()
                first = first if first is not None else now
                last = now
                tokens += len(message.token_ids)
    except grpc.RpcError as e:
        return Result(False, e.code().name, time.monotonic() - start, None, None, tokens)
    ttft = first - start if first is not None else None
    tpot = (last - first) / (tokens - 1) if tokens > 1 else None
    return Result(True, "OK", time.monotonic() - start, ttft, tpot, tokens)


def run(args: argparse.Namespace) -> dict:
    target = grpc_target(args.host, args.port)
    options = [("grpc.max_receive_message_length", 64 << 20)]
    # Several channels: one HTTP/2 connection caps concurrent streams and serialises their frames.
    channels = [grpc.insecure_channel(target, options=options + [("grpc.channel_id", i)])
                for i in range(max(1, min(args.channels, args.concurrency)))]
    stubs = [pb_grpc.LLMServiceStub(c) for c in channels]
    metadata = auth_metadata(args.api_key)
    info = stubs[0].ModelInfo(pb.ModelInfoRequest(), timeout=30, metadata=metadata)
    if args.prompt_tokens + args.max_tokens > info.max_context:
        raise SystemExit(f"--prompt-tokens {args.prompt_tokens} + --max-tokens {args.max_tokens} is over the "
                         f"server's context limit {info.max_context}")
    rng = random.Random(args.seed)
    requests = []
    for i in range(args.requests):
        ids = [rng.randrange(3, info.vocab_size) for _ in range(args.prompt_tokens)]
        requests.append(pb.GenerateRequest(prompt_token_ids=ids, max_tokens=args.max_tokens,
                                           temperature=args.temperature, seed=i, ignore_eos=True))
    for i in range(args.warmup_requests):  # first-shape compiles should not count as load latency
        one_request(stubs[0], requests[i % len(requests)], args.timeout, metadata)

    compiles_before = read_metric(args.metrics_url, "jaxllm_compiles_total")
    results: list[Result | None] = [None] * len(requests)
    next_index = iter(range(len(requests)))
    lock = threading.Lock()

    def worker(k: int) -> None:
        while True:
            with lock:
                i = next(next_index, None)
            if i is None:
                return
            results[i] = one_request(stubs[k % len(stubs)], requests[i], args.timeout, metadata)

    def open_loop() -> None:
        threads = []
        for i in range(len(requests)):
            def fire(i=i):
                results[i] = one_request(stubs[i % len(stubs)], requests[i], args.timeout, metadata)
            t = threading.Thread(target=fire, daemon=True)
            t.start()
            threads.append(t)
            time.sleep(rng.expovariate(args.rate))
        for t in threads:
            t.join()

    start = time.monotonic()
    if args.rate:
        open_loop()
    else:
        threads = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(args.concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    duration = time.monotonic() - start
    compiles_after = read_metric(args.metrics_url, "jaxllm_compiles_total")
    for c in channels:
        c.close()

    ok = [r for r in results if r is not None and r.ok]
    codes: dict[str, int] = {}
    for r in results:
        if r is not None:
            codes[r.code] = codes.get(r.code, 0) + 1
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    tpot = [r.tpot_s for r in ok if r.tpot_s is not None]
    latency = [r.latency_s for r in ok]
    out_tokens = sum(r.tokens for r in ok)

    def summary(xs):
        return {"mean": sum(xs) / len(xs) if xs else float("nan"),
                **{f"p{q}": percentile(xs, q) for q in (50, 90, 99)}}

    return {
        "server": {"target": target, "model": info.model, "architecture": info.architecture, "dtype": info.dtype,
                   "backend": info.backend, "max_context": info.max_context, "kv_block_size": info.kv_block_size,
                   "kv_num_blocks": info.kv_num_blocks, "max_running": info.max_running},
        "config": {k: v for k, v in vars(args).items() if k not in ("json", "api_key")},
        "requests": len(requests), "ok": len(ok), "codes": codes, "duration_s": duration,
        "requests_per_s": len(ok) / duration, "output_tokens_per_s": out_tokens / duration,
        "ttft_s": summary(ttft), "tpot_s": summary(tpot), "latency_s": summary(latency),
        "compiles_during_run": (compiles_after - compiles_before) if compiles_before is not None else None,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument("--channels", type=int, default=4, help="gRPC connections to spread streams over")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request deadline, seconds")
    p.add_argument("--api-key", default=os.environ.get("JAXLLM_API_KEY"), help="the server's --api-key, if any")
    add_load_arguments(p, "http://127.0.0.1:50052/metrics")
    args = p.parse_args(argv)
    check_load_arguments(p, args, positive=("channels",))
    return finish(run(args), args.json)

if __name__ == "__main__":
    sys.exit(main())
