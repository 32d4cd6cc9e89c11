"""Spike: a persistent Mosaic GPU kernel computing a decode layer's four matmuls back to back (batch rows
<= 8), grid barriers on a global semaphore between them.
Producer warpgroup: TMA of [BK, 64] weight tiles into an SMEM ring (never waits on the barrier).
Consumer warpgroup: per work item (an output tile of 64 columns over one K split): x chunks [8, BK] by
TMA, acc[64 columns, 8 rows] += W^T x^T (wgmma with the weight tile as a transposed A and the rows as
B, N = 8: no padded rows), the tile written back transposed ([8, 64] bf16, through a WGMMA_TRANSPOSED
layout and a transposed SMEM view) to y_i[split]. A phase whose input was split-K takes one x chunk per
split and one wgmma each (the partials summed in the fp32 accumulator, each rounded to bf16 once).
Phase i's input is y_{i-1}[:, :, :K_i] (as chain_gemv.py)."""
import collections, functools, json, os, sys
sys.path.insert(0, "scripts")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import numpy as np
import jax, jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "session7-probes"))
from mgpu_stream import phase_plan, stream_weights  # noqa: E402  (work split and producer, shared)

P = 132
ROWS = 8   # real token rows (batch)
M = 64     # wgmma M


def make(shapes, splits, bk, bn, slots, xslots=3, programs=P, barriers=True, x_mode="chunks", store=True):
    """x_mode: "chunks" (session 7: x chunks by TMA, `ahead` in flight within an item), "none" (x loaded
    never: the wgmmas read stale SMEM, wrong results: what the x path costs), "nomath" (x loaded and
    waited, no wgmma). store=False: no output tile written (wrong results)."""
    nph = len(shapes)
    sw = 2 * bn  # swizzle bytes = one bf16 row of a weight tile
    assert bn == 64, "the weight tile is wgmma's M"
    for (K, _), sp in zip(shapes, splits):
        assert K % (bk * sp) == 0, (K, bk, sp)
    tf = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    smax = max(splits)
    in_splits = (1,) + tuple(splits[:-1])  # splits of each phase's input

    def kernel(x_ref, *refs):
        w_refs = refs[:nph]
        y_refs = refs[nph:2 * nph]
        w_ring, x_ring, o_smem, full, empty, xbar = refs[2 * nph:]
        c = lax.axis_index("cta")
        wg = lax.axis_index("wg")
        sem = pl.get_global(plgpu.SemaphoreType.REGULAR)

        plan = phase_plan(shapes, splits, bk, bn, c, programs)

        @pl.when(wg == 1)
        def _producer():
            stream_weights(w_refs, plan, c, programs, bk, bn, w_ring, full, empty)

        @pl.when(wg == 0)
        def _consumer():
            t = jnp.int32(0)   # weight tiles consumed
            u = jnp.int32(0)   # x chunks loaded
            for i in range(nph):
                tiles, chunks, mine = plan(i)
                src = x_ref if i == 0 else y_refs[i - 1]
                nin = in_splits[i]
                out = y_refs[i]
                if i > 0 and barriers:
                    pl.semaphore_wait(sem, i * programs, decrement=False)

                def load_x(kk, u, src=src, nin=nin):
                    if x_mode == "none":
                        return
                    xs = lax.rem(u, jnp.int32(xslots))
                    for q in range(nin):
                        plgpu.copy_gmem_to_smem(src.at[q, pl.ds(0, ROWS), pl.ds(kk * bk, bk)],
                                                x_ring.at[xs, q], xbar.at[xs * smax + q])

                ahead = xslots - 1  # x chunks in flight ahead of the one being used

                def item(j, carry, chunks=chunks, tiles=tiles, out=out, load_x=load_x, ahead=ahead, nin=nin):
                    t, u = carry
                    it = c + j * programs
                    split, tile = lax.div(it, jnp.int32(tiles)), lax.rem(it, jnp.int32(tiles))
                    k_first = split * chunks  # this item's first chunk of the full K
                    for a in range(min(ahead, chunks)):
                        load_x(k_first + a, u + a)

                    def scoped(acc_ref):
                        def chunk(k, carry):
                            t, u = carry
                            slot = lax.rem(t, jnp.int32(slots))
                            xs = lax.rem(u, jnp.int32(xslots))
                            if x_mode != "none":
                                for q in range(nin):
                                    plgpu.barrier_wait(xbar.at[xs * smax + q])
                            plgpu.barrier_wait(full.at[slot])
                            if x_mode != "nomath":
                                for q in range(nin):
                                    plgpu.wgmma(acc_ref, plgpu.transpose_ref(w_ring.at[slot], (1, 0)),
                                                plgpu.transpose_ref(x_ring.at[xs, q], (1, 0)))
                            # Chunk k - 1's wgmmas are done once at most this chunk's are in flight: its
                            # weight slot goes back to the producer and its x slot takes chunk k + ahead.
                            plgpu.wgmma_wait(nin)

                            @pl.when(k > 0)
                            def _():
                                plgpu.barrier_arrive(empty.at[lax.rem(t - 1, jnp.int32(slots))])

                            @pl.when(k + ahead < chunks)
                            def _():
                                load_x(k_first + k + ahead, u + ahead)
                            return t + 1, u + 1
                        t_end, u_end = lax.fori_loop(0, chunks, chunk, (t, u))
                        plgpu.wgmma_wait(0)
                        plgpu.barrier_arrive(empty.at[lax.rem(t_end - 1, jnp.int32(slots))])
                        return acc_ref[...], t_end, u_end
                    acc, t, u = pl.run_scoped(scoped, plgpu.ACC((bn, ROWS), jnp.float32))
                    # o_smem free again once the previous store has read it (its write lands before
                    # the phase's barrier signal, which waits for the writes).
                    if store:
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                        accb = plgpu.layout_cast(acc.astype(jnp.bfloat16), plgpu.Layout.WGMMA_TRANSPOSED)
                        plgpu.transpose_ref(o_smem, (1, 0))[...] = accb  # [64 columns, 8 rows] -> [8, 64]
                        plgpu.commit_smem()
                        plgpu.copy_smem_to_gmem(o_smem, out.at[split, pl.ds(0, ROWS), pl.ds(tile * bn, bn)])
                    return t, u
                t, u = lax.fori_loop(0, mine, item, (t, u))
                plgpu.wait_smem_to_gmem(0)
                if barriers:
                    pl.semaphore_signal(sem)  # this CTA's share of y_i is in memory
            if barriers:
                # Everyone has passed every wait once the count reaches nph * P: CTA 0 resets it.
                @pl.when(c == 0)
                def _():
                    pl.semaphore_wait(sem, nph * programs, decrement=True)

    def run(x, ws):
        return plgpu.kernel(
            kernel, out_type=[jax.ShapeDtypeStruct((s, ROWS, n), jnp.bfloat16) for (_, n), s in zip(shapes, splits)],
            scratch_types=[plgpu.SMEM((slots, bk, bn), jnp.bfloat16, transforms=tf),
                           plgpu.SMEM((xslots, smax, ROWS, bk), jnp.bfloat16, transforms=tf),
                           plgpu.SMEM((ROWS, bn), jnp.bfloat16, transforms=tf),
                           plgpu.Barrier(num_barriers=slots), plgpu.Barrier(num_barriers=slots),
                           plgpu.Barrier(num_barriers=xslots * smax)],
            grid=(programs,), grid_names=("cta",), num_threads=2, thread_name="wg",
        )(x[None], *ws)
    return jax.jit(run)


