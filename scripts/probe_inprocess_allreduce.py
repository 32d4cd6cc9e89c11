"""Probe (issue 32; session 26 adds the local-copy, barrier and bf16-psum rows): a one-shot all-reduce over NVLink peer memory as a Mosaic GPU kernel, in ONE process over
every GPU (jax 0.11 runs multi-device Mosaic GPU kernels in a single process through XLA's collective metadata,
no NVSHMEM), against XLA's psum; plain peer stores, never NVLink multicast.

  PYTHONPATH=$PWD timeout 300 python3 scripts/probe_inprocess_allreduce.py --out $OUT

Each configuration (XLA_FLAGS: the product's tensor-parallel flags, XLA's defaults) runs in its own process: in
one jitted shard_map program, a chain of --calls all-reduces of a [64, 128] (8192) bf16 vector, each followed by
a scale by 1/N; checks the result against the exact mean, reports us per all-reduce. Errors are recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPE = (64, 128)


def worker(calls: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    n = jax.device_count()
    mesh = Mesh(np.array(jax.devices()), ("t",))
    x = jax.device_put(np.stack([np.full(SHAPE, r + 1, np.float32) for r in range(n)]).astype(jnp.bfloat16),
                       NamedSharding(mesh, P("t")))
    want = sum(range(1, n + 1)) / n
    out = {"devices": [d.device_kind for d in jax.devices()], "jax": jax.__version__, "results": {}}

    def timed(name, one):
        def chain(v):
            for _ in range(calls):
                v = one(v)
            return v
        try:
            f = jax.jit(jax.shard_map(one, mesh=mesh, in_specs=P("t"), out_specs=P("t"), check_vma=False))
            got = np.asarray(f(x), np.float32)
            g = jax.jit(jax.shard_map(chain, mesh=mesh, in_specs=P("t"), out_specs=P("t"), check_vma=False))
            jax.block_until_ready(g(x))
            times = []
            for _ in range(7):
                start = time.perf_counter()
                jax.block_until_ready(g(x))
                times.append(time.perf_counter() - start)
            out["results"][name] = {"us_per_all_reduce": float(np.median(times)) / calls * 1e6,
                                    "max_error": float(np.max(np.abs(got - want)))}
        except Exception as e:  # noqa: BLE001  (what fails is the finding)
            out["results"][name] = {"error": f"{type(e).__name__}: {e}"[-1500:]}
        print(name, out["results"][name], file=sys.stderr, flush=True)

    timed("psum", lambda v: (lax.psum(v.astype(jnp.float32), "t") / n).astype(v.dtype))
    timed("psum_bf16", lambda v: (lax.psum(v, "t") * (1.0 / n)).astype(v.dtype))
    if jax.default_backend() == "gpu":
        # Where a Mosaic GPU call's time goes: a local copy (the launch alone), a barrier (one signal to every
        # peer, then a wait: the collective metadata and the peer signals, no data), then the one-shot all-reduce.
        local, barrier, one_shot = _local_copy(), _barrier(n), _one_shot(n)
        timed("mosaic_local_copy", lambda v: local(v[0])[None])
        timed("mosaic_barrier", lambda v: barrier(v[0])[None])
        timed("one_shot_peer_stores", lambda v: one_shot(v[0])[None])
    return out


def _local_copy():
    """[64, 128] bf16 -> the same, through a single-device Mosaic GPU kernel (no peer, no semaphore)."""
    import jax
    import jax.numpy as jnp
    from jax.experimental.pallas import mosaic_gpu as plgpu

    def body(x_ref, y_ref):
        y_ref[...] = x_ref[...]

    return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct(SHAPE, jnp.bfloat16))


def _barrier(n: int):
    """A copy of x, after every device has signalled every peer once and received n signals: the cost of a
    multi-device Mosaic GPU call with no data crossing NVLink."""
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    def body(x_ref, y_ref, sem):
        me = lax.axis_index("t")
        for k in range(n):
            pl.semaphore_signal(sem, 1, device_id=lax.rem(me + k, n))
        pl.semaphore_wait(sem, n)
        y_ref[...] = x_ref[...]

    return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct(SHAPE, jnp.bfloat16),
                        scratch_types=[plgpu.SemaphoreType.REGULAR])


def _one_shot(n: int):
    """[64, 128] bf16 per device -> the mean over `t`: every device stores its vector into slot `me` of every
    peer's gather buffer, signals that peer, waits for n signals and sums its buffer."""
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    def body(x_ref, gather_ref, y_ref, sem):
        me = lax.axis_index("t")
        value = x_ref[...]
        for k in range(n):
            peer = lax.rem(me + k, n)
            for slot in range(n):  # a static slot index on the remote ref
                @pl.when(me == slot)
                def _():
                    plgpu.remote_ref(gather_ref, peer).at[slot][...] = value
            pl.semaphore_signal(sem, 1, device_id=peer)
        pl.semaphore_wait(sem, n)
        total = gather_ref[0].astype(jnp.float32)
        for k in range(1, n):
            total = total + gather_ref[k].astype(jnp.float32)
        y_ref[...] = (total * (1.0 / n)).astype(y_ref.dtype)

    call = plgpu.kernel(body, out_type=(jax.ShapeDtypeStruct((n, *SHAPE), jnp.bfloat16),
                                        jax.ShapeDtypeStruct(SHAPE, jnp.bfloat16)),
                        scratch_types=[plgpu.SemaphoreType.REGULAR])
    return lambda v: call(v)[1]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=160)
    p.add_argument("--configs", nargs="+", default=["tp_flags", "xla_defaults"])
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.calls)), flush=True)
        return 0
    sys.path.insert(0, ROOT)
    from sharding.xla_flags import TENSOR_PARALLEL_XLA_FLAGS

    runs = []
    for name in args.configs:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
        flags = " ".join(TENSOR_PARALLEL_XLA_FLAGS) if name == "tp_flags" else ""
        env["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), flags]).strip()
        try:
            proc = subprocess.run([sys.executable, __file__, "--worker", "--calls", str(args.calls)], env=env,
                                  capture_output=True, text=True, timeout=args.timeout)
            lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
            row = json.loads(lines[-1]) if proc.returncode == 0 and lines else {"error": f"exit {proc.returncode}",
                                                                                 "log_tail": proc.stderr[-3000:]}
        except subprocess.TimeoutExpired as e:
            row = {"error": "timeout", "log_tail": str(e.stderr)[-3000:]}
        row.update(config=name, xla_flags=env["XLA_FLAGS"])
        runs.append(row)
        print(name, json.dumps(row.get("results", row))[:1500], flush=True)
    device = next((r["devices"][0] for r in runs if r.get("devices")), "unknown").lower().replace(" ", "-")
    stamp = time.strftime("%Y-%m-%d-%H%M", time.gmtime())
    path = os.path.join(args.out, f"{device}-{stamp}-probe-inprocess-allreduce-x{len(runs[0].get('devices', [])) or 0}.json")
    os.makedirs(args.out, exist_ok=True)
    with open(path, "w") as fh:
        json.dump({"script": "scripts/probe_inprocess_allreduce.py (git history)", "argv": sys.argv[1:],
                   "calls": args.calls, "shape": SHAPE, "runs": runs}, fh, indent=1)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
