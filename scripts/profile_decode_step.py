"""Where a batch-1 decode step's time goes: scheduler, host padding/dispatch, device work, attention.

  XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 PYTHONPATH=$PWD python3 scripts/profile_decode_step.py --contexts 1024 32768

For each context it prefills one sequence of the Llama-2-7B shape (random bf16 weights), then
times the same decode step six ways (median ms):
  full          the engine core's loop (EngineCore.step), which queues the next decode step before reading
                this one's tokens: the gap between steps' tokens (what generation pays per token)
  full_sync     the same loop waiting for every step's tokens before the next dispatch
  scheduler     Scheduler.plan + update alone (pure Python)
  pipelined     the jitted step called back to back without waiting (device time per step)
  synced        the jitted step, waiting for each result (device + dispatch + sync latency)
  attention     32 ragged_decode calls on this context inside one jit (the step's attention share)
and, from a jax.profiler trace of `reps` back-to-back steps, the device kernels of one step: how
many, their summed time, the idle gaps between them, and the heaviest kernels by total time.
Writes JSON to --out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import numpy as np

from scripts.common import harness


def _median_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(np.median(times) * 1e3)


_MATMUL_WORDS = ("gemm", "gemv", "xmma", "cublas", "cutlass", "wgmma", "nvjet", "skinny_matmul")


def _kernel_kind(name: str) -> str:
    lowered = name.lower()
    if any(w in lowered for w in _MATMUL_WORDS):
        return "matmul"
    return "attention" if "ragged" in lowered else "other"


def device_kernels(fn, reps: int, top: int = 60) -> dict:
    """Kernel time per step from a profiler trace of `reps` calls of fn (GPU planes only)."""
    from collections import defaultdict

    from scripts.common.device_trace import gpu_kernel_events, per_kernel_us

    events = gpu_kernel_events(fn, reps)
    if not events:
        return {"error": "no GPU kernels in the trace"}
    by_kind = defaultdict(lambda: [0.0, 0])
    for name, _, duration_ns in events:
        kind = by_kind[_kernel_kind(name)]
        kind[0] += duration_ns
        kind[1] += 1
    first = min(start for _, start, _ in events)
    last = max(start + duration for _, start, duration in events)
    heaviest = sorted(per_kernel_us(events, reps).items(), key=lambda kv: -kv[1])[:top]
    calls = defaultdict(int)
    for name, _, _ in events:
        calls[name] += 1
    # The time from the previous kernel's end to each kernel's start (negative where they overlap, as
    # XLA's programmatic dependent launches do): the launch bubbles a fused or PDL-launched kernel removes.
    gap_ns = defaultdict(float)
    ordered = sorted(events, key=lambda e: e[1])
    for (_, start0, duration0), (name, start, _) in zip(ordered, ordered[1:]):
        gap_ns[name] += start - (start0 + duration0)
    return {"kernels_per_step": len(events) / reps,
            "kernel_ms_per_step": sum(t for t, _ in by_kind.values()) / reps / 1e6,
            "span_ms_per_step": (last - first) / reps / 1e6,
            "by_kind": {k: {"us_per_step": t / reps / 1e3, "kernels_per_step": n / reps}
                        for k, (t, n) in by_kind.items()},
            "top": [{"name": n[:120], "us_per_step": us, "calls_per_step": calls[n] / reps,
                     "gap_before_us_per_step": gap_ns[n] / reps / 1e3} for n, us in heaviest]}


def profile(llm, context: int, reps: int) -> dict:
    import jax
    import jax.numpy as jnp

    from jaxllm.engine.core import Request
    from jaxllm.contract import SamplingParams, StepKind
    from jaxllm.executor.calls import Op, StepCall
    from pallas_kernels.ragged_decode import ragged_decode

    runner, scheduler = llm.executor, llm.scheduler
    prompt = np.random.default_rng(context).integers(3, 259, size=context).tolist()
    request_id = llm.core.add(Request(prompt, SamplingParams(max_new_tokens=10 * reps + 50, ignore_eos=True)))
    produced = 0
    while produced < 2:  # prefill, then decode steps
        produced += sum(len(out.token_ids) for out in llm.core.step() if out.request_id == request_id)
    llm.core.drain()

    def full_ms(pipeline: bool) -> float:
        llm.core.pipeline = pipeline
        gaps, last = [], time.perf_counter()
        while len(gaps) <= reps:
            llm.core.step()
            now = time.perf_counter()
            gaps.append(now - last)
            last = now
        llm.core.drain()  # returns with no step in flight
        return float(np.median(gaps[1:]) * 1e3)  # the first gap includes starting the pipeline

    row = {"context": context, "full_ms": full_ms(True), "full_sync_ms": full_ms(False)}
    llm.core.pipeline = True

    plan = scheduler.plan()
    sampled = runner.step(plan)
    row["scheduler_ms"] = _median_ms(lambda: (scheduler.update(plan, sampled, eos_id=-1), scheduler.plan()), 1)
    # Re-run one fixed decode step (it rewrites the same KV slot each time: fine for timing).
    runner.worker.launcher.drain()  # the worker's calls below run on this thread, with nothing else in flight
    inputs = runner.worker.place(runner.layout.build(plan).inputs)  # greedy: so are its sampling arrays
    s_pad = inputs.num_seqs
    # The sequence is greedy, so the engine runs the argmax-only decode variant: time that one.
    step_call = StepCall(Op.STEP, plan.kind, greedy=plan.kind is StepKind.DECODE)

    def call():
        return runner.worker.run(step_call, inputs)

    call().block_until_ready()
    t = time.perf_counter()
    for _ in range(reps):
        out = call()
    out.block_until_ready()
    row["pipelined_ms"] = (time.perf_counter() - t) / reps * 1e3
    row["synced_ms"] = _median_ms(lambda: np.asarray(call()), reps)
    row["trace"] = device_kernels(call, reps)

    layer = runner.worker.kv_cache.layers[0]
    q = jnp.asarray(np.random.default_rng(0).standard_normal((s_pad, llm.config.num_heads, llm.config.head_dim)),
                    jnp.bfloat16)

    @jax.jit
    def attention_32(q, k, v, tables, kv_lens):
        acc = jnp.zeros(q.shape, jnp.float32)
        for _ in range(llm.config.num_layers):  # one layer's pool 32 times: the step's attention work
            acc = acc + ragged_decode(q, k, v, tables, kv_lens).astype(jnp.float32)
            q = q + jnp.bfloat16(1e-3)
        return acc

    tables, kv_lens = inputs.block_tables, inputs.kv_lens
    attention_32(q, layer.k, layer.v, tables, kv_lens).block_until_ready()
    row["attention_ms"] = _median_ms(lambda: attention_32(q, layer.k, layer.v, tables, kv_lens).block_until_ready(),
                                     reps)
    llm.core.cancel(request_id)
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 32768])
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--model", default="llama2-7b")
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args(argv)

    import jax

    from jaxllm import LLM, EngineOptions

    pool_tokens = max(args.contexts) + 20 * args.reps + 512
    block_size = 256 if jax.default_backend() == "gpu" else 16
    options = EngineOptions(num_blocks=-(-pool_tokens // block_size) + 1, block_size=block_size)
    llm = LLM(args.model, dtype="bfloat16", max_context=pool_tokens, allow_long_context=True,  # random weights
              options=options)
    rows = []
    for context in args.contexts:
        rows.append(profile(llm, context, args.reps))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    device = jax.devices()[0].device_kind
    result = {"script": "scripts/profile_decode_step.py", "argv": sys.argv[1:], "device": device,
              "date": datetime.date.today().isoformat(), "jax": jax.__version__,
              "xla_flags": os.environ.get("XLA_FLAGS", ""), "rows": rows}
    print(f"{'context':>8} {'full':>7} {'full_sync':>9} {'sched':>7} {'pipelined':>10} {'synced':>7} "
          f"{'attention':>10}  (ms)")
    for r in rows:
        print(f"{r['context']:>8} {r['full_ms']:>7.2f} {r['full_sync_ms']:>9.2f} {r['scheduler_ms']:>7.2f} "
              f"{r['pipelined_ms']:>10.2f} {r['synced_ms']:>7.2f} {r['attention_ms']:>10.2f}")
    for r in rows:
        trace = r["trace"]
        if "error" in trace:
            print(f"context {r['context']}: trace: {trace['error']}")
            continue
        print(f"context {r['context']}: {trace['kernels_per_step']:.0f} kernels per step, "
              f"{trace['kernel_ms_per_step']:.2f} ms in kernels over a {trace['span_ms_per_step']:.2f} ms span")
        for kind, v in trace["by_kind"].items():
            print(f"  {kind:>10}: {v['kernels_per_step']:.0f} kernels, {v['us_per_step']:.1f} us")
        for k in trace["top"]:
            print(f"  {k['us_per_step']:>9.1f} us  {k.get('calls_per_step', 0):>5.0f} x  "
                  f"gaps before {k.get('gap_before_us_per_step', 0):>7.1f} us  {k['name']}")
    path = os.path.join(args.out, harness.result_stem(device, "decode-step-profile.json", result["date"]))
    harness.write_json(path, result)
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
