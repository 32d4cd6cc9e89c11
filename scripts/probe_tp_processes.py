"""Probe (issue 32): a tensor-parallel decode step run by one process per GPU instead of one process for all.

  PYTHONPATH=$PWD python3 scripts/launch.py --num-processes 4 --gpus-per-process 1 --timeout 300 -- \\
      python3 scripts/probe_tp_processes.py --model llama2-13b --tensor-parallel 4 --context 4096 --out $OUT

In one process, XLA launches each GPU's CUDA graph of the step from its own thread, and a step's host time (graph
update and launch, ~4 ms a device at 13B TP 4) is as long as its kernels. Here each process launches one GPU's.
Process 0 times batch-1 decode steps (the gap between two steps' tokens) of one --context prompt; the others
follow. Writes JSON to --out from process 0.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from jaxllm.mesh_flags import add_mesh_flags, is_leader, start_processes
from sharding.xla_flags import add_tensor_parallel_flags


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama2-13b")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--num-blocks", type=int, default=64)
    p.add_argument("--out", default="benchmarks/results")
    add_mesh_flags(p)
    args = p.parse_args(argv)
    add_tensor_parallel_flags(args.tensor_parallel)
    start_processes(args, p.prog)
    import jax

    from common import harness
    from jaxllm import LLM, EngineOptions
    from jaxllm.contract import SamplingParams
    from jaxllm.engine.core import Request

    llm = LLM(args.model, dtype="bfloat16", max_context=args.context + args.new_tokens + 1, allow_long_context=True,
              options=EngineOptions(tensor_parallel=args.tensor_parallel, max_seqs=1, num_blocks=args.num_blocks,
                                    max_logprobs=0, penalties=False), progress=is_leader())
    if not is_leader():
        llm.executor.follow()
        return 0
    decode, last = [], time.perf_counter()

    def on_step(_outputs) -> None:
        nonlocal last
        now = time.perf_counter()
        if llm.core.last_plan.is_decode:
            decode.append(now - last)
        last = now

    prompt = np.random.default_rng(1).integers(3, 259, size=args.context).tolist()
    for _ in range(2):  # the first pass compiles
        decode.clear()
        llm.run([Request(prompt, SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True))], on_step=on_step)
    ms = [1e3 * t for t in decode[2:]]
    device = harness.device_kind()
    result = {"script": "scripts/probe_tp_processes.py (git history)", "device": device, "date": harness.today(),
              "jax": jax.__version__, "argv": sys.argv[1:], "processes": jax.process_count(),
              "devices": jax.device_count(), "model": args.model, "tensor_parallel": args.tensor_parallel,
              "context": args.context, "decode_ms_per_token": float(np.median(ms)), "spread": harness.spread(ms)}
    path = f"{args.out}/{harness.result_stem(device, f'probe-tp-processes-p{jax.process_count()}.json', result['date'])}"
    harness.write_json(path, result)
    print(f"{args.model} TP {args.tensor_parallel} over {jax.process_count()} processes at {args.context}: "
          f"{result['decode_ms_per_token']:.2f} ms/token (min {result['spread']['min']:.2f}); wrote {path}", flush=True)
    llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
