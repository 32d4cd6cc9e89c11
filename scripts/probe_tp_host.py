"""Probe (issue 32): where the host time of a tensor-parallel decode step goes, and whether XLA's command buffers
are on. Runs each variant (XLA flags) in its own process; per TP size: the bare step's ms, the jitted call's
host ms (how long programs.run takes to return), the launcher's ms a step, the host threads' busiest trace
events a step, GPU 0's kernels / span / idle, and how many command-buffer computations the step's HLO holds.

  PYTHONPATH=$PWD python3 scripts/probe_tp_host.py --out $OUT            (13B, TP 1 and 4, three flag variants)
  PYTHONPATH=$PWD python3 scripts/probe_tp_host.py --dry-run --out /tmp  (tiny model on 4 CPU host devices)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import defaultdict

VARIANTS = {  # name: (XLA flags, other environment)
    "base": ("", {}),
    "cmdbuf_all": ("--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,COLLECTIVES "
                   "--xla_gpu_graph_min_graph_size=1", {}),
    "cmdbuf_off": ("--xla_gpu_enable_command_buffer=", {}),
    "nccl_ll": ("", {"NCCL_PROTO": "LL"}),
    "cb_sync_ar": ("--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,COLLECTIVES "
                   "--xla_gpu_graph_min_graph_size=1 --xla_gpu_disable_async_collectives=ALLREDUCE", {}),
    "cb_sync_nccl": ("--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,COLLECTIVES "
                     "--xla_gpu_graph_min_graph_size=1 --xla_gpu_disable_async_collectives=ALLREDUCE "
                     "--xla_gpu_unsupported_use_all_reduce_one_shot_kernel=false", {}),
}
_NCCL_IN_GRAPH = ("--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,COLLECTIVES "
                  "--xla_gpu_graph_min_graph_size=1 --xla_gpu_unsupported_use_all_reduce_one_shot_kernel=false")
for _mode in ("NEVER_UPDATE", "CAPTURE_CMD_NEVER_UPDATE", "SKIP_TEMP", "SKIP_PROFILED", "VMM_PERSISTENT_TEMP"):
    VARIANTS[f"um_{_mode}"] = (f"--xla_gpu_command_buffer_update_mode={_mode}", {})
    VARIANTS[f"um_{_mode}_nccl"] = (f"--xla_gpu_command_buffer_update_mode={_mode} {_NCCL_IN_GRAPH}", {})
    VARIANTS[f"um_{_mode}_coll"] = (f"--xla_gpu_command_buffer_update_mode={_mode} --xla_gpu_enable_command_buffer="
                                    "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,COLLECTIVES --xla_gpu_graph_min_graph_size=1", {})


def _log(msg):
    print(msg, file=sys.stderr, flush=True)


def host_summary(data, reps: int, top: int = 25) -> dict:
    """Per host thread (line): its events summed by name, ms per step, the busiest `top`."""
    out = {}
    for plane in data.planes:
        if not plane.name.startswith("/host"):
            continue
        for line in plane.lines:
            totals = defaultdict(lambda: [0.0, 0])
            for e in line.events:
                totals[e.name[:90]][0] += e.duration_ns
                totals[e.name[:90]][1] += 1
            if not totals:
                continue
            busiest = sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]
            out[f"{plane.name}|{line.name}"] = [(name, round(ns / reps / 1e6, 3), round(n / reps, 2))
                                                for name, (ns, n) in busiest]
    return out


def worker(args) -> None:
    import jax
    import numpy as np

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from common.device_trace import TraceWindow, device_summary, events_by_device
    from jaxllm import LLM, EngineOptions
    from jaxllm.contract import SamplingParams
    from jaxllm.engine.core import Request

    rows = []
    for tp in args.tp_sizes:
        if tp > jax.device_count():
            continue
        t0 = time.perf_counter()
        llm = LLM(args.model, dtype=None if args.dry_run else "bfloat16", allow_long_context=True, progress=False,
                  max_context=args.context + 40 * args.reps + 64,
                  options=EngineOptions(tensor_parallel=tp, num_blocks=args.num_blocks, max_seqs=1, max_logprobs=0, penalties=False,
                                        compile_cache_dir=None if args.dry_run else "/tmp/jaxllm-probe-cc"))
        prompt = np.random.default_rng(1).integers(3, 259, size=args.context).tolist()
        rid = llm.core.add(Request(prompt, SamplingParams(max_new_tokens=40 * args.reps + 32, ignore_eos=True)))
        first_tokens = []
        while len(first_tokens) < 8:
            first_tokens += [t for o in llm.core.step() if o.request_id == rid for t in o.token_ids]
        llm.core.drain()
        build_s = time.perf_counter() - t0
        executor, plan = llm.executor, llm.scheduler.plan()

        def bare(reps):
            step = executor.dispatch(plan)
            for _ in range(reps - 1):
                step = executor.dispatch(plan, token_source=step)
            step.tokens()

        bare(3)
        start = time.perf_counter()
        bare(args.reps)
        bare_ms = (time.perf_counter() - start) / args.reps * 1e3

        run_ms, launch_ms = [], []
        programs = executor.programs
        original_run, original_launch = programs.run, executor._launch

        def timed_run(*a, **k):
            t = time.perf_counter()
            r = original_run(*a, **k)
            run_ms.append((time.perf_counter() - t) * 1e3)
            return r

        def timed_launch(*a, **k):
            t = time.perf_counter()
            r = original_launch(*a, **k)
            launch_ms.append((time.perf_counter() - t) * 1e3)
            return r

        programs.run, executor._launch = timed_run, timed_launch
        bare(args.reps)
        programs.run, executor._launch = original_run, original_launch

        window = TraceWindow()
        window.start()
        bare(args.reps)
        data = window.stop()
        devices = {}
        host = {}
        if data is not None:
            per_device = events_by_device(data)
            for name, events in sorted(per_device.items())[:2]:
                d = device_summary(events, args.reps, top=8)
                d.pop("heaviest")
                devices[name] = d
            host = host_summary(data, args.reps)
        text = executor.compiled_step_text(plan)
        row = {"variant": args.variant, "tp": tp, "build_s": build_s, "bare_ms": bare_ms, "first_tokens": first_tokens,
               "run_call_ms_median": float(np.median(run_ms)), "run_call_ms_p90": float(np.percentile(run_ms, 90)),
               "launch_ms_median": float(np.median(launch_ms)),
               "hlo_command_buffers": text.count("command_buffer"), "hlo_custom_calls": text.count("custom-call("),
               "hlo_fusions": text.count(" fusion("), "devices": devices, "host": host}
        rows.append(row)
        _log(f"[probe] {args.variant} TP {tp}: bare {bare_ms:.2f} ms, run call {row['run_call_ms_median']:.2f} ms, "
             f"launch {row['launch_ms_median']:.2f} ms, command_buffer mentions {row['hlo_command_buffers']}, "
             f"build {build_s:.0f} s, tokens {first_tokens}")
        with open(os.path.join(args.out, f"probe-{args.variant}-tp{tp}-hlo.txt"), "w") as f:
            f.write(text)
        with open(os.path.join(args.out, f"probe-{args.variant}.json"), "w") as f:
            json.dump(rows, f, indent=1)
        llm.core.cancel(rid)
        llm.close()
        del llm, executor, programs
        jax.clear_caches()


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--reps", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=None, help="rBlocks a layer (default: planned)")
    p.add_argument("--tp-sizes", type=int, nargs="+", default=None)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS))
    p.add_argument("--variant", default=None, help="(internal) run one variant in this process")
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--out", required=True)
    p.add_argument("--timeout", type=int, default=240)
    args = p.parse_args(argv)
    args.model = args.model or ("tiny" if args.dry_run else "llama2-13b")
    os.makedirs(args.out, exist_ok=True)
    if args.variant is not None:
        worker(args)
        return 0
    for name in args.variants:
        env = dict(os.environ)
        flags, extra = VARIANTS[name]
        env.update(extra)
        if args.dry_run:
            flags = "--xla_force_host_platform_device_count=4"
            env["JAX_PLATFORMS"] = "cpu"
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + flags).strip()
        sizes = args.tp_sizes or [1, 4]
        cmd = [sys.executable, __file__, "--variant", name, "--model", args.model, "--context", str(args.context),
               "--reps", str(args.reps), "--out", args.out, *(["--num-blocks", str(args.num_blocks)] if args.num_blocks else []), "--tp-sizes", *map(str, sizes)]
        if args.dry_run:
            cmd.append("--dry-run")
        _log(f"[probe] variant {name}: XLA_FLAGS={env['XLA_FLAGS']!r}")
        try:
            subprocess.run(cmd, env=env, timeout=args.timeout, check=False)
        except subprocess.TimeoutExpired:
            _log(f"[probe] variant {name} timed out after {args.timeout} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
