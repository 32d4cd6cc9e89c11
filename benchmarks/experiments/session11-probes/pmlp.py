"""Probe: a persistent Mosaic GPU kernel for the decode MLP's matmuls with a balanced split.

`mlp_chain.py` showed session 8's persistent chain tying the step's kernels on gate/up + down (67.2 vs
67.7 us a layer) because gate/up's 344 column tiles land 2 or 3 on each of 132 CTAs. Here every phase is
balanced:
  1. gate/up (x [8, 4096] @ [4096, 22016]) by stream-K: the 344 tiles x 32 chunks of 128 rows are one
     line of units cut evenly among the CTAs (83-84 each), so a tile is shared by at most two CTAs; each
     CTA stores one bf16 partial a tile segment (part 0: the segment from chunk 0, part 1: the rest).
  2. (grid barrier) h = silu(g) * u for 172 feature tiles of 64, 1-2 a CTA: g and u summed from their
     parts (part 1 only where the tile was cut, a static table), bf16, as the step rounds them.
  3. (grid barrier) down (h [8, 11008] @ [11008, 4096]): 64 column tiles x 2 K halves = 128 items, one a
     CTA, each CTA loading its half of h into SMEM once.
A producer warpgroup streams every weight tile through an 8-slot SMEM ring from the first instruction to
the last, through both barriers; the consumer warpgroup does acc[64 columns, 8 rows] += W^T x^T (swap AB,
as session 7's chain). Rows are 8 (wgmma's N), the first one real (batch 1).

Against, in the same process: the step's kernels for the same work (XLA's GEMM for gate/up, SiLU x up,
the skinny matmul's down partials). Kernel time a layer from a trace of 6 layers' calls. Correctness
against a float64 NumPy oracle with the kernel's rounding points.

Run from the repository root on the GPU machine: python3 benchmarks/experiments/session11-probes/pmlp.py
(JSON to $OUT/pmlp.json).
"""
import json
import os
import sys

sys.path.insert(0, "scripts")
import numpy as np  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import mosaic_gpu as plgpu  # noqa: E402

P = 132
ROWS = 8
BK, BN = 128, 64
D, F = 4096, 11008
T1, C1 = 2 * F // BN, D // BK  # gate/up: 344 column tiles, 32 chunks each
U1 = T1 * C1
FT = F // BN  # 172 feature tiles
T2, S2 = D // BN, 2  # down: 64 column tiles, K in 2 halves
C2 = F // BK // S2  # 43 chunks a half
LAYERS = 6


def unit_bounds(c):
    return (c * U1) // P, ((c + 1) * U1) // P


