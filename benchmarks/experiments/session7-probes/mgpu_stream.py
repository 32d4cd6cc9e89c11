"""Spike: can a persistent Mosaic GPU kernel stream a decode layer's weights (4 matrices, grid barriers
between them) at the HBM rate? Producer warpgroup: TMA of weight tiles into an SMEM ring, never waiting
on the grid barrier; consumer warpgroup: waits each tile and frees it (no math), and at each matrix
boundary signals and waits a global semaphore (the grid barrier a real layer needs for its activations)."""
import collections, functools, json, os, sys
sys.path.insert(0, "scripts")
import jax, jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

P = 132


def phase_plan(shapes, splits, bk, bn, cta, programs):
    """plan(i) = (column tiles of bn, chunks of bk rows a K split, this CTA's items) of matrix i: its
    items are the tiles x splits, CTA cta taking cta, cta + programs, ..."""
    def plan(i):
        K, N = shapes[i]
        tiles, per = N // bn, K // bk // splits[i]
        items = tiles * splits[i]
        mine = lax.div(items - cta + (programs - 1), jnp.int32(programs))
        return tiles, per, mine
    return plan


def stream_weights(w_refs, plan, cta, programs, bk, bn, ring, full, empty):
    """The producer warpgroup: weight tiles [bk, bn] by TMA into the SMEM ring (slot t % slots, `full`
    on arrival), matrix after matrix, never waiting on the grid barrier, only on `empty` for a slot's
    previous tile. plan(i) = (column tiles, chunks a K split, this CTA's items) of matrix i; item j of
    this CTA is cta + j * programs, split-major (split = item // tiles)."""
    slots = ring.shape[0]
    t = jnp.int32(0)
    for i, w in enumerate(w_refs):
        tiles, per, mine = plan(i)

        def item(j, t, w=w, tiles=tiles, per=per):
            it = cta + j * programs
            split, tile = lax.div(it, jnp.int32(tiles)), lax.rem(it, jnp.int32(tiles))

            def chunk(k, t):
                slot = lax.rem(t, jnp.int32(slots))

                @pl.when(t >= slots)
                def _():
                    plgpu.barrier_wait(empty.at[slot])
                row = (split * per + k) * bk
                plgpu.copy_gmem_to_smem(w.at[pl.ds(row, bk), pl.ds(tile * bn, bn)], ring.at[slot], full.at[slot])
                return t + 1
            return lax.fori_loop(0, per, chunk, t)
        t = lax.fori_loop(0, mine, item, t)


def make(shapes, splits, bk, bn, slots, barriers):
    nph = len(shapes)

    def kernel(idx_ref, *refs):
        w_refs = refs[:nph]
        out_ref = refs[nph]
        ring, full, empty = refs[nph + 1:]
        c = lax.axis_index("cta")
        wg = lax.axis_index("wg")
        sem = pl.get_global(plgpu.SemaphoreType.REGULAR)
        call = idx_ref[0]

        plan = phase_plan(shapes, splits, bk, bn, c, P)

        @pl.when(wg == 1)
        def _producer():
            stream_weights(w_refs, plan, c, P, bk, bn, ring, full, empty)

        @pl.when(wg == 0)
        def _consumer():
            t = jnp.int32(0)
            for i in range(nph):
                tiles, per, mine = plan(i)
                if i > 0 and barriers:
                    pl.semaphore_wait(sem, i * P, decrement=False)

                def chunk(k, t):
                    slot = lax.rem(t, jnp.int32(slots))
                    plgpu.barrier_wait(full.at[slot])
                    plgpu.barrier_arrive(empty.at[slot])
                    return t + 1
                t = lax.fori_loop(0, mine * per, chunk, t)
                if i + 1 < nph and barriers:
                    pl.semaphore_signal(sem)
            if barriers:
                # Every CTA has passed the last wait once the count reaches nph * P: CTA 0 then returns it
                # to 0 for the next call (the global persists across calls).
                pl.semaphore_signal(sem)

                @pl.when(c == 0)
                def _():
                    pl.semaphore_wait(sem, nph * P, decrement=True)
            out_ref[c] = t

    def run(idx, ws):
        return plgpu.kernel(
            kernel, out_type=jax.ShapeDtypeStruct((P,), jnp.int32),
            scratch_types=[plgpu.SMEM((slots, bk, bn), jnp.bfloat16), plgpu.Barrier(num_barriers=slots),
                           plgpu.Barrier(num_barriers=slots)],
            grid=(P,), grid_names=("cta",), num_threads=2, thread_name="wg",
        )(idx, *ws)
    return jax.jit(run)


if __name__ == "__main__":
    from device_trace import gpu_kernel_events
    LAYERS = 6
    key = jax.random.key(0)
    shapes = ((4096, 12288), (4096, 4096), (4096, 22016), (11008, 4096))
    layers = [[jax.random.normal(jax.random.fold_in(key, 10 * l + i), s, jnp.bfloat16) for i, s in enumerate(shapes)]
              for l in range(LAYERS)]
    total = sum(k * n * 2 for k, n in shapes)
    res = {}
    ncall = [0]
    configs = [  # splits, bk, bn, slots, barriers
        ((1, 1, 1, 1), 128, 64, 8, True), ((1, 1, 1, 1), 128, 64, 12, True), ((1, 1, 1, 1), 256, 64, 6, False),
        ((2, 1, 1, 1), 128, 64, 12, True), ((4, 4, 4, 4), 128, 64, 8, True),
    ]
    for splits, bk, bn, slots, bar in configs:
        name = f"s{'-'.join(map(str, splits))}_bk{bk}_bn{bn}_slots{slots}_bar{int(bar)}"
        ncall[0] = 0  # each kernel has its own global semaphore, counting its own calls
        try:
            f = make(shapes, splits, bk, bn, slots, bar)

            def step():
                outs = []
                for ws in layers:
                    outs.append(f(jnp.array([ncall[0]], jnp.int32), ws))
                    ncall[0] += 1
                return outs
            outs = jax.block_until_ready(step())
            ev = gpu_kernel_events(step, 5)
            kt = [d / 1e3 for n, s, d in ev if "mosaic" in n]
            us = sorted(kt)[len(kt) // 2]
            res[name] = dict(us_per_layer=round(us, 2), tbps=round(total / us / 1e6, 3), kernels=len(kt))
            print(name, res[name], flush=True)
        except Exception as e:
            res[name] = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
            print(name, res[name], flush=True)
    json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "mgpu_stream.json"), "w"), indent=1)
