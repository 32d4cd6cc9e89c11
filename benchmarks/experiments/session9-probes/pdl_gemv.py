"""Probe: can separate Mosaic GPU matmul kernels, launched with programmatic dependent launch (PDL),
stream a decode layer's four weights as fast as one persistent kernel?

Each matmul is its own kernel over 132 CTAs: a producer warpgroup TMA-ing [bk, 64] weight tiles into an
SMEM ring from the kernel's first instruction (weights do not depend on the previous kernel), and a
consumer warpgroup that runs `griddepcontrol.wait` before it reads x (the previous kernel's output),
then acc[64 columns, 8 rows] += W^T x^T (swap AB, as session 7's mgpu_chain.py) and stores split-K
partials. With PDL the next kernel's CTAs may start (and start streaming their weights) once every CTA
of this one has run `griddepcontrol.launch_dependents`, so one matrix's ramp overlaps the previous one's
tail. Variants: no griddepcontrol at all ("none"), wait only (launched with PDL, trigger at exit:
"wait"), trigger right after the wait ("early"), trigger after the last weight tile arrived ("late").
Baseline: XLA's dots on the same chain. Chain as mgpu_chain.py: phase i's input is the previous
output's first K columns, 6 layers a call; us a layer = wall time of back-to-back calls / 6.
Run from the repository root: python3 benchmarks/experiments/session9-probes/pdl_gemv.py
"""
import json, os, sys, time
sys.path.insert(0, "scripts")
import numpy as np
import jax, jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

P = 132
ROWS = 8
SHAPES = ((4096, 12288), (4096, 4096), (4096, 22016), (11008, 4096))
LAYERS = 6