def cut_tiles() -> np.ndarray:
    """1 where a CTA boundary falls inside the tile (it has a part 1), else 0."""
    cut = np.zeros(T1, np.int32)
    for c in range(1, P):
        b = (c * U1) // P
        if b % C1:
            cut[b // C1] = 1
    return cut


def make(slots=8, skip=()):
    """skip (timing only, wrong results): 'silu' (no phase 2 and its barrier), 'barriers' (no grid
    barrier waits), 'down' (no phase 3: its weights neither streamed nor used), 'math' (no wgmma)."""
    tf = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    i32 = lambda v: jnp.asarray(v, jnp.int32)  # noqa: E731

    def kernel(x_ref, wgu_ref, wdn_ref, cut_ref, part_ref, h_ref, y_ref,
               ring, xbuf, o_smem, stage, full, empty, xb1, xb2a, xb2b, sb):
        c = lax.axis_index("cta")
        wg = lax.axis_index("wg")
        sem = pl.get_global(plgpu.SemaphoreType.REGULAR)
        u0 = lax.div(c * U1, i32(P))
        u1 = lax.div((c + 1) * U1, i32(P))
        t_lo, t_hi = lax.div(u0, i32(C1)), lax.div(u1 - 1, i32(C1))
        down_item = c < T2 * S2
        s2, t2 = lax.div(c, i32(T2)), lax.rem(c, i32(T2))

        def seg(t):
            k0 = jnp.maximum(u0, t * C1) - t * C1
            k1 = jnp.minimum(u1, (t + 1) * C1) - t * C1
            return k0, k1

        @pl.when(wg == 1)
        def _producer():
            def issue(src, n):
                slot = lax.rem(n, i32(slots))

                @pl.when(n >= slots)
                def _():
                    plgpu.barrier_wait(empty.at[slot])
                plgpu.copy_gmem_to_smem(src, ring.at[slot], full.at[slot])
                return n + 1

            def tile1(t, n):
                k0, k1 = seg(t)
                return lax.fori_loop(k0, k1, lambda k, n: issue(
                    wgu_ref.at[pl.ds(k * BK, BK), pl.ds(t * BN, BN)], n), n)
            n = lax.fori_loop(t_lo, t_hi + 1, tile1, i32(0))

            @pl.when(down_item & ("down" not in skip))
            def _():
                lax.fori_loop(0, C2, lambda k, n: issue(
                    wdn_ref.at[pl.ds((s2 * C2 + k) * BK, BK), pl.ds(t2 * BN, BN)], n), n)

        @pl.when(wg == 0)
        def _consumer():
            # x, whole, into xbuf[0:32] (chunk-major [8, 128] tiles), once.
            for k in range(C1):
                plgpu.copy_gmem_to_smem(x_ref.at[pl.ds(0, ROWS), pl.ds(k * BK, BK)], xbuf.at[k], xb1.at[k])
            for k in range(C1):
                plgpu.barrier_wait(xb1.at[k])

            def store_tile(acc, dst):
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # o_smem read by the previous store
                accb = plgpu.layout_cast(acc.astype(jnp.bfloat16), plgpu.Layout.WGMMA_TRANSPOSED)
                plgpu.transpose_ref(o_smem, (1, 0))[...] = accb  # [64 columns, 8 rows] -> [8, 64]
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(o_smem, dst)

            def run_chunks(n, k0, k1, w_src_chunk):
                """acc over chunks k0..k1 of the ring (n: ring tiles consumed so far)."""
                def scoped(acc_ref):
                    def chunk(k, n):
                        slot = lax.rem(n, i32(slots))
                        plgpu.barrier_wait(full.at[slot])
                        if "math" not in skip:
                            plgpu.wgmma(acc_ref, plgpu.transpose_ref(ring.at[slot], (1, 0)),
                                        plgpu.transpose_ref(w_src_chunk(k), (1, 0)))
                        plgpu.wgmma_wait(1)

                        @pl.when(k > k0)
                        def _():
                            plgpu.barrier_arrive(empty.at[lax.rem(n - 1, i32(slots))])
                        return n + 1
                    n_end = lax.fori_loop(k0, k1, chunk, n)
                    plgpu.wgmma_wait(0)
                    plgpu.barrier_arrive(empty.at[lax.rem(n_end - 1, i32(slots))])
                    return acc_ref[...], n_end
                return pl.run_scoped(scoped, plgpu.ACC((BN, ROWS), jnp.float32))

            # Phase 1: gate/up segments.
            def tile1(t, n):
                k0, k1 = seg(t)
                acc, n = run_chunks(n, k0, k1, lambda k: xbuf.at[k])
                part = (k0 > 0).astype(jnp.int32)
                store_tile(acc, part_ref.at[t, part])
                return n
            n = lax.fori_loop(t_lo, t_hi + 1, tile1, i32(0))
            plgpu.wait_smem_to_gmem(0)
            pl.semaphore_signal(sem)

            # Phase 2: h = silu(g) * u for feature tiles c and c + P.
            if "barriers" not in skip:
                pl.semaphore_wait(sem, P, decrement=False)
            for r in range(0 if "silu" in skip else 2):
                j = c + r * P

                @pl.when(j < FT)
                def _():
                    tiles = (j, j + FT)
                    for q, t in enumerate(tiles):
                        plgpu.copy_gmem_to_smem(part_ref.at[t, 0], stage.at[2 * q], sb.at[2 * q])
                        cut = cut_ref[t] > 0

                        @pl.when(cut)
                        def _():
                            plgpu.copy_gmem_to_smem(part_ref.at[t, 1], stage.at[2 * q + 1], sb.at[2 * q + 1])

                        @pl.when(~cut)
                        def _():  # no part 1: zeros (warpgroup semantics has no scalar broadcasts for a select)
                            stage.at[2 * q + 1][...] = jnp.full((ROWS, BN), 0.0, jnp.bfloat16)
                            plgpu.commit_smem()
                    vals = []
                    for q, t in enumerate(tiles):
                        plgpu.barrier_wait(sb.at[2 * q])

                        @pl.when(cut_ref[t] > 0)
                        def _():
                            plgpu.barrier_wait(sb.at[2 * q + 1])
                        v = stage.at[2 * q][...].astype(jnp.float32) + stage.at[2 * q + 1][...].astype(jnp.float32)
                        vals.append(v.astype(jnp.bfloat16).astype(jnp.float32))
                    g, u = vals
                    one = jnp.full((ROWS, BN), 1.0, jnp.float32)
                    h = g * (one / (one + jnp.exp(-g))) * u
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    stage.at[4][...] = h.astype(jnp.bfloat16)
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(stage.at[4], h_ref.at[pl.ds(0, ROWS), pl.ds(j * BN, BN)])
            plgpu.wait_smem_to_gmem(0)
            pl.semaphore_signal(sem)

            # Phase 3: down, one item a CTA (its K half of h into xbuf, once).
            if "barriers" not in skip:
                pl.semaphore_wait(sem, 2 * P, decrement=False)

            @pl.when(down_item & ("down" not in skip))
            def _():
                # (At most 32 barriers a group: chunks 0..31 on one, 32..42 on another.) All of this CTA's h
                # lands before the first wgmma: the ring is full of down's first weight tiles meanwhile.
                xb2 = lambda k: xb2a.at[k] if k < 32 else xb2b.at[k - 32]  # noqa: E731
                for k in range(C2):
                    plgpu.copy_gmem_to_smem(h_ref.at[pl.ds(0, ROWS), pl.ds((s2 * C2 + k) * BK, BK)], xbuf.at[k],
                                            xb2(k))
                for k in range(C2):
                    plgpu.barrier_wait(xb2(k))
                acc, _ = run_chunks(n, 0, C2, lambda k: xbuf.at[k])
                store_tile(acc, y_ref.at[s2, pl.ds(0, ROWS), pl.ds(t2 * BN, BN)])
            plgpu.wait_smem_to_gmem(0)
            pl.semaphore_signal(sem)

            @pl.when(c == 0)
            def _():
                pl.semaphore_wait(sem, 3 * P, decrement=True)

    cut = jnp.asarray(cut_tiles())

    def run(x, wgu, wdn):
        part, h, y = plgpu.kernel(
            kernel,
            out_type=[jax.ShapeDtypeStruct((T1, 2, ROWS, BN), jnp.bfloat16),
                      jax.ShapeDtypeStruct((ROWS, F), jnp.bfloat16),
                      jax.ShapeDtypeStruct((S2, ROWS, D), jnp.bfloat16)],
            scratch_types=[plgpu.SMEM((slots, BK, BN), jnp.bfloat16, transforms=tf),
                           plgpu.SMEM((C2, ROWS, BK), jnp.bfloat16, transforms=tf),
                           plgpu.SMEM((ROWS, BN), jnp.bfloat16, transforms=tf),
                           plgpu.SMEM((5, ROWS, BN), jnp.bfloat16),
                           plgpu.Barrier(num_barriers=slots), plgpu.Barrier(num_barriers=slots),
                           plgpu.Barrier(num_barriers=C1), plgpu.Barrier(num_barriers=32),
                           plgpu.Barrier(num_barriers=C2 - 32),
                           plgpu.Barrier(num_barriers=4)],
            grid=(P,), grid_names=("cta",), num_threads=2, thread_name="wg",
        )(x, wgu, wdn, cut)
        return h, y
    return jax.jit(run)


def reference(x, wgu, wdn):
    """Float64 with the kernel's rounding points: each gate/up segment's partial rounded to bf16, their sum
    rounded, h rounded, each down half rounded."""
    bf = lambda a: np.asarray(jnp.asarray(a, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32), np.float64)  # noqa: E731
    x64 = np.asarray(x.astype(jnp.float32), np.float64)
    wgu64 = np.asarray(wgu.astype(jnp.float32), np.float64)
    wdn64 = np.asarray(wdn.astype(jnp.float32), np.float64)
    gu = np.zeros((ROWS, 2 * F))
    for c in range(P):
        u0, u1 = unit_bounds(c)
        for t in range(u0 // C1, (u1 - 1) // C1 + 1):
            k0, k1 = max(u0, t * C1) - t * C1, min(u1, (t + 1) * C1) - t * C1
            cols = slice(t * BN, (t + 1) * BN)
            gu[:, cols] += bf(x64[:, k0 * BK:k1 * BK] @ wgu64[k0 * BK:k1 * BK, cols])
    gu = bf(gu)
    g, u = gu[:, :F], gu[:, F:]
    h = bf(g / (1 + np.exp(-g)) * u)
    y = np.stack([bf(h[:, s * C2 * BK:(s + 1) * C2 * BK] @ wdn64[s * C2 * BK:(s + 1) * C2 * BK]) for s in range(S2)])
    return h, y


def per_layer_us(step, match=None):
    from device_trace import gpu_kernel_events
    ev = gpu_kernel_events(step, 5)
    names = {}
    for n, _, d in ev:
        if match is None or match in n:
            names[n] = names.get(n, 0) + d / 5 / LAYERS / 1e3
    return round(sum(names.values()), 2), {k: round(v, 2) for k, v in names.items()}


def main():
    from pallas_kernels.skinny_matmul import default_block_sizes, skinny_matmul_partials
    key = jax.random.key(0)
    layers = [(jax.random.normal(jax.random.fold_in(key, 10 * l), (D, 2 * F), jnp.bfloat16) * 0.02,
               jax.random.normal(jax.random.fold_in(key, 10 * l + 1), (F, D), jnp.bfloat16) * 0.02)
              for l in range(LAYERS)]
    x = jnp.zeros((ROWS, D), jnp.bfloat16).at[0].set(jax.random.normal(key, (D,), jnp.bfloat16))
    res = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
           "bytes_per_layer": 2 * D * 2 * F + 2 * F * D, "cut_tiles": int(cut_tiles().sum())}
    down_sizes = default_block_sizes(1, F, D, max_splits=16)

    @jax.jit
    def engine_mlp(x, wgu, wdn):
        gu = jnp.dot(x[:1], wgu)
        h = jax.nn.silu(gu[:, :F]) * gu[:, F:]
        return skinny_matmul_partials(h, wdn, block_sizes=down_sizes)

    for r in range(2):  # two rounds in turn
        res.setdefault("engine", []).append(per_layer_us(lambda: [engine_mlp(x, *w) for w in layers]))
        print("engine", res["engine"][-1], flush=True)
        for slots, skip in ((8, ()), (6, ()), (8, ("silu",)), (8, ("barriers",)), (8, ("down",)), (8, ("math",)),
                            (8, ("silu", "barriers"))):
            name = f"pmlp_slots{slots}" + "".join(f"_no{s}" for s in skip)
            try:
                f = make(slots, skip)
                if r == 0 and not skip:
                    h, y = jax.block_until_ready(f(x, *layers[0]))
                    h_ref, y_ref = reference(x, *layers[0])
                    h64 = np.asarray(h.astype(jnp.float32), np.float64)
                    y64 = np.asarray(y.astype(jnp.float32), np.float64)
                    res[name + "_check"] = dict(
                        h_max_err=float(np.max(np.abs(h64[:1] - h_ref[:1]))), h_max_ref=float(np.max(np.abs(h_ref[:1]))),
                        y_max_err=float(np.max(np.abs(y64[:, :1] - y_ref[:, :1]))),
                        y_max_ref=float(np.max(np.abs(y_ref[:, :1]))),
                        y_sum_vs_engine=float(np.max(np.abs(
                            y64[:, :1].sum(0) - np.asarray(engine_mlp(x, *layers[0]), np.float64).sum(0)))))
                    print(name, res[name + "_check"], flush=True)
                res.setdefault(name, []).append(per_layer_us(lambda: [f(x, *w) for w in layers], "mosaic"))
            except Exception as e:
                res[name + "_error"] = f"{type(e).__name__}: {str(e)[:1500]}"
            print(name, res.get(name), res.get(name + "_error", ""), flush=True)
    json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "pmlp.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
