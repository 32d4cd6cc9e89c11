"""Probe: does the batch-1 add + RMSNorm kernel (5 float32 split-K partials summed first, as the
decode step's o / down projections hand them over) run faster with more warps per program?

Kernel time per call from a trace of 32 chained calls (as the 64 calls of a decode step), per
num_warps, for t = 1 and 8 token rows, d = 4096.

Usage (GPU machine, repo root): PYTHONPATH=$PWD python3 benchmarks/experiments/session8-probes/norm_warps.py
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "scripts"))
from device_trace import kernel_times  # noqa: E402
from pallas_kernels import compat  # noqa: E402
from pallas_kernels.rms_norm import add_rms_norm, default_block_sizes  # noqa: E402


def main():
    compat.silence_triton_deprecation()
    rows = []
    for t in (1, 8):
        d, parts = 4096, 5
        key = jax.random.key(t)
        x = jax.random.normal(key, (t, d), jnp.bfloat16)
        deltas = [jax.random.normal(jax.random.fold_in(key, i), (parts, t, d), jnp.float32) for i in range(32)]
        weight = jnp.ones((d,), jnp.bfloat16)
        base = default_block_sizes(t, d)
        for warps in (1, 2, 4, 8, 16):
            sizes = dataclasses.replace(base, num_warps=warps)

            @jax.jit
            def chain(x, deltas, sizes=sizes):
                for delta in deltas:  # each call's input is the previous call's output
                    normed, x = add_rms_norm(x, delta, weight, eps=1e-5, block_sizes=sizes)
                return normed, x

            times = kernel_times(lambda: chain(x, deltas), 10)
            us = sum(v for n, v in times.items() if "rms" in n) / 32
            row = dict(t=t, num_warps=warps, default=warps == base.num_warps, us_per_call=round(us, 2))
            print(row, flush=True)
            rows.append(row)
    with open(os.path.join(os.environ.get("OUT", "."), "norm_warps.json"), "w") as f:
        json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
