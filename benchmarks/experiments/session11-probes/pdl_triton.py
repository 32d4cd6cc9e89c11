"""Probe: does programmatic dependent launch (PDL) reach Pallas Triton kernels inside XLA's step, and can a
batch-1 matmul stream its first weight tiles while the kernel before it still runs?

Part 1 (mechanism). Kernel A (one program) reads %globaltimer, optionally runs
`griddepcontrol.launch_dependents`, then spins SPIN_NS. Kernel B (264 programs) reads %globaltimer at its
first instruction, runs `griddepcontrol.wait`, reads it again, then reads A's output. Four A -> B pairs in
one jit. If B's first timer reads before A's spin ended, XLA launched B with a programmatic edge and put no
wait of its own at B's entry, so a kernel may work before its predecessor ends.

Part 2 (benefit). Eight layers of: a one-program "add + RMSNorm" kernel (the decode step's, reading two
float32 partials) -> a 4096 x 12288 bf16 skinny matmul (the q/k/v shape, K split 2). Variants: as today;
the norm triggering its dependents at its start and the matmul waiting (griddepcontrol.wait) before its
first x load; plus the matmul loading its first 1 or 2 weight chunks before that wait. us a layer by wall
time of back-to-back calls and from a trace.

Run from the repository root on the GPU machine: python3 benchmarks/experiments/session11-probes/pdl_triton.py
(JSON to $OUT/pdl_triton-<XLA_FLAGS tag>.json).
"""
import functools
import json
import os
import sys
import time

sys.path.insert(0, "scripts")
import numpy as np
import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

SPIN_NS = 20_000
B_PROGRAMS = 264
I32 = jax.ShapeDtypeStruct((1,), jnp.int32)


def asm1(code, dep, constraint="r"):
    """The asm on a one-element vector (Triton's lowering of 0-d asm results does not mix with scalars),
    its result summed back to a scalar."""
    dep = jnp.full((1,), dep, jnp.float32 if constraint == "f" else jnp.int32)
    (out,) = plt.elementwise_inline_asm(code, args=[dep], constraints=f"=r,{constraint}", pack=1,
                                        result_shape_dtypes=[I32])
    return jnp.sum(out)


def timer(dep):
    return asm1("{ .reg .u64 t; mov.u64 t, %globaltimer; cvt.u32.u64 $0, t; }", dep)


def wait_zero(dep, constraint="r"):
    """griddepcontrol.wait, returning 0 (opaque to the compiler) so later addresses can depend on it."""
    return asm1("griddepcontrol.wait; mov.u32 $0, 0;", dep, constraint)


def trigger_zero(dep):
    return asm1("griddepcontrol.launch_dependents; mov.u32 $0, 0;", dep)


def params(warps=4, stages=1):
    return plt.CompilerParams(num_warps=warps, num_stages=stages)


# ---------------------------------------------------------------- part 1

def kernel_a(x_ref, o_ref, *, trigger):
    t0 = timer(x_ref[0])
    d = trigger_zero(t0) if trigger else t0 * 0

    def cond(c):
        _, t = c
        return (t - t0) < SPIN_NS

    def body(c):
        i, _ = c
        return i + 1, timer(i + d)

    i, t_end = lax.while_loop(cond, body, (jnp.int32(0), t0))
    o_ref[0] = t0
    o_ref[1] = t_end
    o_ref[2] = i
    o_ref[3] = x_ref[1] + 1


def kernel_b(a_ref, o_ref, *, wait):
    pid = pl.program_id(0)
    tb0 = timer(pid)
    z = wait_zero(tb0) if wait else tb0 * 0
    tb1 = timer(z + pid)
    o_ref[0, pid] = tb0
    o_ref[1, pid] = tb1
    o_ref[2, pid] = a_ref[3 + z]


