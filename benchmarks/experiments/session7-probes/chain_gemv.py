"""Spike: one persistent Pallas (Triton) kernel streaming a decode layer's four weight matrices back to
back (grid barriers between them) vs XLA's four separate GEMMs. M = 1 (batch-1 decode), bf16."""
import collections, functools, json, os, sys
sys.path.insert(0, "scripts")
import numpy as np
import jax, jax.numpy as jnp
from jax.experimental import pallas as pl
from pallas_kernels import compat

BN, BK, ROWS = 64, 128, 16
SPIN_LIMIT = 1 << 22


def _chain_kernel(*refs, phases, programs, interpret, barriers=True, coherent_x=True, spin_load=False):
    # refs: x [1, K0] bf16, w_0..w_{n-1}, counters_in, err_in, then outputs parts_0..parts_{n-1}, counters, err
    n = len(phases)
    x_ref = refs[0]
    w_refs = refs[1:1 + n]
    parts_refs = refs[3 + n:3 + 2 * n]
    counters_ref = refs[3 + 2 * n]
    err_ref = refs[4 + 2 * n]
    p = pl.program_id(0)
    row_ids = jnp.arange(ROWS, dtype=jnp.int32)
    x_mask = row_ids[:, None] < 1
    for i, (K, N, splits) in enumerate(phases):
        tiles = N // BN
        chunks = K // BK
        per_split = pl.cdiv(chunks, splits)
        items = tiles * splits
        my_items = pl.cdiv(items - p, programs)
        w_ref, out_ref = w_refs[i], parts_refs[i]

        def item_body(t, _, i=i, K=K, splits=splits, tiles=tiles, chunks=chunks, per_split=per_split,
                      w_ref=w_ref, out_ref=out_ref):
            item = p + t * programs
            split, tile = item // tiles, item % tiles  # neighbouring programs: neighbouring column tiles
            n0 = pl.multiple_of(tile * BN, BN)
            first = split * per_split
            count = jnp.minimum(per_split, chunks - first)

            def k_body(c, acc):
                k0 = pl.multiple_of((first + c) * BK, BK)
                if i == 0:
                    x = compat.triton_masked_load(x_ref.at[pl.ds(0, ROWS), pl.ds(k0, BK)], x_mask, 0)
                else:
                    prev = parts_refs[i - 1]
                    xs = jnp.zeros((1, BK), jnp.float32)
                    for s in range(prev.shape[0]):
                        xs = xs + compat.triton_masked_load(prev.at[s, pl.ds(0, 1), pl.ds(k0, BK)],
                                                            jnp.ones((1, BK), jnp.bool_), 0, coherent=coherent_x)
                    x = jnp.where(x_mask, jnp.broadcast_to(xs, (ROWS, BK)), 0.0).astype(jnp.bfloat16)
                w = w_ref[pl.ds(k0, BK), pl.ds(n0, BN)]
                return acc + jax.lax.dot_general(x, w, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)

            acc = jax.lax.fori_loop(0, count, k_body, jnp.zeros((ROWS, BN), jnp.float32))
            compat.triton_masked_store(out_ref.at[split, pl.ds(0, ROWS), pl.ds(n0, BN)], acc, x_mask)

        jax.lax.fori_loop(0, my_items, item_body, None)
        if i + 1 < n and barriers:
            compat.triton_barrier(interpret)
            compat.triton_atomic_add(counters_ref, (i,), 1)

            def cond(c):
                return (c[0] < programs) & (c[1] < SPIN_LIMIT)

            def body(c):
                if spin_load:
                    seen = compat.triton_masked_load(counters_ref.at[pl.ds(i, 1)], jnp.ones((1,), jnp.bool_), 0,
                                                     coherent=True)[0]
                    return seen, c[1] + 1
                return compat.triton_atomic_add(counters_ref, (i,), 0), c[1] + 1

            _, spins = jax.lax.while_loop(cond, body, (jnp.int32(0), jnp.int32(0)))

            @pl.when(spins >= SPIN_LIMIT)
            def _():
                err_ref[0] = jnp.int32(1)


