"""Probe (issue 32): how much of a tensor-parallel step's time is its launch, measured by putting k steps in one
program. A 13B-shaped stack (40 layers of q/k/v, o, gate/up, down matmuls with two all-reduces a layer) over every
device under the product's tensor-parallel XLA flags; one program runs it k times in a row (each pass feeding the
next, as k decode steps would), launched back to back. ms a step = ms a launch / k: what k decode steps per launch
(multi-step decode) would buy where the host's per-launch work (graph record + launch, ~4 ms a GPU at TP 4) is
as long as the kernels.

  PYTHONPATH=$PWD python3 scripts/probe_multistep.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=40)
    p.add_argument("--hidden", type=int, default=5120)
    p.add_argument("--ffn", type=int, default=13824)
    p.add_argument("--steps", type=int, nargs="+", default=[1, 2, 4, 1])
    p.add_argument("--reps", type=int, default=24)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from sharding.xla_flags import add_tensor_parallel_flags

    add_tensor_parallel_flags(4)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()), ("tp",))
    n, h, f = args.layers, args.hidden, args.ffn
    col, row, rep = (NamedSharding(mesh, P(None, None, "tp")), NamedSharding(mesh, P(None, "tp", None)),
                     NamedSharding(mesh, P()))

    def init(key):
        k = jax.random.split(key, 4)
        return dict(qkv=jax.random.normal(k[0], (n, h, 3 * h // 4 * 4), jnp.bfloat16) * 0.02,
                    o=jax.random.normal(k[1], (n, h, h), jnp.bfloat16) * 0.02,
                    up=jax.random.normal(k[2], (n, h, 2 * f), jnp.bfloat16) * 0.02,
                    down=jax.random.normal(k[3], (n, f, h), jnp.bfloat16) * 0.02)

    shardings = dict(qkv=col, o=row, up=col, down=row)
    w = jax.jit(init, out_shardings=shardings)(jax.random.key(0))

    def one_pass(w, x):
        for i in range(n):
            a = x @ w["qkv"][i]  # [1, 3h] split over tp: the attention stand-in keeps each shard's own columns
            x = x + (a[:, :h] * jax.nn.sigmoid(a[:, h:2 * h])) @ w["o"][i]
            u = x @ w["up"][i]
            x = x + (jax.nn.silu(u[:, :f]) * u[:, f:]) @ w["down"][i]
            x = x / (1 + jnp.abs(x).max())
        return x

    x0 = jax.device_put(np.random.default_rng(0).standard_normal((1, h)).astype(np.float32).astype(jnp.bfloat16), rep)
    rows = []
    for k in args.steps:
        def program(w, x, k=k):
            for _ in range(k):
                x = one_pass(w, x)
            return x

        step = jax.jit(program, in_shardings=(shardings, rep), out_shardings=rep)
        x = step(w, x0)
        x.block_until_ready()
        times = []
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(max(1, args.reps // k)):
                x = step(w, x)
            x.block_until_ready()
            times.append((time.perf_counter() - start) / (max(1, args.reps // k) * k) * 1e3)
        rows.append(dict(steps_per_launch=k, ms_per_step=float(np.median(times)), ms_all=times))
        print(f"[multistep] {k} step(s) a launch: {np.median(times):.3f} ms a step", flush=True)
    result = dict(script="scripts/probe_multistep.py (git history)", devices=len(jax.devices()),
                  device=jax.devices()[0].device_kind, jax=jax.__version__, xla_flags=os.environ.get("XLA_FLAGS"),
                  layers=n, hidden=h, ffn=f, rows=rows)
    stamp = time.strftime("%Y-%m-%d-%H%M", time.gmtime())
    kind = jax.devices()[0].device_kind.lower().replace(" ", "-")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{kind}-{stamp}-probe-multistep-x{len(jax.devices())}.json"), "w") as fh:
        json.dump(result, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
