"""Probe (issue 32): does a tensor-parallel step whose inputs and outputs keep their device addresses skip XLA's
per-step command-buffer update? A 13B-shaped stack of matmuls (two all-reduces a layer) over every device, with
the tensor-parallel XLA flags; three ways to feed it, each timed back to back:
  fresh:   a new input array each step and a new output (what the engine does today);
  stable:  inputs copied by a small program into a donated persistent buffer, the output written into a donated
           carrier (aliased, so the same address every step), then copied out by a small program;
  fixed:   the same persistent input, output into the donated carrier, no staging (the floor of `stable`).

  PYTHONPATH=$PWD python3 scripts/probe_stable_io.py --out $OUT

Session 25: over every device (4), and each variant also traced with XLA's detailed host events
(device_trace.host_summary): whether stable addresses remove the per-step command_buffer::initialize and the
blocking cuGraphLaunch the 13B TP 4 engine step shows.
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
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--no-flags", action="store_true")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # scripts/common
    if not args.no_flags:
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
        s = 0.02
        return dict(qkv=(jax.random.normal(k[0], (n, h, 3 * h), jnp.bfloat16) * s),
                    o=(jax.random.normal(k[1], (n, h, h), jnp.bfloat16) * s),
                    up=(jax.random.normal(k[2], (n, h, 2 * f), jnp.bfloat16) * s),
                    down=(jax.random.normal(k[3], (n, f, h), jnp.bfloat16) * s))

    shardings = dict(qkv=col, o=row, up=col, down=row)
    w = jax.jit(init, out_shardings=shardings)(jax.random.key(0))

    def layers(w, x):
        for i in range(n):
            a = x @ w["qkv"][i]
            x = x + (a[:, :h] * jax.nn.sigmoid(a[:, h:2 * h])) @ w["o"][i]
            u = x @ w["up"][i]
            x = x + (jax.nn.silu(u[:, :f]) * u[:, f:]) @ w["down"][i]
            x = x / (1 + jnp.abs(x).max())
        return x

    fresh_step = jax.jit(layers, in_shardings=(shardings, rep), out_shardings=rep)
    carried_step = jax.jit(lambda w, x, carrier: layers(w, x), in_shardings=(shardings, rep, rep), out_shardings=rep,
                           donate_argnums=(2,))
    stage = jax.jit(lambda buf, new: new + 0 * buf, in_shardings=(rep, rep), out_shardings=rep, donate_argnums=(0,))
    take = jax.jit(lambda out: out + 0, in_shardings=(rep,), out_shardings=rep)
    x0 = np.random.default_rng(0).standard_normal((1, h)).astype(np.float32).astype(jnp.bfloat16)

    def run_fresh(reps):
        x = jax.device_put(x0, rep)
        for _ in range(reps):
            x = fresh_step(w, x)
        x.block_until_ready()

    def run_stable(reps):
        buf, carrier = jax.device_put(x0, rep), jax.device_put(x0, rep)
        for _ in range(reps):
            buf = stage(buf, jax.device_put(x0, rep))
            carrier = carried_step(w, buf, carrier)
            y = take(carrier)
        y.block_until_ready()

    def run_fixed(reps):
        buf, carrier = jax.device_put(x0, rep), jax.device_put(x0, rep)
        for _ in range(reps):
            carrier = carried_step(w, buf, carrier)
        carrier.block_until_ready()

    rows = {}
    for name, fn in (("fresh", run_fresh), ("stable", run_stable), ("fixed", run_fixed)):
        fn(3)
        times = []
        for _ in range(5):
            t = time.perf_counter()
            fn(args.reps)
            times.append((time.perf_counter() - t) / args.reps * 1e3)
        rows[name] = dict(ms_median=float(np.median(times)), ms_all=times)
        print(f"[stable-io] {name}: {np.median(times):.3f} ms a step ({len(jax.devices())} devices)", flush=True)
        from common.device_trace import events_by_device, device_summary, host_summary, traced

        data = traced(lambda: fn(20), host_detail=True)
        host = host_summary(data, 20)
        gpu0 = sorted(events_by_device(data).items())[0][1] if events_by_device(data) else []
        rows[name]["host"] = host
        rows[name]["gpu0"] = {k: v for k, v in device_summary(gpu0, 20).items() if k != "heaviest"} if gpu0 else {}
        wanted = ("command_buffer::initialize", "command_buffer::execute", "cuGraphLaunch", "Thunks::Initialize")
        for e in host.get("events", []):
            if e["name"].startswith(wanted):
                print(f"    {e['us_per_step']:8.1f} us ({e['calls_per_step']:.2f} calls) {e['name']}", flush=True)
        if rows[name]["gpu0"]:
            print(f"    GPU 0 busy {rows[name]['gpu0']['busy_us_per_step']:.0f} us of a "
                  f"{rows[name]['gpu0']['span_us_per_step']:.0f} us span a step", flush=True)
    result = dict(devices=len(jax.devices()), device=jax.devices()[0].device_kind, xla_flags=os.environ.get("XLA_FLAGS"),
                  layers=n, hidden=h, ffn=f, rows=rows,
                  floor_ms=2 * n * (4 * h * h + 2 * h * f + h * f) / len(jax.devices()) / 4.8e12 * 1e3)
    os.makedirs(args.out, exist_ok=True)
    stamp = time.strftime("%Y-%m-%d-%H%M", time.gmtime())
    kind = jax.devices()[0].device_kind.lower().replace(" ", "-")
    name = f"{kind}-{stamp}-probe-stable-io-x{len(jax.devices())}{'-noflags' if args.no_flags else ''}.json"
    with open(os.path.join(args.out, name),
              "w") as fh:
        json.dump(result, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