def part1_chain(trigger, wait):
    a_call = pl.pallas_call(functools.partial(kernel_a, trigger=trigger), grid=(1,),
                            out_shape=jax.ShapeDtypeStruct((8,), jnp.int32), compiler_params=params(), name="pdl_a")
    b_call = pl.pallas_call(functools.partial(kernel_b, wait=wait), grid=(B_PROGRAMS,),
                            out_shape=jax.ShapeDtypeStruct((3, B_PROGRAMS), jnp.int32), compiler_params=params(),
                            name="pdl_b")

    @jax.jit
    def chain(x):
        outs = []
        for _ in range(4):
            a = a_call(x)
            b = b_call(a)
            outs.append((a, b))
            x = b[2, :8]
        return outs
    return chain


def part1():
    res = {}
    for trigger, wait in ((False, False), (False, True), (True, True)):
        f = part1_chain(trigger, wait)
        x = jnp.arange(8, dtype=jnp.int32)
        jax.block_until_ready(f(x))
        rows = []
        for _ in range(3):
            outs = jax.block_until_ready(f(x))
            for a, b in outs:
                a, b = np.asarray(a).astype(np.int64), np.asarray(b).astype(np.int64)
                rel = lambda t: int(((t - a[1]) + 2**31) % 2**32 - 2**31)  # ns after A's spin ended
                rows.append(dict(b_first_start=min(rel(t) for t in b[0]), b_last_start=max(rel(t) for t in b[0]),
                                 b_first_after_wait=min(rel(t) for t in b[1]), spin_iters=int(a[2])))
        key = f"trigger{int(trigger)}_wait{int(wait)}"
        res[key] = dict(b_first_start_ns=[r["b_first_start"] for r in rows],
                        b_last_start_ns=[r["b_last_start"] for r in rows],
                        b_first_after_wait_ns=[r["b_first_after_wait"] for r in rows],
                        spin_iters=rows[0]["spin_iters"])
        print(key, {k: (v[:6] if isinstance(v, list) else v) for k, v in res[key].items()}, flush=True)
    return res


# ---------------------------------------------------------------- part 2

D, N, SPLITS, BK, BN, ROWS = 4096, 12288, 2, 128, 64, 16
LAYERS = 8


def norm_kernel(p_ref, r_ref, g_ref, o_ref, *, trigger):
    # p [SPLITS, 1, N] f32 partials (reads the first D columns), r [1, D] residual, g [D] weight.
    z = trigger_zero(pl.program_id(0)) if trigger else 0
    cols = jnp.arange(D, dtype=jnp.int32)
    s = r_ref[0, pl.ds(z, D)].astype(jnp.float32)
    for i in range(SPLITS):
        s = s + p_ref[i, 0, pl.ds(0, D)]
    inv = lax.rsqrt(jnp.mean(s * s) + 1e-6)
    o_ref[0, :] = (s * inv * g_ref[...].astype(jnp.float32)).astype(o_ref.dtype)
    del cols


def skinny_kernel(x_ref, w_ref, o_ref, *, wait, pre):
    col_tile, split = pl.program_id(0), pl.program_id(1)
    n0 = pl.multiple_of(col_tile * BN, BN)
    per = D // BK // SPLITS
    first = split * per
    row_ids = jnp.arange(ROWS, dtype=jnp.int32)

    def w_chunk(i):
        k0 = pl.multiple_of((first + i) * BK, BK)
        return w_ref[pl.ds(k0, BK), pl.ds(n0, BN)]

    pre_tiles = [w_chunk(i) for i in range(pre)]
    if wait:
        dep = w_ref[first * BK, n0].astype(jnp.float32) if pre else (col_tile * 0).astype(jnp.float32)
        z = wait_zero(dep, "f")
    else:
        z = 0

    def x_chunk(i):
        k0 = pl.multiple_of((first + i) * BK, BK)
        return plt.load(x_ref.at[pl.ds(z, ROWS), pl.ds(k0, BK)], mask=row_ids[:, None] < 1, other=0)

    def dot(x, w):
        return lax.dot_general(x, w, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)

    acc = jnp.zeros((ROWS, BN), jnp.float32)
    for i in range(pre):
        acc = acc + dot(x_chunk(i), pre_tiles[i])
    acc = lax.fori_loop(pre, per, lambda i, acc: acc + dot(x_chunk(i), w_chunk(i)), acc)
    plt.store(o_ref.at[split, pl.ds(0, ROWS), pl.ds(n0, BN)], acc, mask=row_ids[:, None] < 1)


