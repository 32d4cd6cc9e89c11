"""Probe: can the decode step skip sampling's full-vocab sort when every row is greedy, with a
device-side lax.cond, without a host round trip per step?

Times, for logits [rows, 32000] f32: the engine's sample_tokens; the same under
lax.cond(any(temperature > 0), sample_tokens, argmax); argmax alone. Each call is chained on the
previous one's output (as decode steps are) and dispatched without waiting: wall time per call over
200 calls (a host sync per call would show up here), and kernel time per call from a trace.

Usage (GPU machine, repo root): PYTHONPATH=$PWD python3 benchmarks/experiments/session8-probes/cond_sampling.py
"""

from __future__ import annotations

import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "scripts"))
from device_trace import gpu_kernel_events  # noqa: E402
from jaxllm.sampling import sample_tokens  # noqa: E402


def main():
    vocab = 32000
    rows_list = (1, 8, 64)
    out = []
    for rows in rows_list:
        logits = jax.random.normal(jax.random.key(0), (rows, vocab), jnp.float32)
        top_k = jnp.zeros((rows,), jnp.int32)
        top_p = jnp.ones((rows,), jnp.float32)
        seeds = jnp.arange(rows, dtype=jnp.int32)

        def greedy(logits, temperature, positions):
            return jnp.argmax(logits, axis=-1).astype(jnp.int32)

        def full(logits, temperature, positions):
            return sample_tokens(logits, temperature, top_k, top_p, seeds, positions)

        def cond(logits, temperature, positions):
            return jax.lax.cond(jnp.any(temperature > 0), full, greedy, logits, temperature, positions)

        for temp_value in (0.0, 0.7):
            temperature = jnp.full((rows,), temp_value, jnp.float32)
            for name, fn in (("sort always", full), ("cond", cond), ("argmax only", greedy)):
                @jax.jit
                def step(logits, positions, temperature, fn=fn):
                    tok = fn(logits, temperature, positions)
                    # The next step's logits depend on this step's tokens (a chain, as in decoding).
                    return logits + (tok[:, None] == 0).astype(jnp.float32) * 1e-3, positions + 1, temperature

                # temperature is an argument: as a constant XLA would fold the branch away.
                state = (logits, jnp.zeros((rows,), jnp.int32), temperature)
                state = jax.block_until_ready(step(*state))
                t = time.perf_counter()
                for _ in range(200):
                    state = step(*state)
                jax.block_until_ready(state)
                wall_us = (time.perf_counter() - t) / 200 * 1e6
                events = gpu_kernel_events(lambda: step(*state), 20)
                kernel_us = sum(d for _, _, d in events) / 20 / 1e3
                row = dict(rows=rows, temperature=temp_value, impl=name, wall_us_per_call=round(wall_us, 1),
                           kernel_us_per_call=round(kernel_us, 1), kernels_per_call=len(events) / 20,
                           names=sorted({n[:30] for n, _, _ in events})[:12])
                print(row, flush=True)
                out.append(row)
    with open(os.path.join(os.environ.get("OUT", "."), "cond_sampling.json"), "w") as f:
        json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__, rows=out), f, indent=1)


if __name__ == "__main__":
    main()
