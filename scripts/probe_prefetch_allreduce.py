"""Probe (issue 32; for a 4-GPU machine): can the next matmul's weights be loaded into L2 while NCCL's all-reduce
runs, so that the matmul after it reads them from L2?

  PYTHONPATH=$PWD timeout 500 python3 scripts/probe_prefetch_allreduce.py --out $OUT            # every variant
  XLA_FLAGS=--xla_force_host_platform_device_count=4 PYTHONPATH=$PWD python3 scripts/probe_prefetch_allreduce.py \
      --out /tmp --variants base prefetch-16 --layers 2 --hidden 256 --ffn 512 --reps 2            # CPU dry run

Session 27 on one H200 (NOTES): a matmul at a TP 4 shard's shape runs 2-3.5 us faster when a prefetch kernel
loaded its weight into L2 first, but the prefetch costs as long as it saves, so it pays only beside latency-bound
work; a decode layer's two all-reduces (~11-12 us each, NCCL RING_LL) are such work. Here: a stack of `--layers`
13B-shaped layers (the 70B shape with --model 70b) under shard_map over every device, per device
  x @ qkv -> (gate) @ o -> psum -> x @ up -> (silu * up) @ down -> psum,
with, in the prefetch variants, a Pallas kernel started after each o (down) matmul that loads the first MB of the
next up (qkv) weight with eviction_policy evict_last, on a bounded grid (--programs, so that NCCL's kernel still
finds free SMs); its output is tied to the all-reduce's result by an optimization barrier, so it finishes before
the next matmul and XLA may run it beside the all-reduce. Each variant runs in its own process (XLA_FLAGS):
  base            the product's tensor-parallel flags, no prefetch
  prefetch-N      the same with N MB prefetched before each up and qkv matmul
  lhs-base / lhs-prefetch-N   the same with XLA's latency-hiding scheduler on
Reported per variant: ms a step (the jitted stack back to back), and from a trace of GPU 0 the matmul kernels' us,
the all-reduces' us, and how long prefetch kernels overlap an all-reduce.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = {"13b": dict(hidden=5120, ffn=13824, layers=40), "70b": dict(hidden=8192, ffn=28672, layers=80)}
COLS = 1024
BLOCK_ROWS = 16


def prefetch(w, mb: float, programs: int, after):
    """Loads the first `mb` MB of w (row-major) into L2 on a grid of `programs`; returns [programs] float32 sums.
    `after` is an operand only, so the kernel cannot start before it exists."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plt

    flat = w.reshape(-1, COLS)
    tiles = min(int(mb * 2**20) // (2 * COLS * BLOCK_ROWS), flat.shape[0] // BLOCK_ROWS)
    programs = max(1, min(programs, tiles))
    per_program = -(-tiles // programs)

    def kernel(w_ref, after_ref, out_ref):
        del after_ref
        i = pl.program_id(0)

        def body(t, acc):
            tile = jnp.minimum(i * per_program + t, tiles - 1)
            block = plt.load(w_ref.at[pl.ds(tile * BLOCK_ROWS, BLOCK_ROWS), pl.ds(0, COLS)],
                             eviction_policy="evict_last")
            return acc + jnp.sum(block.astype(jnp.float32))

        out_ref[i] = jax.lax.fori_loop(0, per_program, body, jnp.float32(0))

    return pl.pallas_call(kernel, grid=(programs,), in_specs=[pl.no_block_spec] * 2, out_specs=pl.no_block_spec,
                          out_shape=jax.ShapeDtypeStruct((programs,), jnp.float32),
                          compiler_params=plt.CompilerParams(num_warps=4, num_stages=1), name="l2_prefetch",
                          interpret=jax.default_backend() != "gpu")(flat, after)


def worker(args) -> dict:
    sys.path.insert(0, ROOT)
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from pallas_kernels import compat

    compat.silence_triton_deprecation()
    devices = jax.devices()
    tp = len(devices)
    mesh = Mesh(np.array(devices), ("tp",))
    shape = dict(SHAPES[args.model])
    n = args.layers or shape["layers"]
    h, f = args.hidden or shape["hidden"], args.ffn or shape["ffn"]
    mb = float(args.variant.rsplit("-", 1)[1]) if "prefetch" in args.variant else 0.0
    # One array a layer and weight, as the model holds them: a slice of a stacked array handed to the Pallas
    # prefetch could be copied out first.
    dims = dict(qkv=(h, 3 * h), o=(h, h), up=(h, 2 * f), down=(f, h))
    spec_of = dict(qkv=P(None, "tp"), o=P("tp", None), up=P(None, "tp"), down=P("tp", None))
    makers = {name: jax.jit(lambda key, shape=shape: jax.random.normal(key, shape, jnp.bfloat16) * 0.02,
                            out_shardings=NamedSharding(mesh, spec_of[name])) for name, shape in dims.items()}
    keys = jax.random.split(jax.random.key(0), 4 * n)
    w = {name: [makers[name](keys[4 * i + j]) for i in range(n)] for j, name in enumerate(dims)}
    specs = {name: [spec_of[name]] * n for name in dims}

    def per_device(w, x):  # w: this device's shards, x: [1, h] replicated
        sums = []
        for i in range(n):
            a = x @ w["qkv"][i]  # [1, 3h/tp]
            third = a.shape[1] // 3
            part = (a[:, :third] * jax.nn.sigmoid(a[:, third:2 * third])) @ w["o"][i]  # [1, h] partial
            if mb:
                pf = prefetch(w["up"][i], mb, args.programs, part)
            x = x + jax.lax.psum(part, "tp")
            if mb:
                x, pf = jax.lax.optimization_barrier((x, pf))
                sums.append(pf[0])
            u = x @ w["up"][i]  # [1, 2f/tp]
            half = u.shape[1] // 2
            part = (jax.nn.silu(u[:, :half]) * u[:, half:]) @ w["down"][i]
            if mb and i + 1 < n:
                pf = prefetch(w["qkv"][i + 1], mb, args.programs, part)
            x = x + jax.lax.psum(part, "tp")
            if mb and i + 1 < n:
                x, pf = jax.lax.optimization_barrier((x, pf))
                sums.append(pf[0])
            x = (x / (1 + jnp.abs(x).max())).astype(jnp.bfloat16)
        return x, (jnp.stack(sums).sum() if sums else jnp.float32(0))[None]

    step = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(specs, P()), out_specs=(P(), P("tp")),
                                 check_vma=False))
    x0 = jax.device_put(np.random.default_rng(0).standard_normal((1, h)).astype(np.float32).astype(jnp.bfloat16),
                        NamedSharding(mesh, P()))

    def run(reps):
        x = x0
        for _ in range(reps):
            x, _ = step(w, x)
        jax.block_until_ready(x)

    run(3)
    times = []
    for _ in range(5):
        t = time.perf_counter()
        run(args.reps)
        times.append((time.perf_counter() - t) / args.reps * 1e3)
    out = dict(variant=args.variant, devices=tp, device=devices[0].device_kind, jax=jax.__version__,
               xla_flags=os.environ.get("XLA_FLAGS", ""), layers=n, hidden=h, ffn=f, prefetch_mb=mb,
               programs=args.programs, ms_median=float(np.median(times)), ms_all=times,
               floor_ms=2 * n * (4 * h * h + 3 * h * f) / tp / 4.8e12 * 1e3)
    text = step.lower(w, x0).compile().as_text() or ""
    out["hlo"] = {"all_reduce_start": text.count("all-reduce-start"), "all_reduce": text.count("all-reduce("),
                  "prefetch_calls": text.count("l2_prefetch"), "copies": text.count(" copy(")}
    out["checksum"] = float(jnp.sum(step(w, x0)[0].astype(jnp.float32)))  # equal across variants: same math
    from common.device_trace import events_by_device, kernel_kind, traced

    events = sorted(events_by_device(traced(lambda: run(10))).items())
    if events:
        gpu0 = events[0][1]
        mm = [d for nm, _, d in gpu0 if kernel_kind(nm) == "matmul"]
        ar = [(s, s + d) for nm, s, d in gpu0 if kernel_kind(nm) == "collective"]
        pf = [(s, s + d) for nm, s, d in gpu0 if "l2_prefetch" in nm]
        overlap = sum(max(0, min(e, e2) - max(s, s2)) for s, e in pf for s2, e2 in ar)
        out["gpu0"] = {"matmul_us_median": float(np.median(mm)) / 1e3 if mm else None,
                       "matmul_us_per_step": float(np.sum(mm)) / 1e3 / 10,
                       "all_reduce_us_median": float(np.median([e - s for s, e in ar])) / 1e3 if ar else None,
                       "prefetch_us_median": float(np.median([e - s for s, e in pf])) / 1e3 if pf else None,
                       "prefetch_overlapping_all_reduce_us_per_step": overlap / 1e3 / 10,
                       "kernels_per_step": len(gpu0) / 10}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--model", choices=sorted(SHAPES), default="13b")
    p.add_argument("--layers", type=int, default=0, help="0: the model's")
    p.add_argument("--hidden", type=int, default=0)
    p.add_argument("--ffn", type=int, default=0)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--programs", type=int, default=96, help="prefetch grid (the H200 has 132 SMs)")
    p.add_argument("--variants", nargs="+", default=["base", "prefetch-16", "prefetch-32", "lhs-base",
                                                     "lhs-prefetch-16", "lhs-prefetch-32", "base"])
    p.add_argument("--variant", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.variant:
        print("RESULT " + json.dumps(worker(args)), flush=True)
        return 0
    sys.path.insert(0, ROOT)
    from sharding.xla_flags import TENSOR_PARALLEL_XLA_FLAGS, cuda_backend_expected

    results = []
    for variant in args.variants:
        flags = os.environ.get("XLA_FLAGS", "").split()
        if cuda_backend_expected():
            flags += list(TENSOR_PARALLEL_XLA_FLAGS)
            if variant.startswith("lhs-"):
                flags.append("--xla_gpu_enable_latency_hiding_scheduler=true")
        cmd = [sys.executable, os.path.abspath(__file__), "--variant", variant, "--out", args.out, "--model",
               args.model, "--layers", str(args.layers), "--hidden", str(args.hidden), "--ffn", str(args.ffn),
               "--reps", str(args.reps), "--programs", str(args.programs)]
        try:
            proc = subprocess.run(cmd, env=dict(os.environ, XLA_FLAGS=" ".join(flags)), capture_output=True,
                                  text=True, timeout=240)
            line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            row = json.loads(line[-1][7:]) if line else {"variant": variant, "error": proc.stderr[-2000:]}
        except subprocess.TimeoutExpired:
            row = {"variant": variant, "error": "timed out after 240 s"}
        results.append(row)
        print(variant, {k: row.get(k) for k in ("ms_median", "floor_ms", "gpu0", "hlo", "error")}, flush=True)
    device = next((r["device"] for r in results if "device" in r), "unknown")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"{device.lower().replace(' ', '-')}-{time.strftime('%Y-%m-%d-%H%M', time.gmtime())}"
                                  f"-probe-prefetch-allreduce-{args.model}.json")
    with open(path, "w") as fh:
        json.dump(dict(argv=sys.argv[1:], results=results), fh, indent=1)
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
