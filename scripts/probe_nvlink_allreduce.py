"""Probe (issue 32): a one-shot all-reduce over NVLink peer memory (Pallas Mosaic GPU, NVSHMEM) against XLA's psum.

  PYTHONPATH=$PWD timeout 500 python3 scripts/probe_nvlink_allreduce.py --processes 4 --out $OUT

A tensor-parallel decode step all-reduces a [1, hidden] bf16 vector twice a layer; NCCL takes ~11 us for one inside
the step's CUDA graph on 4 x H200 (benchmarks/NOTES.md). Mosaic GPU kernels reach peer memory through NVSHMEM, which
JAX runs with one process a GPU, so this starts --processes processes on this host (jax.distributed, one GPU each).
In each configuration (XLA_FLAGS: the product's tensor-parallel flags, those plus NVSHMEM enabled, none) every
process runs, in one jitted program, a chain of --calls all-reduces of a [64, 128] (= 8192) bf16 vector: the Pallas
kernel (each device writes its vector into every peer's gather buffer, signals the peer, waits for all, sums) and
lax.psum, each followed by a scale by 1/N so the values stay put. It checks both against the exact mean and reports
us per all-reduce. Errors are recorded, not raised: the point is what works. NVLink multicast is never used (no
multimem, no multicast refs; the image sets NVSHMEM_DISABLE_NVLS=1 and NCCL_NVLS_ENABLE=0).
--dry-run: the psum chain only, on CPU processes (checks the harness).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPE = (64, 128)

CONFIGS = {  # name: XLA_FLAGS added to the workers' environment
    "tp_flags": None,  # the product's (sharding.xla_flags.TENSOR_PARALLEL_XLA_FLAGS)
    "tp_flags_nvshmem": "--xla_gpu_experimental_enable_nvshmem=true",  # plus these
    "xla_defaults": "",
}


def worker(rank: int, n: int, port: int, calls: int, dry_run: bool) -> dict:
    import jax

    if dry_run:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=n, process_id=rank,
                               local_device_ids=None if dry_run else [rank], initialization_timeout=120)
    import jax.numpy as jnp
    import numpy as np
    from jax import lax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()), ("t",))
    spec = NamedSharding(mesh, P("t"))
    local = np.full((1, *SHAPE), rank + 1, np.float32).astype(jnp.bfloat16)
    x = jax.make_array_from_process_local_data(spec, local, (n, *SHAPE))
    want = sum(range(1, n + 1)) / n
    out = {"rank": rank, "devices": [str(d) for d in jax.devices()], "jax": jax.__version__, "results": {}}

    def timed(name, one):
        def chain(x):
            for _ in range(calls):
                x = one(x)
            return x

        try:
            f = jax.jit(jax.shard_map(lambda v: one(v), mesh=mesh, in_specs=P("t"), out_specs=P("t"),
                                      check_vma=False))
            got = np.asarray(f(x).addressable_shards[0].data, np.float32)
            g = jax.jit(jax.shard_map(chain, mesh=mesh, in_specs=P("t"), out_specs=P("t"), check_vma=False))
            jax.block_until_ready(g(x))
            times = []
            for _ in range(5):
                start = time.perf_counter()
                jax.block_until_ready(g(x))
                times.append(time.perf_counter() - start)
            out["results"][name] = {"us_per_all_reduce": float(np.median(times)) / calls * 1e6,
                                    "max_error": float(np.max(np.abs(got - want)))}
        except Exception as e:  # noqa: BLE001  (what fails is the finding)
            out["results"][name] = {"error": f"{type(e).__name__}: {e}"[-2000:]}

    timed("psum", lambda v: (lax.psum(v.astype(jnp.float32), "t") / n).astype(v.dtype))
    if not dry_run:
        timed("pallas_one_shot", lambda v: _one_shot(n)(v[0])[None])
        try:
            import jax.experimental.mosaic.gpu as mgpu

            out["nvshmem"] = bool(mgpu.supports_cross_device_collectives())
        except Exception as e:  # noqa: BLE001
            out["nvshmem"] = f"{type(e).__name__}: {e}"
    return out


def _one_shot(n: int):
    """[64, 128] bf16 per device -> the mean over the `t` axis, as one Mosaic GPU kernel over peer memory."""
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    def body(x_ref, gather_ref, y_ref, sem):
        me = lax.axis_index("t")
        value = x_ref[...]
        for k in range(n):  # every peer's slot `me`, then a signal to that peer (the write lands before it)
            peer = lax.rem(me + k, n)
            plgpu.remote_ref(gather_ref, peer).at[me][...] = value
            pl.semaphore_signal(sem, 1, device_id=peer)
        pl.semaphore_wait(sem, n)  # all n vectors are in this device's gather buffer
        total = gather_ref[0].astype(jnp.float32)
        for k in range(1, n):
            total = total + gather_ref[k].astype(jnp.float32)
        y_ref[...] = (total * (1.0 / n)).astype(y_ref.dtype)

    semaphore = getattr(plgpu, "SemaphoreType", None) or plgpu.Semaphore
    call = plgpu.kernel(body, out_shape=(jax.ShapeDtypeStruct((n, *SHAPE), jnp.bfloat16),
                                         jax.ShapeDtypeStruct(SHAPE, jnp.bfloat16)),
                        scratch_shapes=[semaphore.REGULAR])
    return lambda v: call(v)[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_config(name: str, args) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    if not args.dry_run:
        from sharding.xla_flags import TENSOR_PARALLEL_XLA_FLAGS

        extra = CONFIGS[name]
        flags = "" if extra == "" else " ".join([*TENSOR_PARALLEL_XLA_FLAGS, *([extra] if extra else [])])
        env["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), flags]).strip()
        env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.2")
    else:
        env["JAX_PLATFORMS"] = "cpu"
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(rank), "--processes", str(args.processes),
                               "--port", str(port), "--calls", str(args.calls), *(["--dry-run"] if args.dry_run else [])],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in range(args.processes)]
    row = {"config": name, "xla_flags": env.get("XLA_FLAGS", ""), "ranks": []}
    deadline = time.monotonic() + args.timeout
    for rank, proc in enumerate(procs):
        try:
            stdout, stderr = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            stdout, stderr = proc.communicate()
            row["ranks"].append({"rank": rank, "error": "timeout", "log_tail": stderr[-2000:]})
            continue
        lines = [line for line in stdout.splitlines() if line.startswith("{")]
        if proc.returncode == 0 and lines:
            row["ranks"].append(json.loads(lines[-1]))
        else:
            row["ranks"].append({"rank": rank, "error": f"exit {proc.returncode}", "log_tail": stderr[-2000:]})
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--processes", type=int, default=4)
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--calls", type=int, default=160, help="all-reduces in the timed chain (a 70B step has 160)")
    p.add_argument("--timeout", type=float, default=150.0, help="seconds a configuration may take")
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    p.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker is not None:
        print(json.dumps(worker(args.worker, args.processes, args.port, args.calls, args.dry_run)), flush=True)
        return 0
    stamp = time.strftime("%Y-%m-%d-%H%M", time.gmtime())
    result = {"script": "scripts/probe_nvlink_allreduce.py (git history)", "argv": sys.argv[1:],
              "processes": args.processes, "calls": args.calls, "shape": SHAPE, "dtype": "bfloat16", "runs": []}
    configs = ["xla_defaults"] if args.dry_run else args.configs
    for name in configs:
        row = run_config(name, args)
        result["runs"].append(row)
        device = "cpu" if args.dry_run else "nvidia-gpu"
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, f"{device}-{stamp}-probe-nvlink-allreduce-x{args.processes}.json")
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
        for r in row["ranks"]:
            print(name, r.get("rank"), r.get("error") or {k: v for k, v in r["results"].items()}, flush=True)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