def part2_chain(trigger, wait, pre):
    norm = pl.pallas_call(functools.partial(norm_kernel, trigger=trigger), grid=(1,),
                          out_shape=jax.ShapeDtypeStruct((1, D), jnp.bfloat16), compiler_params=params(4, 1),
                          name="add_rms_norm")
    mm = pl.pallas_call(functools.partial(skinny_kernel, wait=wait, pre=pre), grid=(N // BN, SPLITS),
                        out_shape=jax.ShapeDtypeStruct((SPLITS, 1, N), jnp.float32), compiler_params=params(4, 3),
                        name="skinny_matmul")

    @jax.jit
    def chain(parts, resid, g, ws):
        for w in ws:
            h = norm(parts, resid, g)
            parts = mm(h, w)
        return parts
    return chain


def wall_us(f, args, reps=50):
    jax.block_until_ready(f(*args))
    t = time.perf_counter()
    for _ in range(reps):
        out = f(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t) / reps * 1e6


def part2():
    from device_trace import gpu_kernel_events
    key = jax.random.key(0)
    ws = [jax.random.normal(jax.random.fold_in(key, i), (D, N), jnp.bfloat16) * 0.02 for i in range(LAYERS)]
    parts = jax.random.normal(jax.random.fold_in(key, 100), (SPLITS, 1, N), jnp.float32)
    resid = jax.random.normal(jax.random.fold_in(key, 101), (1, D), jnp.bfloat16)
    g = jnp.ones((D,), jnp.bfloat16)
    variants = {"base": (False, False, 0), "pdl_wait": (True, True, 0), "pdl_pre1": (True, True, 1),
                "pdl_pre2": (True, True, 2), "wait_pre2_no_trigger": (False, True, 2)}
    fs = {k: part2_chain(*v) for k, v in variants.items()}
    ref = np.asarray(fs["base"](parts, resid, g, ws))
    res = {"max_abs_diff_vs_base": {}, "us_per_layer": {k: [] for k in fs}, "trace": {}}
    for k, f in fs.items():
        res["max_abs_diff_vs_base"][k] = float(np.max(np.abs(np.asarray(f(parts, resid, g, ws)) - ref)))
    for r in range(3):  # rounds in turn, so drift falls on all alike
        for k, f in fs.items():
            res["us_per_layer"][k].append(round(wall_us(f, (parts, resid, g, ws)) / LAYERS, 3))
    for k, f in fs.items():
        ev = sorted(gpu_kernel_events(lambda: f(parts, resid, g, ws), 5), key=lambda e: e[1])
        by = {}
        for name, _, d in ev:
            by.setdefault(name, []).append(d / 1e3)
        gaps = [s1 - (s0 + d0) for (_, s0, d0), (_, s1, _) in zip(ev, ev[1:])]
        gaps = [x for x in gaps if x < 20_000]
        res["trace"][k] = dict(kernel_us={n: round(float(np.mean(v)), 3) for n, v in by.items()},
                               span_us_per_layer=round((ev[-1][1] + ev[-1][2] - ev[0][1]) / 5 / LAYERS / 1e3, 3),
                               mean_gap_us=round(float(np.mean(gaps)) / 1e3, 3), min_gap_us=round(float(np.min(gaps)) / 1e3, 3))
        print(k, res["trace"][k], res["us_per_layer"][k], flush=True)
    return res


if __name__ == "__main__":
    flags = os.environ.get("XLA_FLAGS", "")
    res = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "xla_flags": flags}
    for name, fn in (("part1", part1), ("part2", part2)):
        try:
            res[name] = fn()
        except Exception as e:  # keep the other part's result
            res[name + "_error"] = f"{type(e).__name__}: {str(e)[:1500]}"
            print(res[name + "_error"], flush=True)
    tag = os.environ.get("PROBE_TAG", "default")
    print(json.dumps(res, indent=1))
    json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), f"pdl_triton-{tag}.json"), "w"), indent=1)
