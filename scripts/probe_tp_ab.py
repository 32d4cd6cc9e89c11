"""Probe (issue 32): A/B of two source trees' tensor-parallel decode step on one machine: the bare step's ms and
GPU 0's kernels a step, each tree in its own process (its own code), trees taking turns.

  PYTHONPATH=$PWD python3 scripts/probe_tp_ab.py --tree old=.ab/old --tree new=. --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CHILD = r"""
import json, sys, time
import numpy as np
sys.path.insert(0, "scripts")
from common.device_trace import TraceWindow, device_summary, events_by_device
from jaxllm import LLM, EngineOptions
from jaxllm.contract import SamplingParams
from jaxllm.engine.core import Request
model, tp, context, reps, dry = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1"
llm = LLM(model, dtype=None if dry else "bfloat16", allow_long_context=True, progress=False,
          max_context=context + 200 * reps, options=EngineOptions(tensor_parallel=tp, max_seqs=1, max_logprobs=0,
          penalties=False, num_blocks=64 if not dry else 64))
prompt = np.random.default_rng(1).integers(3, 259, size=context).tolist()
rid = llm.core.add(Request(prompt, SamplingParams(max_new_tokens=200 * reps, ignore_eos=True)))
produced = 0
while produced < 2:
    produced += sum(len(o.token_ids) for o in llm.core.step() if o.request_id == rid)
llm.core.drain()
executor, plan = llm.executor, llm.scheduler.plan()
def bare(n):
    step = executor.dispatch(plan)
    for _ in range(n - 1):
        step = executor.dispatch(plan, token_source=step)
    step.tokens()
bare(3)
times = []
for _ in range(5):
    t = time.perf_counter(); bare(reps); times.append((time.perf_counter() - t) / reps * 1e3)
window = TraceWindow(); window.start(); bare(reps); data = window.stop()
kernels = {}
per_device = sorted(events_by_device(data).items())
if per_device:
    name, events = per_device[0]
    d = device_summary(events, reps)
    kernels = {k: d[k] for k in ("kernels_per_step", "kernel_us_per_step", "span_us_per_step", "idle_us_per_step")}
    kernels["by_kind"] = d["by_kind"]
print("RESULT " + json.dumps(dict(bare_ms=sorted(times)[len(times) // 2], runs_ms=times, gpu0=kernels)))
"""


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--tree", action="append", required=True, help="NAME=PATH")
    p.add_argument("--model", default="llama2-7b")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--reps", type=int, default=16)
    p.add_argument("--turns", type=int, default=1)
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--timeout", type=int, default=200)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    trees = [t.split("=", 1) for t in args.tree]
    results = {name: [] for name, _ in trees}
    for turn in range(args.turns):
        for name, path in (trees if turn % 2 == 0 else trees[::-1]):
            env = dict(os.environ, PYTHONPATH=os.path.abspath(path))
            if args.dry_run:
                env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=4")
            try:
                proc = subprocess.run([sys.executable, "-c", CHILD, args.model, str(args.tp), str(args.context),
                                       str(args.reps), "1" if args.dry_run else "0"], cwd=os.path.abspath(path),
                                      env=env, capture_output=True, text=True, timeout=args.timeout)
            except subprocess.TimeoutExpired:
                print(f"{name}: timed out", flush=True)
                continue
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if not lines:
                print(f"{name}: failed\n{proc.stderr[-3000:]}", flush=True)
                continue
            results[name].append(json.loads(lines[-1][7:]))
            r = results[name][-1]
            print(f"{name}: bare {r['bare_ms']:.3f} ms, GPU 0 {r['gpu0'].get('kernels_per_step')} kernels a step, "
                  f"{r['gpu0'].get('kernel_us_per_step')} us of kernels", flush=True)
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "probe-tp-ab.json"), "w") as f:
                json.dump(dict(argv=sys.argv[1:], results=results), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