def make_gemv(K, N, s_in, s_out, *, bk=128, bn=64, slots=5, xslots=4, pdl="none", math=True):
    tiles, per = N // bn, K // bk // s_out
    items = tiles * s_out
    assert K % (bk * s_out) == 0 and N % bn == 0
    tf = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))

    def kernel(x_ref, w_ref, y_ref, w_ring, x_ring, o_smem, full, empty, xbar):
        c = lax.axis_index("cta")
        wg = lax.axis_index("wg")
        mine = lax.div(items - c + (P - 1), jnp.int32(P))

        @pl.when(wg == 1)
        def _producer():
            def item(j, t):
                it = c + j * P
                split, tile = lax.div(it, jnp.int32(tiles)), lax.rem(it, jnp.int32(tiles))

                def chunk(k, t):
                    slot = lax.rem(t, jnp.int32(slots))

                    @pl.when(t >= slots)
                    def _():
                        plgpu.barrier_wait(empty.at[slot])
                    row = (split * per + k) * bk
                    plgpu.copy_gmem_to_smem(w_ref.at[pl.ds(row, bk), pl.ds(tile * bn, bn)], w_ring.at[slot],
                                            full.at[slot])
                    return t + 1
                return lax.fori_loop(0, per, chunk, t)
            lax.fori_loop(0, mine, item, jnp.int32(0))

        @pl.when(wg == 0)
        def _consumer():
            if pdl != "none":
                plgpu.griddepcontrol_wait()
            if pdl == "early":
                plgpu.griddepcontrol_launch_dependents()

            def load_x(kk, u):
                xs = lax.rem(u, jnp.int32(xslots))
                for q in range(s_in):
                    plgpu.copy_gmem_to_smem(x_ref.at[q, pl.ds(0, ROWS), pl.ds(kk * bk, bk)], x_ring.at[xs, q],
                                            xbar.at[xs * s_in + q])
            ahead = xslots - 1

            if not math:  # the stream alone: take each weight tile and free it (timing only)
                def take(k, t):
                    slot = lax.rem(t, jnp.int32(slots))
                    plgpu.barrier_wait(full.at[slot])
                    plgpu.barrier_arrive(empty.at[slot])
                    return t + 1
                lax.fori_loop(0, mine * per, take, jnp.int32(0))
                if pdl == "late":
                    plgpu.griddepcontrol_launch_dependents()
                return

            def item(j, carry):
                t, u = carry
                it = c + j * P
                split, tile = lax.div(it, jnp.int32(tiles)), lax.rem(it, jnp.int32(tiles))
                k_first = split * per
                for a in range(min(ahead, per)):
                    load_x(k_first + a, u + a)

                def scoped(acc_ref):
                    def chunk(k, carry):
                        t, u = carry
                        slot = lax.rem(t, jnp.int32(slots))
                        xs = lax.rem(u, jnp.int32(xslots))
                        for q in range(s_in):
                            plgpu.barrier_wait(xbar.at[xs * s_in + q])
                        plgpu.barrier_wait(full.at[slot])
                        for q in range(s_in):
                            plgpu.wgmma(acc_ref, plgpu.transpose_ref(w_ring.at[slot], (1, 0)),
                                        plgpu.transpose_ref(x_ring.at[xs, q], (1, 0)))
                        plgpu.wgmma_wait(s_in)

                        @pl.when(k > 0)
                        def _():
                            plgpu.barrier_arrive(empty.at[lax.rem(t - 1, jnp.int32(slots))])

                        @pl.when(k + ahead < per)
                        def _():
                            load_x(k_first + k + ahead, u + ahead)
                        return t + 1, u + 1
                    t_end, u_end = lax.fori_loop(0, per, chunk, (t, u))
                    plgpu.wgmma_wait(0)
                    plgpu.barrier_arrive(empty.at[lax.rem(t_end - 1, jnp.int32(slots))])
                    return acc_ref[...], t_end, u_end
                acc, t, u = pl.run_scoped(scoped, plgpu.ACC((bn, ROWS), jnp.float32))
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                accb = plgpu.layout_cast(acc.astype(jnp.bfloat16), plgpu.Layout.WGMMA_TRANSPOSED)
                plgpu.transpose_ref(o_smem, (1, 0))[...] = accb
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(o_smem, y_ref.at[split, pl.ds(0, ROWS), pl.ds(tile * bn, bn)])
                return t, u
            lax.fori_loop(0, mine, item, (jnp.int32(0), jnp.int32(0)))
            if pdl == "late":
                plgpu.griddepcontrol_launch_dependents()
            plgpu.wait_smem_to_gmem(0)

    def run(x, w):
        return plgpu.kernel(
            kernel, out_type=jax.ShapeDtypeStruct((s_out, ROWS, N), jnp.bfloat16),
            scratch_types=[plgpu.SMEM((slots, bk, bn), jnp.bfloat16, transforms=tf),
                           plgpu.SMEM((xslots, s_in, ROWS, bk), jnp.bfloat16, transforms=tf),
                           plgpu.SMEM((ROWS, bn), jnp.bfloat16, transforms=tf),
                           plgpu.Barrier(num_barriers=slots), plgpu.Barrier(num_barriers=slots),
                           plgpu.Barrier(num_barriers=xslots * s_in)],
            grid=(P,), grid_names=("cta",), num_threads=2, thread_name="wg",
        )(x, w)
    return run


def make_chain(splits, pdl, **kw):
    gemvs = []
    s_in = splits[-1]
    for (K, N), s in zip(SHAPES, splits):
        gemvs.append(make_gemv(K, N, s_in, s, pdl=pdl, **kw))
        s_in = s

    def run(x, layers):
        outs = []
        for ws in layers:
            outs = []
            for g, w in zip(gemvs, ws):
                x = g(x, w)
                outs.append(x)
        return outs
    return jax.jit(run)


def xla_chain(x, layers):
    y = x[0, :1]
    for ws in layers:
        for (K, _), w in zip(SHAPES, ws):
            y = jnp.dot(y[:, :K], w, preferred_element_type=jnp.float32).astype(jnp.bfloat16)
    return y


def reference(x, ws, splits):
    """Float64, the kernels' rounding: each split's partial rounded to bf16, summed by the next kernel."""
    bf = lambda a: np.asarray(jnp.asarray(a, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32), np.float64)
    parts, outs = np.asarray(x.astype(jnp.float32), np.float64), []
    for (K, N), w, s in zip(SHAPES, ws, splits):
        w64 = np.asarray(w.astype(jnp.float32), np.float64)
        xin = parts[:, :, :K].sum(0)
        ks = K // s
        parts = np.stack([bf(xin[:, q * ks:(q + 1) * ks] @ w64[q * ks:(q + 1) * ks]) for q in range(s)])
        outs.append(parts)
    return outs


