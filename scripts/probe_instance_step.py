"""Probe (removed after its run; one line in benchmarks/NOTES.md): where a decode step of I instances x 2
sequences spends its time, host and devices. Per I in (1, devices): host time per step in the scheduler's
continuation plan, the executor's input build, the jit call, the sampling-array placement, the token read
(wait included) and the update; per GPU, kernel time and span per step from a profiler trace.

  XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 PYTHONPATH=$PWD python3 scripts/probe_instance_step.py --out $OUT
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import sys
import tempfile
import time

import numpy as np


def timed(table, name, fn):
    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            table[name] += time.perf_counter() - t
    return wrapper


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="/tmp")
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--trace-steps", type=int, default=12)
    p.add_argument("--model", default="llama2-7b")
    args = p.parse_args()
    import jax

    from jaxllm import LLM, EngineOptions
    from jaxllm.contract import SamplingParams
    from jaxllm.engine.core import Request
    from jaxllm.executor import in_flight

    devices = jax.device_count()
    out = {"device": jax.devices()[0].device_kind, "devices": devices, "rows": []}
    for instances in sorted({1, devices}):
        llm = LLM(args.model, dtype="bfloat16", max_context=2048, progress=False,
                  options=EngineOptions(instances=instances, max_seqs=2, num_blocks=64, max_tokens_per_step=2048, block_size=256,
                                        prefix_caching=False))
        rng = np.random.default_rng(0)

        def requests(new):
            return [Request(rng.integers(3, 259, 1024).tolist(), SamplingParams(max_new_tokens=new, ignore_eos=True))
                    for _ in range(2 * instances)]

        llm.run(requests(8))  # compiles
        table = collections.defaultdict(float)
        sched, ex = llm.scheduler, llm.executor
        sched.plan_continuation = timed(table, "plan_continuation", sched.plan_continuation)
        sched.update = timed(table, "update", sched.update)
        ex.layout = type("L", (), {"build": staticmethod(timed(table, "build", ex.layout.build)),
                                   "inert": ex.layout.inert, "table_width": ex.layout.table_width})()
        ex.programs.run = timed(table, "jit_call", ex.programs.run)
        ex._placed = timed(table, "place", ex._placed)
        real_tokens = in_flight.InFlight.tokens
        in_flight.InFlight.tokens = timed(table, "tokens_wait", real_tokens)
        steps = []
        last = [time.perf_counter()]
        tmp = tempfile.mkdtemp()
        first, stop = 6, 6 + args.trace_steps  # decode steps traced (the prefill and the first decodes not)

        def on_step(_):
            now = time.perf_counter()
            steps.append(now - last[0])
            last[0] = now
            if len(steps) == first:
                jax.profiler.start_trace(tmp)
            elif len(steps) == stop:
                jax.profiler.stop_trace()

        llm.run(requests(args.steps), on_step=on_step)
        n = len(steps)
        row = {"instances": instances, "steps": n, "wall_ms_per_step": 1e3 * float(np.median(steps[4:])),
               "host_ms_per_step": {k: 1e3 * v / n for k, v in table.items()}}
        # Device side: kernel time and span per GPU over the traced steps.
        path = glob.glob(os.path.join(tmp, "**", "*.xplane.pb"), recursive=True)[0]
        data = jax.profiler.ProfileData.from_file(path)
        per_gpu = {}
        for plane in data.planes:
            if plane.name.startswith("/device:GPU"):
                events = [e for line in plane.lines if line.name.startswith("Stream") for e in line.events]
                if events:
                    busy = sum(e.duration_ns for e in events)
                    span = max(e.start_ns + e.duration_ns for e in events) - min(e.start_ns for e in events)
                    per_gpu[plane.name] = dict(kernels=len(events), busy_ms=busy / 1e6, span_ms=span / 1e6)
        row["trace"] = dict(steps=args.trace_steps, per_gpu={
            k: dict(v, busy_ms_per_step=v["busy_ms"] / args.trace_steps, span_ms_per_step=v["span_ms"] / args.trace_steps)
            for k, v in per_gpu.items()})
        in_flight.InFlight.tokens = real_tokens
        print(json.dumps(row), flush=True)
        out["rows"].append(row)
        llm.close()
        del llm
    with open(os.path.join(args.out, "probe-instance-step.json"), "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
