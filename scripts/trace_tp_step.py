"""Where a tensor-parallel decode step's time goes: a device trace per GPU at TP 1/2/4, and the step's collectives.

  XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 PYTHONPATH=$PWD python3 scripts/trace_tp_step.py --model llama2-13b \\
      --tp-sizes 1 2 4 --contexts 4096

For each tensor-parallel size (one engine each, random bf16 weights, batch 1) and each of --contexts, one sequence
of that many tokens is prefilled, then:
  engine_ms   the engine core's pipelined loop: ms between two steps' tokens reaching the host
  bare_ms     the same greedy decode step dispatched back to back as continuations, no scheduler (it rewrites
              one KV slot each time: fine for timing), ms a step
  floor_ms    (weights + KV of the context) / tp read at the card's HBM bandwidth
and, from a jax.profiler trace of --reps bare steps, per GPU: kernels a step, their time, the span, the idle time
(span minus the union of kernel intervals), kernel time by kind (matmul, attention, collective, other),
collectives by NCCL kernel, and the largest idle gaps by the kernel that follows them; and what the host threads
did meanwhile (time a step per thread, the heaviest event names). A launch thread's time includes waiting on busy
GPUs (cuGraphLaunch blocks then), so read it beside the GPUs' busy time, not as host work. From XLA's optimized HLO of
the step (ModelRunner.compiled_step_text), every collective with its shape and the jax operation it comes from
(op_name), and the resharding the partitioner inserted (all-gathers, all-to-alls, collective-permutes).
The product's tensor-parallel XLA flags (sharding.xla_flags) are set before JAX starts unless --no-xla-flags, as
`python -m jaxllm.generate --tensor-parallel N` sets them (for the whole process: a TP 1 row runs with them too).
--num-blocks fixes each engine's pool (the memory plan's extra compiles are skipped). --dry-run: the tiny model on
CPU host devices (no GPU trace; the HLO part still runs). Writes JSON to --out after each row.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import sys
import time
from collections import Counter

import numpy as np

from scripts.common import harness
from scripts.common.device_trace import device_summary

# One HLO instruction producing a collective: `%name = shape kind(` with kind maybe `-start` (async on GPU).
# Async ones return a tuple shape, with spaces and maybe nested: `((s32[1]{0}), s32[4]{0})`.
_HLO_COLLECTIVE = re.compile(r"= (.*?) (all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)"
                             r"(?:-start)?\(")
_OP_NAME = re.compile(r'op_name="([^"]*)"')


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def hlo_collectives(text: str) -> dict:
    """Collectives in optimized HLO text: counts by (kind, shape, op_name), and the resharding ones."""
    found = Counter()
    for line in text.splitlines():
        match = _HLO_COLLECTIVE.search(line)
        if match:
            op = _OP_NAME.search(line)
            found[(match.group(2), match.group(1), op.group(1) if op else "")] += 1
    rows = [{"kind": k, "shape": shape, "op_name": op, "count": n} for (k, shape, op), n in found.most_common()]
    by_kind = Counter()
    for (kind, _, _), n in found.items():
        by_kind[kind] += n
    return {"by_kind": dict(by_kind), "ops": rows,
            "resharding": sum(n for (kind, _, _), n in found.items() if kind != "all-reduce")}


def _weight_bytes(llm) -> int:
    import jax

    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(llm.executor.worker.state))


def trace_engine(args, tp: int, floor_tb_s: float | None, on_row=lambda row: None) -> list[dict]:
    """One engine split `tp` ways; a row (see the module docstring) for each of --contexts, on_row(row) after each."""
    import jax

    from jaxllm import LLM, EngineOptions

    _log(f"[trace] {args.model} at tensor parallel {tp}, contexts {args.contexts}")
    llm = LLM(args.model, dtype=None if args.dry_run else "bfloat16", allow_long_context=True,
              progress=not args.dry_run, max_context=max(args.contexts) + 20 * args.reps + 64,
              options=EngineOptions(tensor_parallel=tp, max_seqs=1, max_logprobs=0, penalties=False,
                                    num_blocks=args.num_blocks))
    rows = []
    for context in args.contexts:
        rows.append(trace_one(args, llm, tp, context, floor_tb_s))
        on_row(rows[-1])
    llm.close()
    del llm
    gc.collect()
    jax.clear_caches()
    return rows


def trace_one(args, llm, tp: int, context: int, floor_tb_s: float | None) -> dict:
    from scripts.common.device_trace import events_by_device, host_summary, traced
    from jaxllm.contract import SamplingParams
    from jaxllm.engine.core import Request
    from jaxllm.model.kv_cache import kv_bytes_per_block

    _log(f"[trace] TP {tp}, context {context}")
    prompt = np.random.default_rng(1).integers(3, 259, size=context).tolist()
    request_id = llm.core.add(Request(prompt, SamplingParams(max_new_tokens=20 * args.reps + 32, ignore_eos=True)))
    produced = 0
    while produced < 2:  # the prefill, then a decode step
        produced += sum(len(out.token_ids) for out in llm.core.step() if out.request_id == request_id)
    llm.core.drain()

    gaps, last = [], time.perf_counter()
    while len(gaps) <= args.reps:  # the engine's pipelined loop
        llm.core.step()
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
    llm.core.drain()
    row = {"tensor_parallel": tp, "context": context, "engine_ms": float(np.median(gaps[1:]) * 1e3)}

    executor, plan = llm.executor, llm.scheduler.plan()

    def bare(reps: int):
        step = executor.dispatch(plan)
        for _ in range(reps - 1):
            step = executor.dispatch(plan, token_source=step)
        step.tokens()

    bare(3)
    start = time.perf_counter()
    bare(args.reps)
    row["bare_ms"] = (time.perf_counter() - start) / args.reps * 1e3
    info = llm.info()
    kv_token = kv_bytes_per_block(executor.worker.config, info.block_size, info.kv_dtype) / info.block_size
    weights = _weight_bytes(llm)
    row["weight_bytes"] = weights
    row["floor_ms"] = (1e3 * (weights + context * kv_token) / tp / (floor_tb_s * 1e12)) if floor_tb_s else None
    row["bare_x_floor"] = row["bare_ms"] / row["floor_ms"] if row["floor_ms"] else None

    data = traced(lambda: bare(args.reps), host_detail=True)
    per_device = sorted(events_by_device(data).items())
    row["devices"] = {name: device_summary(events, args.reps) for name, events in per_device}
    row["host"] = host_summary(data, args.reps)
    row["hlo"] = hlo_collectives(executor.compiled_step_text(plan))
    llm.core.cancel(request_id)
    llm.core.drain()
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default llama2-13b (tiny with --dry-run)")
    p.add_argument("--tp-sizes", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--contexts", type=int, nargs="+", default=[4096])
    p.add_argument("--num-blocks", type=int, default=None, help="rBlocks of each engine's pool (default: the plan)")
    p.add_argument("--xla-flags", action=argparse.BooleanOptionalAction, default=True,
                   help="set the product's tensor-parallel XLA flags (sharding.xla_flags) before JAX starts")
    p.add_argument("--reps", type=int, default=24)
    p.add_argument("--dry-run", action="store_true", help="the tiny model on CPU host devices")
    p.add_argument("--out", default=harness.RESULTS_DIR)
    args = p.parse_args(argv)
    args.model = args.model or ("tiny" if args.dry_run else "llama2-13b")
    if args.xla_flags:
        from sharding.xla_flags import add_tensor_parallel_flags

        add_tensor_parallel_flags(max(args.tp_sizes))  # as the entry points do, before JAX's backend starts

    import jax

    device = harness.device_kind()
    floor_tb_s = harness.hbm_floor_tb_s(device)
    sizes = [n for n in args.tp_sizes if n <= jax.device_count()]
    if sizes != args.tp_sizes:
        _log(f"[trace] {jax.device_count()} devices: skipping tensor-parallel sizes {sorted(set(args.tp_sizes) - set(sizes))}")
    result = {"script": "scripts/trace_tp_step.py", "argv": sys.argv[1:], "device": device, "devices": jax.device_count(),
              "date": harness.today(), "jax": jax.__version__, "model": args.model,
              "xla_flags": os.environ.get("XLA_FLAGS", ""), "rows": []}
    kind = "dry-run" if args.dry_run else f"x{jax.device_count()}"
    path = f"{args.out}/{harness.result_stem(device, f'trace-tp-{kind}.json', result['date'])}"

    def keep(row: dict) -> None:  # after each row: a run stopped at its limit keeps what it measured
        result["rows"].append(row)
        harness.write_json(path, result)

    for tp in sizes:
        trace_engine(args, tp, floor_tb_s, on_row=keep)

    print(f"{'TP':>3} {'context':>8} {'engine ms':>10} {'bare ms':>8} {'floor ms':>9} {'x floor':>8}  HLO collectives")
    for r in result["rows"]:
        floor = f"{r['floor_ms']:9.2f}" if r["floor_ms"] else f"{'-':>9}"
        ratio = f"{r['bare_x_floor']:8.2f}" if r["bare_x_floor"] else f"{'-':>8}"
        print(f"{r['tensor_parallel']:>3} {r['context']:>8} {r['engine_ms']:>10.2f} {r['bare_ms']:>8.2f} {floor} "
              f"{ratio}  {r['hlo']['by_kind']}")
        for name, d in r["devices"].items():
            kinds = ", ".join(f"{k} {v['us_per_step']:.0f}" for k, v in sorted(d["by_kind"].items()))
            print(f"    {name}: {d['kernels_per_step']:.0f} kernels, {d['kernel_us_per_step']:.0f} us of kernels, busy "
                  f"{d['busy_us_per_step']:.0f} of a {d['span_us_per_step']:.0f} us span (idle "
                  f"{d['idle_us_per_step']:.0f}); {kinds}")
            for g in d["idle_gaps_before"][:4]:
                print(f"        idle {g['us_per_step']:7.1f} us ({g['gaps_per_step']:.0f} gaps) before {g['kernel'][:70]}")
        for thread, us in list(r["host"].get("threads_us_per_step", {}).items())[:6]:
            print(f"    host {thread}: {us:.0f} us a step")
        for e in r["host"].get("events", [])[:12]:
            print(f"        {e['us_per_step']:7.1f} us ({e['calls_per_step']:.1f} calls) {e['name'][:80]}")
    _log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