def trace_us(f, args, reps=5):
    """Per layer from a profiler trace: kernel time summed, the calls' span, the mean gap before a
    kernel (negative: it started before the previous one ended)."""
    from device_trace import gpu_kernel_events
    ev = sorted(gpu_kernel_events(lambda: f(*args), reps), key=lambda e: e[1])
    gaps = [s1 - (s0 + d0) for (_, s0, d0), (_, s1, _) in zip(ev, ev[1:])]
    gaps = [g for g in gaps if g < 20_000]  # the host gap between calls is not a kernel boundary
    return dict(kernel_sum=sum(d for _, _, d in ev) / reps / LAYERS / 1e3,
                span=(ev[-1][1] + ev[-1][2] - ev[0][1]) / reps / LAYERS / 1e3,
                kernels_per_call=len(ev) / reps, mean_gap=float(np.mean(gaps)) / 1e3 if gaps else None,
                min_gap=float(np.min(gaps)) / 1e3 if gaps else None)


def wall_us(f, args, reps=30):
    jax.block_until_ready(f(*args))
    t = time.perf_counter()
    for _ in range(reps):
        out = f(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t) / reps * 1e6


if __name__ == "__main__":
    key = jax.random.key(0)
    layers = [[jax.random.normal(jax.random.fold_in(key, 10 * l + i), s, jnp.bfloat16) * 0.02
               for i, s in enumerate(SHAPES)] for l in range(LAYERS)]
    total = sum(k * n * 2 for k, n in SHAPES)
    res = {"device": jax.devices()[0].device_kind, "jax": jax.__version__}
    xla = jax.jit(xla_chain)
    # Run 1 (pdl_gemv-1.json) also had "late" and slots=10 variants and no traces; run 2 the ones below.
    # --quick (run 3, under several XLA_FLAGS): "none" and "early" once, to see whether PDL overlaps at all.
    quick = "--quick" in sys.argv
    res["xla_flags"] = os.environ.get("XLA_FLAGS", "")
    variants = [((2, 2, 2, 2), v, {}) for v in (("none", "early") if quick else ("none", "wait", "early"))]
    if not quick:
        variants += [((2, 2, 2, 2), v, dict(math=False)) for v in ("none", "early")]
    rounds = {}
    for r in range(1 if quick else 2):  # rounds of the variants in turn, so clock drift falls on all alike
        x0 = jnp.zeros((2, ROWS, 4096), jnp.bfloat16).at[0, 0].set(jax.random.normal(key, (4096,), jnp.bfloat16))
        rounds.setdefault("xla", []).append(wall_us(xla, (x0, layers)) / LAYERS)
        if r == 0:
            res["xla_trace"] = trace_us(xla, (x0, layers))
        for splits, pdl, kw in variants:
            name = f"s{'-'.join(map(str, splits))}_{pdl}" + "".join(f"_{k}{v}" for k, v in kw.items())
            try:
                f = make_chain(splits, pdl, **kw)
                if r == 0:
                    res[name + "_trace"] = trace_us(f, (x0, layers))
                if r == 0 and kw.get("math", True):
                    outs = jax.block_until_ready(f(x0, layers[:1]))
                    ref = reference(x0, layers[0], splits)
                    res[name + "_max_err"] = [float(np.max(np.abs(np.asarray(o.astype(jnp.float32), np.float64)[:, :1]
                                                                   - rr[:, :1]))) for o, rr in zip(outs, ref)]
                    res[name + "_max_ref"] = [float(np.max(np.abs(rr[:, :1]))) for rr in ref]
                rounds.setdefault(name, []).append(wall_us(f, (x0, layers)) / LAYERS)
            except Exception as e:
                res[name + "_error"] = f"{type(e).__name__}: {str(e)[:600]}"
            print(r, name, {k: v for k, v in res.items() if k.startswith(name)}, rounds.get(name), flush=True)
    res["us_per_layer"] = {k: [round(v, 2) for v in vs] for k, vs in rounds.items()}
    res["tbps_best"] = {k: round(total / min(vs) / 1e6, 3) for k, vs in rounds.items()}
    print(json.dumps(res, indent=1))
    name = os.environ.get("PROBE_NAME", "pdl_gemv")
    json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), f"{name}.json"), "w"), indent=1)
