"""Probe (issue 32): can a decode step hide weight reads behind its latency-bound kernels by loading the next
matmul's weights into L2 first?

  XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 PYTHONPATH=$PWD timeout 400 python3 scripts/probe_l2_prefetch.py --out $OUT

A: serial, one stream. Per weight shape (the tensor shards of 13B and 70B over 4 GPUs, and Llama-2-7B whole):
   flush L2 (sum a 512 MB buffer), then a Pallas kernel loads the weight's first `fraction` bytes into L2
   (eviction_policy evict_last), then XLA's x @ W for one row. The matmul kernel's own time, from a trace, against
   fraction 0: does a matmul read faster from what a prefetch left in L2, and how much fits?
B: concurrent, one GPU. A chain of layers, each a latency-bound section (k add + RMSNorm kernels on one row) and
   then a matmul; the prefetch of that matmul's weights runs on a second stream (compute_on('gpu_stream:1')),
   started after the previous matmul and joined before this one. Per layer: wall time of the chain, with and
   without the prefetch, under XLA's default scheduler and under the latency-hiding scheduler (its own process),
   and from the trace whether the prefetch kernels overlap the section's kernels.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))

SHAPES = {  # name: (K, N) of W in x[1, K] @ W[K, N]
    "13b_tp4_qkv": (5120, 3840), "13b_tp4_o": (1280, 5120), "13b_tp4_gate_up": (5120, 6912),
    "13b_tp4_down": (3456, 5120),
    "70b_tp4_qkv": (8192, 2560), "70b_tp4_o": (2048, 8192), "70b_tp4_gate_up": (8192, 14336),
    "70b_tp4_down": (7168, 8192),
    "7b_o": (4096, 4096), "7b_qkv": (4096, 12288), "7b_down": (11008, 4096),
}
FRACTION_BYTES = (0, 8 << 20, 16 << 20, 24 << 20, 32 << 20, 40 << 20, 48 << 20)
COLS = 1024  # the prefetch views W as [rows, COLS]
BLOCK_ROWS = 16  # 32 KB of bf16 a program


def prefetch_kernel_call(w, rows: int, dep=None, start_row: int = 0):
    """Loads W's first `rows` x COLS elements (flat) into L2; returns a [programs] float32 of sums (nothing reads
    them but the barrier that orders this before the matmul)."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plt

    flat = w.reshape(-1, COLS)
    programs = max(1, rows // BLOCK_ROWS)

    def kernel(*refs):
        w_ref, out_ref = refs[0], refs[-1]
        i = pl.program_id(0)
        tile = plt.load(w_ref.at[pl.ds(start_row + i * BLOCK_ROWS, BLOCK_ROWS), pl.ds(0, COLS)],
                        eviction_policy="evict_last")
        out_ref[i] = jnp.sum(tile.astype(jnp.float32))

    operands = (flat,) if dep is None else (flat, dep)
    return pl.pallas_call(
        kernel, grid=(programs,), in_specs=[pl.no_block_spec] * len(operands), out_specs=pl.no_block_spec,
        out_shape=jax.ShapeDtypeStruct((programs,), jnp.float32),
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=1), name="l2_prefetch",
        interpret=jax.default_backend() != "gpu")(*operands)


def kernels_of(data):
    """(name, start ns, duration ns, stream line) of every GPU kernel in a trace."""
    out = []
    for plane in data.planes:
        if plane.name.startswith("/device:GPU"):
            for line in plane.lines:
                if line.name.startswith("Stream"):
                    out += [(e.name, e.start_ns, e.duration_ns, line.name) for e in line.events]
    return sorted(out, key=lambda e: e[1])


