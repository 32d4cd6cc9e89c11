"""Probe: does a batch-1 matmul run faster when its weight was just read into L2?

At batch 1 the decode step's small kernels (attention at 1K, norms, RoPE, the KV write) leave HBM
mostly idle. If the next matmul's weight could be pulled into L2 during them, the matmul would read
part of its bytes from L2. Asked here, kernel times from a trace:
  cold:      flush (a 512 MB read) -> x @ W
  warm:      flush -> x @ W -> x' @ W           (the second matmul right after the first read W)
  prefetch:  flush -> prefetch(W) -> x @ W      (a Pallas kernel reads W and keeps only a sum)
for W [4096, N] bf16 of 16..64 MB (H200 L2: 50 MB).

Usage (GPU machine, repo root): PYTHONPATH=$PWD python3 benchmarks/experiments/session8-probes/l2_prefetch.py
"""

from __future__ import annotations

import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "scripts"))
from device_trace import gpu_kernel_events  # noqa: E402
from pallas_kernels import compat  # noqa: E402

CHUNK = 4096  # elements a program loads per step (8 KB of bf16)


def prefetch(w: jax.Array, programs: int = 264, num_stages: int = 3, interpret: bool = False) -> jax.Array:
    """Read all of w once (programs split its rows); returns one f32 per program so nothing is dropped."""
    flat = w.reshape(-1, CHUNK)
    rows = flat.shape[0]
    per = pl.cdiv(rows, programs)

    def kernel(w_ref, o_ref):
        i = pl.program_id(0)
        first = i * per

        def body(j, acc):
            r = jnp.minimum(first + j, rows - 1)
            return acc + jnp.where(first + j < rows, w_ref[r, :].astype(jnp.float32), 0.0)

        acc = jax.lax.fori_loop(0, per, body, jnp.zeros((CHUNK,), jnp.float32))
        o_ref[i] = jnp.sum(acc)

    return pl.pallas_call(
        kernel, grid=(programs,), out_shape=jax.ShapeDtypeStruct((programs,), jnp.float32),
        compiler_params=compat.triton_compiler_params(4, num_stages), interpret=interpret,
    )(flat)


def after(x, s):
    """x, ordered after s (XLA keeps x * 1 + s * 0 for floats)."""
    return (x.astype(jnp.float32) + 0 * s).astype(x.dtype)


def main():
    out_dir = os.environ.get("OUT", ".")
    big = jnp.ones((256 * 1024 * 1024,), jnp.bfloat16)  # 512 MB: more than 10x L2
    rows = []
    for n in (2048, 4096, 6144, 8192, 12288):
        w = jax.random.normal(jax.random.key(n), (4096, n), jnp.bfloat16)
        x = jax.random.normal(jax.random.key(1), (1, 4096), jnp.bfloat16)

        def flush(x):
            return after(x, jnp.sum(big.astype(jnp.float32)))

        @jax.jit
        def cold(x, w):
            return flush(x) @ w

        @jax.jit
        def warm(x, w):
            y = flush(x) @ w
            return after(x, y[0, 0].astype(jnp.float32)) @ w

        @jax.jit
        def prefetched(x, w):
            x = flush(x)
            p = prefetch(w)
            return after(x, p[0]) @ w, p

        for name, fn in (("cold", cold), ("warm", warm), ("prefetch", prefetched)):
            reps = 20
            events = gpu_kernel_events(lambda: fn(x, w), reps)
            per = len(events) // reps
            durs = np.array([d for _, _, d in events[:per * reps]]).reshape(reps, per) / 1e3
            names = [nm[:40] for nm, _, _ in events[:per]]
            row = dict(n=n, mb=4096 * n * 2 / 2**20, case=name,
                       kernels=[(nm, round(float(np.median(durs[:, i])), 2)) for i, nm in enumerate(names)])
            print(row, flush=True)
            rows.append(row)
    with open(os.path.join(out_dir, "l2_prefetch.json"), "w") as f:
        json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