@functools.partial(jax.jit, static_argnames=("phases", "programs", "num_stages", "barriers", "coherent_x", "spin_load"))
def chain(x, ws, *, phases, programs, num_stages=3, barriers=True, coherent_x=True, spin_load=False):
    n = len(phases)
    counters = jnp.zeros((n,), jnp.int32)
    err = jnp.zeros((1,), jnp.int32)
    whole = pl.no_block_spec
    out_shape = [jax.ShapeDtypeStruct((s, ROWS, N), jnp.float32) for (K, N, s) in phases]
    out_shape += [jax.ShapeDtypeStruct((n,), jnp.int32), jax.ShapeDtypeStruct((1,), jnp.int32)]
    outs = pl.pallas_call(
        functools.partial(_chain_kernel, phases=phases, programs=programs, interpret=False, barriers=barriers,
                          coherent_x=coherent_x, spin_load=spin_load),
        grid=(programs,), in_specs=[whole] * (n + 3), out_specs=[whole] * (n + 2), out_shape=out_shape,
        input_output_aliases={n + 1: n, n + 2: n + 1},
        compiler_params=compat.triton_compiler_params(4, num_stages), name="chain_gemv",
    )(jnp.pad(x, ((0, ROWS - 1), (0, 0))), *ws, counters, err)
    return outs[n - 1][:, 0].sum(0), outs[n + 1]


def xla_layer(x, ws, phases):
    for (K, N, s), w in zip(phases, ws):
        x = (x[:, :K] @ w)
    return x


if __name__ == "__main__":
    from device_trace import gpu_kernel_events
    compat.silence_triton_deprecation()
    out_dir = os.environ.get("OUT", "/tmp")
    LAYERS = 6
    key = jax.random.key(0)
    # (K, N, K splits): q/k/v fused, o, gate/up fused, down (inputs: the previous output's first K).
    shapes = ((4096, 12288), (4096, 4096), (4096, 22016), (11008, 4096))
    layers = [[jax.random.normal(jax.random.fold_in(key, 10 * l + i), s, jnp.bfloat16) * 0.02
               for i, s in enumerate(shapes)] for l in range(LAYERS)]
    x0 = jax.random.normal(key, (1, 4096), jnp.bfloat16)
    total_bytes = sum(k * n * 2 for k, n in shapes)
    res = dict(bytes_per_layer=total_bytes, runs={})

    def run_xla(x, layers):
        outs = []
        for ws in layers:
            outs.append(xla_layer(x, ws, [(k, n, 1) for k, n in shapes]))
        return outs

    fx = jax.jit(run_xla)
    ref = fx(x0, layers)

    def timed(name, fn):
        ev = gpu_kernel_events(fn, 5)
        tot = collections.defaultdict(float)
        for nme, s, d in ev:
            tot[nme] += d / 1e3
        us = sum(tot.values()) / (5 * LAYERS)
        res["runs"][name] = dict(us_per_layer=round(us, 2), tbps=round(total_bytes / us / 1e6, 3),
                                 kernels={k[:40]: round(v / (5 * LAYERS), 2) for k, v in tot.items()})
        print(name, res["runs"][name]["us_per_layer"], "us/layer", res["runs"][name]["tbps"], "TB/s", flush=True)

    timed("xla", lambda: fx(x0, layers))
    for programs, splits, bar, stages, coh, spin in (
            (264, (4, 4, 4, 4), True, 4, True, False), (264, (4, 4, 4, 4), True, 4, False, False),
            (264, (4, 4, 4, 4), True, 4, False, True), (264, (4, 4, 4, 4), False, 4, False, True),
            (264, (2, 2, 4, 2), True, 4, False, True), (264, (2, 2, 4, 2), False, 4, False, True),
            (396, (4, 4, 4, 4), True, 3, False, True), (396, (4, 4, 4, 4), False, 3, False, True)):
        phases = tuple((k, n, s) for (k, n), s in zip(shapes, splits))
        f = jax.jit(lambda x, layers: [chain(x, ws, phases=phases, programs=programs, barriers=bar, num_stages=stages,
                                             coherent_x=coh, spin_load=spin) for ws in layers])
        outs = f(x0, layers)
        errs = [int(e[0]) for _, e in outs]
        diff = max(float(jnp.max(jnp.abs(o.astype(jnp.float32) - r[0].astype(jnp.float32)))) for (o, _), r in zip(outs, ref))
        scale = max(float(jnp.max(jnp.abs(r.astype(jnp.float32)))) for r in ref)
        print(f"chain P={programs} splits={splits} barriers={bar} stages={stages} coh={coh} spinload={spin}: spin errors {errs}, max |diff| {diff:.4g} (max |ref| {scale:.4g})", flush=True)
        if any(errs):
            continue
        timed(f"chain_P{programs}_s{'-'.join(map(str, splits))}_bar{int(bar)}_st{stages}_coh{int(coh)}_spin{int(spin)}",
              lambda: f(x0, layers))
    json.dump(res, open(os.path.join(out_dir, "chain_gemv.json"), "w"), indent=1)