def part_a(reps: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from common import device_trace

    key = jax.random.PRNGKey(0)
    flush = jnp.ones((256 << 20,), jnp.bfloat16)  # 512 MB, ten times L2
    results = {}
    for name, (k, n) in SHAPES.items():
        w = jax.random.normal(key, (k, n), jnp.bfloat16)
        x = jax.random.normal(key, (1, k), jnp.bfloat16)
        total_bytes = k * n * 2
        row = {"weight_mb": total_bytes / 2**20, "fractions": {}}
        for fb in FRACTION_BYTES:
            if fb > total_bytes and fb != FRACTION_BYTES[0]:
                fb = total_bytes
            rows = (fb // 2) // COLS // BLOCK_ROWS * BLOCK_ROWS
            label = f"{fb / 2**20:.1f}MB"
            if label in row["fractions"]:
                continue

            def f(x, w, flush, rows=rows):
                s = jnp.sum(flush.astype(jnp.float32))
                w, s = jax.lax.optimization_barrier((w, s))
                pf = prefetch_kernel_call(w, rows) if rows else s[None]
                w, pf = jax.lax.optimization_barrier((w, pf))
                return x @ w, pf

            g = jax.jit(f)
            try:
                jax.block_until_ready(g(x, w, flush))
            except Exception as e:  # noqa: BLE001  (what fails is the finding)
                row["fractions"][label] = {"error": f"{type(e).__name__}: {e}"[-1500:]}
                print(name, label, row["fractions"][label], flush=True)
                continue

            def run(g=g):
                for _ in range(reps):
                    out = g(x, w, flush)
                jax.block_until_ready(out)

            events = kernels_of(device_trace.traced(run))
            mm = [d for nm, _, d, _ in events if device_trace.kernel_kind(nm) == "matmul"]
            pf = [d for nm, _, d, _ in events if "l2_prefetch" in nm]
            names = sorted({nm for nm, *_ in events})
            row["fractions"][label] = {
                "matmul_us": float(np.median(mm)) / 1e3 if mm else None,
                "prefetch_us": float(np.median(pf)) / 1e3 if pf else None,
                "kernels": names[:8]}
            print(name, label, row["fractions"][label]["matmul_us"], row["fractions"][label]["prefetch_us"],
                  flush=True)
        results[name] = row
    return results


def part_a2(reps: int) -> dict:
    """What the prefetch before a matmul buys: L2 data, or a warm-up of some other kind."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from common import device_trace
    from pallas_kernels import rms_norm

    key = jax.random.PRNGKey(0)
    flush = jnp.ones((256 << 20,), jnp.bfloat16)
    other = jnp.ones((64 << 20,), jnp.bfloat16)  # 128 MB, unrelated to W
    results = {}
    mb_rows = lambda mb: int(mb * 2**20 / 2) // COLS // BLOCK_ROWS * BLOCK_ROWS  # noqa: E731
    for name in ("70b_tp4_qkv", "70b_tp4_o", "13b_tp4_down", "13b_tp4_gate_up", "7b_o"):
        k, n = SHAPES[name]
        w = jax.random.normal(key, (k, n), jnp.bfloat16)
        x = jax.random.normal(key, (1, k), jnp.bfloat16)
        norm_w = jnp.ones((k,), jnp.bfloat16)
        total_rows = k * n // COLS
        variants = {
            "cold": lambda w, x: (w, x, None),
            "w_head_0.25MB": lambda w, x: (w, x, prefetch_kernel_call(w, BLOCK_ROWS * 8)),
            "w_head_1MB": lambda w, x: (w, x, prefetch_kernel_call(w, mb_rows(1))),
            "w_head_8MB": lambda w, x: (w, x, prefetch_kernel_call(w, mb_rows(8))),
            "w_tail_8MB": lambda w, x: (w, x, prefetch_kernel_call(w, mb_rows(8), start_row=total_rows - mb_rows(8))),
            "other_8MB": lambda w, x: (w, x, prefetch_kernel_call(other, mb_rows(8))),
            "norm_before": lambda w, x: (w, rms_norm.add_rms_norm(x, x, norm_w, eps=1e-5)[0], None),
        }
        row = {}
        for label, pre in variants.items():
            for flushed in (True, False):
                def f(x, w, flush, pre=pre, flushed=flushed):
                    if flushed:
                        s = jnp.sum(flush.astype(jnp.float32))
                        w, x, s = jax.lax.optimization_barrier((w, x, s))
                    w, x, pf = pre(w, x)
                    if pf is not None:
                        w, x, pf = jax.lax.optimization_barrier((w, x, pf))
                    return x @ w

                g = jax.jit(f)
                key_label = label + ("" if flushed else "_noflush")
                try:
                    jax.block_until_ready(g(x, w, flush))

                    def run(g=g):
                        for _ in range(reps):
                            out = g(x, w, flush)
                        jax.block_until_ready(out)

                    events = kernels_of(device_trace.traced(run))
                    mm = [d for nm, _, d, _ in events if device_trace.kernel_kind(nm) == "matmul"]
                    row[key_label] = float(np.median(mm)) / 1e3 if mm else None
                except Exception as e:  # noqa: BLE001
                    row[key_label] = f"{type(e).__name__}: {e}"[-800:]
                print(name, key_label, row[key_label], flush=True)
        results[name] = row
    return results


def part_m(reps: int) -> dict:
    """Why a matmul in a chain runs slower than the same matmul alone: same weight or distinct ones, one call a
    jit or a chain in one jit, separate arrays or one stacked array."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from common import device_trace

    results = {}
    for name in ("13b_tp4_qkv", "13b_tp4_down", "70b_tp4_qkv", "70b_tp4_o"):
        k, n = SHAPES[name]
        key = jax.random.PRNGKey(2)
        layers = 16
        stacked = jax.random.normal(key, (layers, k, n), jnp.bfloat16) * 0.02
        ws = [jnp.array(stacked[i]) for i in range(layers)]  # separate buffers
        x = jax.random.normal(key, (1, k), jnp.bfloat16)

        def step(h, w):  # one layer: matmul, then back to [1, k] as the next input
            y = h @ w
            return (y[:, :k] if n >= k else jnp.tile(y, (1, k // n + 1))[:, :k]).astype(jnp.bfloat16)

        def chain_separate(x, ws):
            for w in ws:
                x = step(x, w)
            return x

        def chain_same(x, w):
            for _ in range(layers):
                x = step(x, w)
            return x

        def chain_stacked(x, st):
            for i in range(layers):
                x = step(x, st[i])
            return x

        one = jax.jit(step)
        cases = {
            "alone_same_w": lambda: [one(x, ws[0]) for _ in range(layers)][-1],
            "alone_rotating_w": lambda: [one(x, w) for w in ws][-1],
            "chain_same_w": lambda f=jax.jit(chain_same): f(x, ws[0]),
            "chain_separate_w": lambda f=jax.jit(chain_separate): f(x, ws),
            "chain_stacked_w": lambda f=jax.jit(chain_stacked): f(x, stacked),
        }
        row = {}
        for label, fn in cases.items():
            try:
                jax.block_until_ready(fn())

                def run(fn=fn):
                    for _ in range(reps):
                        out = fn()
                    jax.block_until_ready(out)

                events = kernels_of(device_trace.traced(run))
                mm = [(nm, d) for nm, _, d, _ in events if device_trace.kernel_kind(nm) == "matmul"]
                other = [d for nm, _, d, _ in events if device_trace.kernel_kind(nm) != "matmul"]
                row[label] = {"matmul_us": float(np.median([d for _, d in mm])) / 1e3 if mm else None,
                              "matmul_p10_p90_us": [float(np.percentile([d for _, d in mm], q)) / 1e3
                                                    for q in (10, 90)] if mm else None,
                              "other_us_per_layer": float(np.sum(other)) / 1e3 / reps / layers,
                              "matmul_kernels": sorted({nm[:60] for nm, _ in mm})}
            except Exception as e:  # noqa: BLE001
                row[label] = {"error": f"{type(e).__name__}: {e}"[-800:]}
            print(name, label, row[label], flush=True)
        results[name] = row
    return results


def part_p(reps: int) -> dict:
    """Serial prefetch in a chain of distinct weights (nothing hot in L2 from the call before): per layer, a
    prefetch of the first X MB of that layer's weight, then its matmul. Does the matmul read the prefetched part
    from L2?"""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from common import device_trace

    results = {}
    layers = 16
    for name in ("13b_tp4_qkv", "13b_tp4_down", "13b_tp4_gate_up", "70b_tp4_qkv", "70b_tp4_o"):
        k, n = SHAPES[name]
        key = jax.random.PRNGKey(3)
        ws = [jax.random.normal(jax.random.fold_in(key, i), (k, n), jnp.bfloat16) * 0.02 for i in range(layers)]
        x = jax.random.normal(key, (1, k), jnp.bfloat16)
        row = {}
        for mb in (0, 8, 16, 24, 32, 40):
            rows = min(int(mb * 2**20 / 2), k * n) // COLS // BLOCK_ROWS * BLOCK_ROWS
            if mb and rows * COLS * 2 < (mb - 8) * 2**20:
                continue  # past the whole weight

            def chain(x, ws, rows=rows):
                sums = []
                for w in ws:
                    if rows:
                        pf = prefetch_kernel_call(w, rows)
                        w, x, pf = jax.lax.optimization_barrier((w, x, pf))
                        sums.append(pf[0])
                    y = x @ w
                    x = (y[:, :k] if n >= k else jnp.tile(y, (1, k // n + 1))[:, :k]).astype(jnp.bfloat16)
                return x, (jnp.stack(sums).sum() if sums else jnp.float32(0))

            f = jax.jit(chain)
            label = f"{rows * COLS * 2 / 2**20:.1f}MB"
            try:
                jax.block_until_ready(f(x, ws))

                def run(f=f):
                    for _ in range(reps):
                        out = f(x, ws)
                    jax.block_until_ready(out)

                events = kernels_of(device_trace.traced(run))
                mm = [d for nm, _, d, _ in events if device_trace.kernel_kind(nm) == "matmul"]
                pf = [d for nm, _, d, _ in events if "l2_prefetch" in nm]
                row[label] = {"matmul_us": float(np.median(mm)) / 1e3 if mm else None,
                              "prefetch_us": float(np.median(pf)) / 1e3 if pf else None}
            except Exception as e:  # noqa: BLE001
                row[label] = {"error": f"{type(e).__name__}: {e}"[-800:]}
            print(name, label, row[label], flush=True)
        results[name] = {"weight_mb": k * n * 2 / 2**20, "prefetched": row}
    return results


def part_b(reps: int, layers: int, section_kernels: int) -> dict:
    import inspect

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental.compute_on import compute_on
    from common import device_trace
    from pallas_kernels import rms_norm

    out = {}
    for name in ("13b_tp4_qkv", "13b_tp4_down", "7b_o", "70b_tp4_qkv"):
        k, n = SHAPES[name]
        key = jax.random.PRNGKey(1)
        ws = [jax.random.normal(jax.random.fold_in(key, i), (k, n), jnp.bfloat16) * 0.02 for i in range(layers)]
        x0 = jax.random.normal(key, (1, k), jnp.bfloat16)
        norm_w = jnp.ones((k,), jnp.bfloat16)
        rows = min(k * n, 40 << 19) // COLS // BLOCK_ROWS * BLOCK_ROWS  # up to 40 MB

        def side_fn(w, dep):
            return prefetch_kernel_call(w, rows, dep)

        if "out_memory_spaces" in inspect.signature(compute_on).parameters:  # 0.11: compute_on(f, *, compute_type, ..)
            side_prefetch = compute_on(jax.jit(side_fn), compute_type="gpu_stream:1",
                                       out_memory_spaces=jax.memory.Space.Device)
        else:
            side_prefetch = compute_on("gpu_stream:1")(jax.jit(side_fn))

        def chain(x, ws, prefetch: bool):
            h, sums = x, []
            for w in ws:
                if prefetch:
                    pf = side_prefetch(w, h)
                for _ in range(section_kernels):  # the latency-bound section
                    h, _ = rms_norm.add_rms_norm(h, h, norm_w, eps=1e-5)
                if prefetch:
                    h, w, pf = jax.lax.optimization_barrier((h, w, pf))
                    sums.append(pf[0])  # an output, so the prefetch is not dead code
                y = h @ w  # [1, n]
                h = (y[:, :k] if n >= k else jnp.tile(y, (1, k // n + 1))[:, :k]).astype(jnp.bfloat16)
            return h, (jnp.stack(sums).sum() if sums else jnp.float32(0))

        row = {}
        for variant in (False, True):
            g = jax.jit(lambda x, ws, variant=variant: chain(x, ws, variant))
            try:
                jax.block_until_ready(g(x0, ws))
                times = []
                for _ in range(reps):
                    t0 = time.perf_counter()
                    jax.block_until_ready(g(x0, ws))
                    times.append(time.perf_counter() - t0)

                def run(g=g):
                    for _ in range(5):
                        o = g(x0, ws)
                    jax.block_until_ready(o)

                events = kernels_of(device_trace.traced(run))
                streams = sorted({s for *_, s in events})
                mm = [d for nm, _, d, _ in events if device_trace.kernel_kind(nm) == "matmul"]
                pf = [(s, s + d) for nm, s, d, _ in events if "l2_prefetch" in nm]
                others = [(s, s + d) for nm, s, d, _ in events if "l2_prefetch" not in nm]
                overlap = sum(max(0, min(e, e2) - max(s, s2)) for s, e in pf for s2, e2 in others)
                row["prefetch" if variant else "plain"] = {
                    "us_per_layer": float(np.median(times)) / layers * 1e6,
                    "matmul_us": float(np.median(mm)) / 1e3 if mm else None,
                    "prefetch_kernel_us": float(np.median([e - s for s, e in pf])) / 1e3 if pf else None,
                    "prefetch_overlap_us_per_layer": overlap / 5 / layers / 1e3,
                    "streams": streams,
                    "hlo_has_call_start": "call-start" in g.lower(x0, ws).compile().as_text()}
            except Exception as e:  # noqa: BLE001  (what fails is the finding)
                row["prefetch" if variant else "plain"] = {"error": f"{type(e).__name__}: {e}"[-1500:]}
            print(name, variant, row.get("prefetch" if variant else "plain"), flush=True)
        out[name] = row
    return out


def worker(args) -> dict:
    import jax

    from pallas_kernels import compat

    compat.silence_triton_deprecation()
    out = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "xla_flags": os.environ.get("XLA_FLAGS", "")}
    if "a" in args.parts:
        out["serial_l2"] = part_a(args.reps)
    if "p" in args.parts:
        out["serial_prefetch_distinct_weights"] = part_p(args.reps)
    if "m" in args.parts:
        out["matmul_context"] = part_m(args.reps)
    if "w" in args.parts:
        out["warmup"] = part_a2(args.reps)
    if "b" in args.parts:
        out["concurrent"] = part_b(args.reps, args.layers, args.section_kernels)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--parts", default="wb", help="a: serial L2 fractions, w: what the prefetch buys, "
                        "b: a prefetch on a second stream")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--section-kernels", type=int, default=4)
    parser.add_argument("--worker", action="store_true")
    args = parser.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(worker(args)), flush=True)
        return 0
    runs = {"default": (os.environ.get("XLA_FLAGS", ""), args.parts),
            "lhs": (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_latency_hiding_scheduler=true", "b")}
    if "b" not in args.parts:
        del runs["lhs"]
    results = {}
    for label, (flags, parts) in runs.items():
        env = dict(os.environ, XLA_FLAGS=flags.strip())
        cmd = [sys.executable, __file__, "--worker", "--out", args.out, "--parts", parts, "--reps", str(args.reps),
               "--layers", str(args.layers), "--section-kernels", str(args.section_kernels)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        sys.stderr.write(proc.stderr[-3000:])
        sys.stdout.write(proc.stdout[-6000:])
        line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        results[label] = json.loads(line[-1][7:]) if line else {"error": proc.stderr[-2000:], "rc": proc.returncode}
    device = next((r.get("device") for r in results.values() if "device" in r), "gpu")
    path = os.path.join(args.out, f"{device.lower().replace(' ', '-')}-{time.strftime('%Y-%m-%d-%H%M')}"
                        "-probe-l2-prefetch.json")
    os.makedirs(args.out, exist_ok=True)
    with open(path, "w") as f:
        json.dump(results, f, indent=1)
    print("wrote", path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