def reference(x, ws, shapes, splits):
    """Float64 NumPy, the kernel's rounding: each split's partial rounded to bf16, the next phase
    summing the partials' products in float."""
    bf = lambda a: np.asarray(jnp.asarray(a, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32), np.float64)
    parts, outs = [np.asarray(x.astype(jnp.float32), np.float64)], []
    for (K, N), w, s in zip(shapes, ws, splits):
        w64 = np.asarray(w.astype(jnp.float32), np.float64)
        xin = sum(p[:, :K] for p in parts)
        ks = K // s
        parts = [bf(sum(p[:, q * ks:(q + 1) * ks] for p in [xin]) @ w64[q * ks:(q + 1) * ks]) for q in range(s)]
        outs.append(np.stack(parts))
    return outs


if __name__ == "__main__":
    from device_trace import gpu_kernel_events
    LAYERS = 6
    key = jax.random.key(0)
    shapes = ((4096, 12288), (4096, 4096), (4096, 22016), (11008, 4096))
    layers = [[jax.random.normal(jax.random.fold_in(key, 10 * l + i), s, jnp.bfloat16) * 0.02 for i, s in enumerate(shapes)]
              for l in range(LAYERS)]
    x0 = jnp.zeros((ROWS, 4096), jnp.bfloat16).at[0].set(jax.random.normal(key, (4096,), jnp.bfloat16))
    total = sum(k * n * 2 for k, n in shapes)
    res = {}
    runs = [((2, 2, 2, 2), 128, 64, 8, 4, True, "chunks", True), ((2, 2, 2, 2), 128, 64, 8, 4, True, "none", True),
            ((2, 2, 2, 2), 128, 64, 8, 4, True, "nomath", True), ((1, 2, 1, 2), 128, 64, 8, 4, True, "chunks", True),
            ((1, 2, 1, 2), 128, 64, 8, 4, True, "none", True), ((2, 2, 2, 2), 128, 64, 8, 4, False, "none", True)]
    if "--session8b" in sys.argv:  # the second run: what the output store and the math cost
        runs = [((2, 2, 2, 2), 128, 64, 8, 4, True, "none", False), ((2, 2, 2, 2), 128, 64, 8, 4, True, "nomath", False),
                ((2, 2, 2, 2), 128, 64, 8, 4, True, "chunks", False), ((2, 2, 2, 2), 128, 64, 12, 4, True, "none", True),
                ((2, 2, 2, 2), 128, 64, 8, 4, False, "nomath", False), ((2, 2, 2, 2), 128, 64, 8, 4, True, "chunks", True)]
    for splits, bk, bn, slots, xslots, bar, mode, store in runs:
        name = f"s{'-'.join(map(str, splits))}_bk{bk}_bn{bn}_slots{slots}_x{xslots}_bar{int(bar)}_{mode}" + ("" if store else "_nostore")
        try:
            f = make(shapes, splits, bk, bn, slots, xslots=xslots, barriers=bar, x_mode=mode, store=store)
            outs = jax.block_until_ready(f(x0, layers[0]))
            if bar and mode == "chunks" and store:
                ref = reference(x0, layers[0], shapes, splits)
                errs = [float(np.max(np.abs(np.asarray(o.astype(jnp.float32), np.float64) - r))) for o, r in zip(outs, ref)]
                scale = [float(np.max(np.abs(r))) for r in ref]
            else:
                errs = scale = None
            step = lambda: [f(x0, ws) for ws in layers]
            ev = gpu_kernel_events(step, 5)
            kt = [d / 1e3 for n, s, d in ev if "mosaic" in n]
            us = sorted(kt)[len(kt) // 2]
            res[name] = dict(us_per_layer=round(us, 2), tbps=round(total / us / 1e6, 3), max_err=errs, max_ref=scale)
        except Exception as e:
            res[name] = dict(error=f"{type(e).__name__}: {str(e)[:500]}")
        print(name, res[name], flush=True)
    json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "mgpu_chain_x" + ("b" if "--session8b" in sys.argv else "") + ".json"), "w"), indent=1)
