"""What sampling costs a decode step: the sampler (full-vocabulary sort) against the greedy argmax.

  PYTHONPATH=$PWD python3 scripts/bench_sampling.py [--out DIR] [--vocab 32000] [--rows 1 8 64]

For logits [rows, vocab] float32 it times, per row count: `sampling.sample_tokens` (what a step with
any sampled request runs), the same under a device-side `lax.cond` on "any row samples" (the
alternative to the runner's static greedy-only step variant), and `sampling.greedy_tokens` (what the
greedy-only variant runs), each with all rows at temperature 0 and at 0.7 (passed as arguments, so
XLA cannot fold a branch away). Each call feeds the next (as decode steps do) and is dispatched
without waiting: wall us per call over 200 calls (a host round trip per call would show there), and
kernel us per call from a profiler trace, with the kernels that copy memory to or from the host.
Writes `<device>-<date>-<HHMM>-sampling.json` under --out (default benchmarks/results/).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

import jax
import jax.numpy as jnp

from jaxllm.executor.sampler import greedy_tokens, sample_tokens
from scripts.common import harness
from scripts.common.device_trace import gpu_kernel_events


def _impls(rows: int):
    top_k = jnp.zeros((rows,), jnp.int32)
    top_p = jnp.ones((rows,), jnp.float32)
    seeds = jnp.arange(rows, dtype=jnp.int32)

    def sampler(logits, temperature, positions):
        return sample_tokens(logits, temperature, top_k, top_p, seeds, positions)

    def greedy(logits, temperature, positions):
        return greedy_tokens(logits)

    def cond(logits, temperature, positions):
        return jax.lax.cond(jnp.any(temperature > 0), sampler, greedy, logits, temperature, positions)

    return {"sampler": sampler, "lax.cond": cond, "greedy": greedy}


def time_impl(fn, logits, temperature, calls: int = 200, traced: int = 20) -> dict:
    @jax.jit
    def step(logits, positions, temperature):
        tokens = fn(logits, temperature, positions)
        # The next call's logits depend on this call's tokens, as the next decode step's do.
        return logits + (tokens[:, None] == 0).astype(jnp.float32) * 1e-3, positions + 1, temperature

    state = jax.block_until_ready(step(logits, jnp.zeros((logits.shape[0],), jnp.int32), temperature))
    start = time.perf_counter()
    for _ in range(calls):
        state = step(*state)
    jax.block_until_ready(state)
    wall_us = (time.perf_counter() - start) / calls * 1e6
    events = gpu_kernel_events(lambda: step(*state), traced)
    return dict(wall_us_per_call=round(wall_us, 1),
                kernel_us_per_call=round(sum(d for _, _, d in events) / traced / 1e3, 1),
                kernels_per_call=len(events) / traced,
                host_copies=sorted({n for n, _, _ in events if "D2H" in n or "H2D" in n}))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                      "benchmarks", "results"))
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64])
    args = parser.parse_args(argv)
    device = harness.device_kind()
    date = datetime.date.today().isoformat()
    rows_out = []
    for rows in args.rows:
        logits = jax.random.normal(jax.random.key(rows), (rows, args.vocab), jnp.float32)
        for temp in (0.0, 0.7):
            temperature = jnp.full((rows,), temp, jnp.float32)
            for name, fn in _impls(rows).items():
                row = dict(rows=rows, temperature=temp, impl=name, **time_impl(fn, logits, temperature))
                print(row, flush=True)
                rows_out.append(row)
    result = dict(script="scripts/bench_sampling.py", argv=sys.argv[1:] if argv is None else argv, device=device,
                  date=date, jax=jax.__version__, vocab=args.vocab, rows=rows_out)
    path = os.path.join(args.out, harness.result_stem(device, "sampling", date) + ".json")
    harness.write_json(path, result)
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
