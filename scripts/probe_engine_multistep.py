"""Probe (issue 32): is the engine's tensor-parallel decode step bound by its launch? k of its greedy batch-1 decode
steps chained in one jitted program (each step's token fed to the next, the same positions: it rewrites one KV
slot, fine for timing), launched back to back. ms a step = ms a launch / k: what multi-step decode would buy.

  XLA_PYTHON_CLIENT_MEM_FRACTION=0.94 PYTHONPATH=$PWD python3 scripts/probe_engine_multistep.py --out $OUT
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import numpy as np


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="llama2-13b")
    p.add_argument("--tensor-parallel", type=int, default=4)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--steps", type=int, nargs="+", default=[1, 2, 1])
    p.add_argument("--reps", type=int, default=24)
    p.add_argument("--num-blocks", type=int, default=64)
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from sharding.xla_flags import add_tensor_parallel_flags

    add_tensor_parallel_flags(args.tensor_parallel)
    import jax
    from jaxllm import LLM, EngineOptions
    from jaxllm.contract import SamplingParams
    from jaxllm.engine.core import Request
    from jaxllm.executor.step import decode_step

    llm = LLM(args.model, dtype=None if args.dry_run else "bfloat16", allow_long_context=True,
              max_context=args.context + 64, progress=False,
              options=EngineOptions(tensor_parallel=args.tensor_parallel, max_seqs=1, max_logprobs=0,
                                    penalties=False, num_blocks=args.num_blocks))
    prompt = np.random.default_rng(1).integers(3, 259, size=args.context).tolist()
    llm.core.add(Request(prompt, SamplingParams(max_new_tokens=48, ignore_eos=True)))
    produced = 0
    while produced < 2:  # the prefill, then a decode step
        produced += sum(len(out.token_ids) for out in llm.core.step())
    llm.core.drain()
    executor, plan = llm.executor, llm.scheduler.plan()
    batch = executor.layout.build(plan)
    io = executor.programs.io_sharding
    inputs = jax.tree.map(lambda x: jax.device_put(x, io), batch.inputs)
    kernels = executor.kernels_for(True, batch.size)
    graphdef, state = executor.programs.graphdef, executor.state
    pool = executor.kv_cache

    rows = []
    for k in args.steps:
        def program(state, pool, inputs, k=k):
            local = jax.tree.map(lambda x: x[0], inputs)
            for _ in range(k):
                tokens, pool, _ = decode_step(graphdef, state, pool, local, None, kernels=kernels, greedy=True)
                local = dataclasses.replace(local, tokens=tokens.astype(local.tokens.dtype).reshape(local.tokens.shape))
            return local.tokens[None], pool

        step = jax.jit(program, donate_argnums=(1,))
        start = time.perf_counter()
        tokens, pool = step(state, pool, inputs)
        tokens.block_until_ready()
        compile_s = time.perf_counter() - start
        times = []
        launches = max(1, args.reps // k)
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(launches):
                tokens, pool = step(state, pool, dataclasses.replace(inputs, tokens=tokens))
            tokens.block_until_ready()
            times.append((time.perf_counter() - start) / (launches * k) * 1e3)
        rows.append(dict(steps_per_launch=k, ms_per_step=float(np.median(times)), ms_all=times, compile_s=compile_s))
        print(f"[engine-multistep] {k} step(s) a launch: {np.median(times):.3f} ms a step (compile {compile_s:.0f} s)",
              flush=True)
    device = jax.devices()[0].device_kind
    result = dict(script="scripts/probe_engine_multistep.py (git history)", device=device, devices=jax.device_count(),
                  jax=jax.__version__, argv=sys.argv[1:], xla_flags=os.environ.get("XLA_FLAGS"), model=args.model,
                  tensor_parallel=args.tensor_parallel, context=args.context, rows=rows)
    stamp = time.strftime("%Y-%m-%d-%H%M", time.gmtime())
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"{device.lower().replace(' ', '-')}-{stamp}-probe-engine-multistep.json")
    with open(path, "w") as fh:
        json.dump(result, fh, indent=1)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
