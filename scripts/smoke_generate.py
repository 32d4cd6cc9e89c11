"""GPU smoke test: a Llama-2-7B-shaped model with random bf16 weights generates; ms/token at a given context.

  PYTHONPATH=$PWD python3 scripts/smoke_generate.py --model llama2-7b --context 1024 --new-tokens 64

Prints a table and writes JSON to benchmarks/results/ (or --out). Decode time per token is the
median over steady-state decode steps (after the compile of the first step of each shape).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time

import numpy as np

from scripts.common import harness


def run_one(llm, context: int, new_tokens: int):
    """One request of `context` random prompt tokens; every step waits for its tokens (pipeline off), so a
    step's time is its own."""
    from jaxllm.engine.core import Request
    from jaxllm.contract import SamplingParams

    rng = np.random.default_rng(0)
    prompt = rng.integers(3, 259, size=context).tolist()
    request = Request(prompt, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
    step_times, kinds = [], []
    t0 = last = time.perf_counter()
    first_token_at = None

    def on_step(outputs) -> None:
        nonlocal last, first_token_at
        now = time.perf_counter()
        step_times.append(now - last)
        kinds.append(llm.core.last_plan.kind.label)
        last = now
        if first_token_at is None and any(out.token_ids for out in outputs):
            first_token_at = now - t0

    pipeline, llm.core.pipeline = llm.core.pipeline, False
    try:
        outputs = llm.run([request], on_step=on_step)
    finally:
        llm.core.pipeline = pipeline
    generated = sum(len(out.token_ids) for outs in outputs.values() for out in outs)
    decode = np.array([t for t, k in zip(step_times, kinds) if k == "decode"][2:])
    return {
        "context": context,
        "new_tokens": generated,
        "prefill_s_incl_compile": first_token_at,
        "decode_ms_per_token_median": float(np.median(decode) * 1e3) if decode.size else None,
        "decode_ms_per_token_p90": float(np.percentile(decode, 90) * 1e3) if decode.size else None,
        "decode_steps_timed": int(decode.size),
        "compiles": llm.compile_count,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama2-7b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--context", type=int, nargs="+", default=[1024])
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--backend", nargs="+", default=["auto"], help="attention backends to run (auto, reference, triton)")
    p.add_argument("--num-blocks", type=int, default=None)
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args(argv)

    import jax

    from jaxllm import LLM, EngineOptions

    device = jax.devices()[0]
    rows = []
    for backend in args.backend:
        t = time.perf_counter()
        options = EngineOptions(attention_backend=backend, num_blocks=args.num_blocks, block_size=args.block_size)
        llm = LLM(args.model, dtype=args.dtype, max_context=max(args.context) + args.new_tokens + 1,
                  allow_long_context=True, options=options)  # random weights: contexts past the window are the test
        print(f"[{backend}] model ready in {time.perf_counter() - t:.1f} s; pool {llm.num_blocks} rBlocks "
              f"x {llm.executor.block_size} tokens", file=sys.stderr, flush=True)
        for context in args.context:
            try:
                row = {"backend": backend, **run_one(llm, context, args.new_tokens)}
            except Exception as e:  # record and go on: one failing backend must not hide the others
                row = {"backend": backend, "context": context, "error": f"{type(e).__name__}: {e}"[:2000]}
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
        del llm
    result = {
        "script": "scripts/smoke_generate.py",
        "argv": sys.argv[1:],
        "device": getattr(device, "device_kind", str(device)),
        "date": datetime.date.today().isoformat(),
        "jax": jax.__version__,
        "python": platform.python_version(),
        "model": args.model,
        "dtype": args.dtype,
        "rows": rows,
    }
    print(f"{'backend':10} {'context':>8} {'ms/token':>9} {'p90':>7} {'prefill s':>10} {'compiles':>8}")
    for r in rows:
        if "error" in r:
            print(f"{r['backend']:10} {r['context']:>8} ERROR {r['error'][:200]}")
            continue
        med = r["decode_ms_per_token_median"]
        p90 = r["decode_ms_per_token_p90"]
        print(f"{r['backend']:10} {r['context']:>8} {med if med is None else round(med, 2):>9} "
              f"{p90 if p90 is None else round(p90, 2):>7} {r['prefill_s_incl_compile']:>10.2f} {r['compiles']:>8}")
    name = harness.result_stem(result["device"], "smoke-generate.json", result["date"])
    harness.write_json(os.path.join(args.out, name), result)
    print(f"wrote {os.path.join(args.out, name)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
