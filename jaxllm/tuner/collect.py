"""Collecting the tuning data the cost model learns from (issue 22): every candidate schedule of each attention op
timed over shapes drawn as serving meets them, one dataset per device (format: benchmarks/tuning/README.md;
train.py reads it). scripts/collect_tuning_data.py draws the shapes, scripts/recheck_tuner.py times given ones
again; its docstring says what is timed and why.

What is timed is what a step runs: `dispatch.ragged_attention` under each candidate's Kernels, one jit per (head
shape, op, bucket, candidate) compiled once, over one layer's rBlock pool. Kernel time is read by a `KernelTimer`
the caller hands in (the scripts hand scripts/common/device_trace's, which reads a jax.profiler trace): this
module knows the kernels and their schedules, not how a GPU's kernel times are read. Plan.timing "wall" times
with the host clock and needs no timer (the CPU, the tests).
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
import threading
import time
from typing import Callable, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.tuner.candidates import candidates
from pallas_kernels.dispatch import Kernels, default_kernels, ragged_attention

K = 1024
TIMINGS = ("kernel", "wall")

# What a dataset's numbers mean (its header's `definitions`).
DEFINITIONS = dict(us="median over reps of the GPU kernel time of one attention call over one layer's pool, "
                      "microseconds (plan.timing 'kernel': summed from a jax.profiler trace; 'wall': host clock over "
                      "back-to-back calls)",
                   wall_us="median over reps of host wall time per call (back-to-back calls)",
                   kv_lens="real sequences' KV lengths, query tokens included",
                   q_lens="prefill: query tokens per sequence")


@dataclasses.dataclass(frozen=True)
class Plan:
    """Sizes of one run; SMOKE shrinks it to CPU interpret-mode size."""

    heads: tuple[tuple[int, int, int], ...] = ((32, 32, 128), (32, 8, 128))  # (q heads, kv heads, head_dim)
    block: int = 256
    pool_gb: float = 24.0  # K + V bytes of the one-layer pool per head shape
    max_len: int = 512 * K  # the rBlock tables' capacity (the compiled width, as a 512K engine's)
    max_draw: int | None = None  # longest decode KV length drawn (None: max_len): a run over short shapes
    decode_buckets: tuple[int, ...] = (1, 4, 16, 64, 256)
    prefill_buckets: tuple[int, ...] = (16, 128, 512, 2048, 8192)
    max_prefill_seqs: int = 8
    max_prefix: int = 128 * K
    min_prefix: int = 1  # shortest cached prefix drawn (where a sequence has one): a run over long prefixes
    placements: int = 8  # pool places a shape's rBlock tables rotate over, call to call
    reps: int = 5
    rep_s: float = 0.002  # wall seconds per rep and candidate (at most max_calls calls)
    max_calls: int = 16
    timing: str = "kernel"  # "kernel": GPU kernel time (a KernelTimer); "wall": host clock per call
    max_shapes: int = 120  # per group
    budget_s: float = 300.0  # wall seconds from the start for everything

    def __post_init__(self):
        if self.timing not in TIMINGS:
            raise ValueError(f"Plan.timing {self.timing!r} is not one of {TIMINGS}")


SMOKE = Plan(heads=((4, 2, 128),), block=64, pool_gb=0.002, max_len=1 * K, decode_buckets=(1, 4),
             prefill_buckets=(16, 128), max_prefill_seqs=3, max_prefix=256, placements=2, reps=1, rep_s=0.0,
             max_shapes=2, budget_s=1e9, timing="wall")


class KernelTimer(Protocol):
    """Reads GPU kernel times: runs each (label, thunk) of `batches` in order (a thunk waits for its own device
    work, so their windows never overlap; labels are unique) and returns label -> {hlo module: (kernel ns, kernel
    count)} over the kernels that started inside its window; {} where it saw no GPU kernels."""

    def __call__(self, batches: list[tuple[str, Callable[[], None]]]) -> dict[str, dict[str, tuple[int, int]]]: ...


def base_kernels(interpret: bool) -> Kernels:
    """The Kernels every candidate is applied to: on a CPU (interpret) every op on Triton in interpret mode
    (Mosaic needs a Hopper), else what the engine runs on this GPU."""
    if interpret:
        return Kernels(decode_attention="triton", prefill_attention="triton", interpret=True)
    return default_kernels("auto", head_dim=128)


def make_pool(num_blocks: int, hkv: int, block: int, d: int, seed: int) -> jax.Array:
    """[num_blocks, hkv, block, d] bf16: a small random slab tiled (no full-size float32 temporary)."""
    tile = min(num_blocks, 64)
    slab = jax.random.normal(jax.random.key(seed), (tile, hkv, block, d), jnp.bfloat16)
    reps = -(-num_blocks // tile)
    return jax.jit(lambda s: jnp.tile(s, (reps, 1, 1, 1))[:num_blocks])(slab)


def make_pools(plan: Plan, heads: tuple[int, int, int]) -> tuple[jax.Array, jax.Array]:
    """(k_pool, v_pool) of one layer for a head shape: ~plan.pool_gb of K + V, at least one sequence of
    plan.max_len."""
    hq, hkv, d = heads
    per_block = 2 * hkv * plan.block * d * 2  # K + V bytes of one rBlock
    num_blocks = max(int(plan.pool_gb * 1e9 // per_block), plan.max_len // plan.block)
    return make_pool(num_blocks, hkv, plan.block, d, 0), make_pool(num_blocks, hkv, plan.block, d, 1)


def decode_lens(rng, n: int, cap_total: int, max_len: int) -> tuple[np.ndarray, str]:
    """n KV lengths in 1..max_len, sum <= cap_total: equal, ragged (log-uniform) or few-long."""
    kind = rng.choice(["equal", "ragged", "few_long"])
    top = int(np.exp(rng.uniform(np.log(1), np.log(min(max_len, cap_total)))))
    if kind == "equal":
        lens = np.full(n, top)
    elif kind == "ragged":
        lens = np.exp(rng.uniform(0, np.log(max(top, 1)), n))
        lens[0] = top
    else:
        lens = np.exp(rng.uniform(0, np.log(max(min(top, 2 * K), 1)), n))
        lens[: max(1, n // 16)] = top
    lens = np.maximum(lens.astype(np.int64), 1)
    if lens.sum() > cap_total:
        lens = np.maximum((lens * (cap_total / lens.sum())).astype(np.int64), 1)
    return np.minimum(lens, max_len).astype(np.int32), str(kind)


def prefill_shape(rng, bucket: int, plan: Plan, cap_total: int) -> tuple[np.ndarray, np.ndarray]:
    """(q_lens, prefixes): t real tokens in (bucket / 2, bucket] packed from 1..max_prefill_seqs sequences."""
    t = int(rng.integers(bucket // 2 + 1, bucket + 1))
    n = int(rng.integers(1, min(plan.max_prefill_seqs, t) + 1))
    cuts = np.sort(rng.choice(np.arange(1, t), n - 1, replace=False)) if n > 1 else np.array([], np.int64)
    q_lens = np.diff(np.concatenate([[0], cuts, [t]])).astype(np.int64)
    drawn = np.exp(rng.uniform(np.log(plan.min_prefix), np.log(plan.max_prefix), n))
    prefixes = np.where(rng.random(n) < 0.5, 0, drawn).astype(np.int64)
    room = max(cap_total - int(q_lens.sum()), 0)
    if prefixes.sum() > room:
        prefixes = (prefixes * (room / max(prefixes.sum(), 1))).astype(np.int64)
    return q_lens.astype(np.int32), prefixes.astype(np.int32)


def rblock_tables(kv_lens, block: int, width: int, layers: int, pool_blocks: int, seq_pad: int) -> np.ndarray:
    """[layers, seq_pad, width] int32: each sequence's rBlocks consecutive, each layer's (placement's) run at
    another place in the pool (disjoint where the pool holds them all, overlapping otherwise)."""
    nb = -(-np.asarray(kv_lens, np.int64) // block)
    total = int(nb.sum())
    stride = total if layers * total <= pool_blocks else max(pool_blocks - total, 0) // max(layers - 1, 1)
    out = np.zeros((layers, seq_pad, width), np.int32)
    for layer in range(layers):
        at = layer * stride
        for s, n in enumerate(nb):
            out[layer, s, :n] = np.arange(at, at + n)
            at += n
    return out


class Collector:
    """Compiles each candidate once per bucket and times shapes, within the plan's budget.

    Args:
      plan: the run's sizes and budget.
      base: the Kernels each candidate is applied to (base_kernels).
      seed: the shape draws' seed.
      kernel_timer: reads GPU kernel times; needed where plan.timing is "kernel" (ValueError without one).
    """

    def __init__(self, plan: Plan, base: Kernels, seed: int, *, kernel_timer: KernelTimer | None = None):
        if plan.timing == "kernel" and kernel_timer is None:
            raise ValueError("Plan.timing 'kernel' needs a kernel_timer (scripts/common/device_trace."
                             "kernel_ns_per_batch reads one from a profiler trace); 'wall' needs none")
        self.plan, self.base, self.kernel_timer = plan, base, kernel_timer
        self.rng = np.random.default_rng(seed)
        self.t0 = time.time()
        self.compile_seconds: list[float] = []  # per group so far: the estimate for the groups left

    def left(self) -> float:
        """Seconds of the plan's budget left."""
        return self.plan.budget_s - (time.time() - self.t0)

    def time_shape(self, steps, placements) -> tuple[list[float], list[float]]:
        """(device us, wall us) per call for each (compiled step, hlo module name), timed in turns; call c
        takes placements[c % len(placements)] (the same shape, its rBlocks elsewhere in the pool)."""
        plan, n = self.plan, len(steps)
        calls = []
        for step, _ in steps:  # the first call also warms up
            start = time.perf_counter()
            jax.block_until_ready(step(*placements[0]))
            once = time.perf_counter() - start
            calls.append(int(np.clip(plan.rep_s / max(once, 1e-6), 1, plan.max_calls)))
        walls = [[] for _ in steps]

        def batch(i):
            def run():
                step, start = steps[i][0], time.perf_counter()
                for c in range(calls[i]):
                    out = step(*placements[c % len(placements)])
                jax.block_until_ready(out)
                walls[i].append((time.perf_counter() - start) / calls[i])
            return run

        order = [(rep, (rep + j) % n) for rep in range(plan.reps) for j in range(n)]
        batches = [(f"tune:{rep}:{i}", batch(i)) for rep, i in order]
        wall_us = lambda: [round(float(np.median(w)) * 1e6, 2) for w in walls]  # noqa: E731
        if plan.timing == "wall":
            for _, run in batches:
                run()
            return wall_us(), wall_us()
        found = self.kernel_timer(batches)
        if not found:
            raise RuntimeError("the kernel timer saw no GPU kernels: on this machine run with --timing wall")
        device = [[] for _ in steps]
        for rep, i in order:
            label, module = f"tune:{rep}:{i}", steps[i][1]
            ns, count = found[label].get(module, (0, 0))
            if count == 0:
                raise RuntimeError(f"no kernel of {module} in its trace window {label} (saw {sorted(found[label])})")
            device[i].append(ns / calls[i] / 1e3)
        return [round(float(np.median(t)), 2) for t in device], wall_us()

    def compile(self, fns, schedules, args):
        """[(compiled step, its hlo module name)] and {name: compile seconds or None (failed)}: traced and lowered
        one at a time, compiled in threads (XLA's compile is C++, so candidates of a group compile side by side)."""
        t0, lowered, steps, compile_s = time.perf_counter(), [], [], {}
        modules = [f"jit_{fn.__name__}" for fn in fns]
        for sched, fn in zip(schedules, fns):
            try:
                lowered.append(fn.lower(*args))
            except Exception as exc:  # a candidate that cannot take these shapes is left out
                print(f"  {sched.name}: lowering failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                lowered.append(None)
        # Daemon threads: a compile stuck past its timeout costs one candidate and never holds the exit.
        results: list[dict] = [{} for _ in lowered]

        def run(low, out):
            try:
                out["step"] = low.compile()
            except Exception as exc:  # reported below, with the candidate's name
                out["error"] = exc

        threads = []
        for low, out in zip(lowered, results):
            t = None if low is None else threading.Thread(target=run, args=(low, out), daemon=True)
            if t is not None:
                t.start()
            threads.append(t)
        for sched, t, out in zip(schedules, threads, results):
            step = None
            if t is not None:
                t.join(timeout=max(120 - (time.perf_counter() - t0), 1))
                try:
                    if "error" in out:
                        raise out["error"]
                    if "step" not in out:
                        raise TimeoutError("compile still running after 120 s")
                    step = out["step"]
                    jax.block_until_ready(step(*args))
                except Exception as exc:
                    print(f"  {sched.name}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                    step = None
            compile_s[sched.name] = None if step is None else round(time.perf_counter() - t0, 2)
            steps.append((step, modules[len(steps)]))
        self.compile_seconds.append(time.perf_counter() - t0)
        return steps, compile_s

    def group(self, op, heads, bucket, pools, schedules, groups_left, est_compile, shapes=None) -> list[dict]:
        """Compiles each candidate for this bucket, then times shapes until the group's share of what the
        budget leaves after est_compile (the later groups' compiles) is spent. Returns the dataset rows.
        shapes: [(q_lens, kv_lens)] to time, in order, instead of drawing them (every one is timed, whatever
        the budget: scripts/recheck_tuner.py)."""
        plan = self.plan
        hq, hkv, d = heads
        k_pool, v_pool = pools
        pool_blocks = k_pool.shape[0]
        width = plan.max_len // plan.block
        decode = op == "decode"
        tokens = bucket
        seq_pad = bucket if decode else min(bucket, 256)
        q = jax.random.normal(jax.random.key(bucket), (tokens, hq, d), jnp.bfloat16)
        fns = []
        for sched in schedules:
            kernels = sched.apply(self.base)

            def fn(q, kp, vp, tables, lens, cu, kernels=kernels):
                return ragged_attention(q, kp, vp, tables, lens, cu, single_query=decode, kernels=kernels)

            fn.__name__ = f"tune_{op}_{sched.name}"  # its hlo module's name: how the trace tells candidates apart
            fns.append(jax.jit(fn))
        rows, first = [], True
        m0, share = time.time(), 0.0  # set when the first shape has compiled the candidates
        given = None if shapes is None else list(shapes)
        while (len(rows) < len(given) if given is not None else
               len(rows) < plan.max_shapes and (first or (time.time() - m0 < share and self.left() > 0))):
            cap = pool_blocks * plan.block
            if given is not None:
                q_lens, kv_lens = (np.asarray(a, np.int32) for a in given[len(rows)])
                prefixes, n = kv_lens - q_lens, len(kv_lens)
                if n > seq_pad or int(q_lens.sum()) > tokens or int(kv_lens.max()) > plan.max_len:
                    raise ValueError(f"shape of {n} sequences, {int(q_lens.sum())} query tokens, longest KV "
                                     f"{int(kv_lens.max())} does not fit {op} bucket {bucket} (at most {seq_pad} "
                                     f"sequences, {tokens} tokens, KV {plan.max_len})")
                kind = "given"
            elif decode:
                n = 1 if bucket == 1 else int(self.rng.integers(bucket // 2 + 1, bucket + 1))
                kv_lens, kind = decode_lens(self.rng, n, cap, plan.max_draw or plan.max_len)
                q_lens, prefixes = np.ones(n, np.int32), kv_lens - 1
            else:
                q_lens, prefixes = prefill_shape(self.rng, bucket, plan, min(cap, plan.max_len))
                kv_lens, kind = (q_lens + prefixes).astype(np.int32), "prefill"
                n = len(q_lens)
            lens = np.zeros(seq_pad, np.int32)
            lens[:n] = kv_lens
            cu = np.full(seq_pad + 1, int(q_lens.sum()), np.int32)
            cu[: n + 1] = np.concatenate([[0], np.cumsum(q_lens)])
            if decode:
                cu = np.arange(seq_pad + 1, dtype=np.int32)
            tables = rblock_tables(kv_lens, plan.block, width, plan.placements, pool_blocks, seq_pad)
            lens, cu = jnp.asarray(lens), jnp.asarray(cu)
            placements = [(q, k_pool, v_pool, jnp.asarray(t), lens, cu) for t in tables]
            if first:
                steps, compile_s = self.compile(fns, schedules, placements[0])
                live = [i for i, s in enumerate(schedules) if compile_s[s.name] is not None]
                first = False
                m0 = time.time()
                share = max((self.left() - est_compile) / max(groups_left, 1), 0.0)
            us, wall = self.time_shape([steps[i] for i in live], placements)
            rows.append(dict(op=op, heads=list(heads), block=plan.block, dtype="bfloat16", bucket=bucket, kind=kind,
                             kv_lens=kv_lens.tolist(), q_lens=None if decode else q_lens.tolist(),
                             us={schedules[i].name: t for i, t in zip(live, us)},
                             wall_us={schedules[i].name: t for i, t in zip(live, wall)}))
        best = [min(r["us"], key=r["us"].get) for r in rows]
        print(f"[{time.time() - self.t0:6.1f}s] {op} heads {heads} bucket {bucket}: {len(rows)} shapes, compile "
              f"{compile_s}, best counts {dict((b, best.count(b)) for b in sorted(set(best)))}", flush=True)
        return rows


def write_dataset(path: str, header: dict, rows: list[dict]) -> None:
    """The dataset at path (.jsonl.gz: the header line, then a row per shape), replaced whole: a reader never
    sees half of one."""
    with gzip.open(path + ".tmp", "wt") as f:
        for line in [header, *rows]:
            f.write(json.dumps(line) + "\n")
    os.replace(path + ".tmp", path)


def collect_dataset(collector: Collector, ops, path: str, header: dict) -> list[dict]:
    """Every (head shape, op, bucket) group of collector's plan timed in turn, its share of the budget each (the
    groups the budget cannot reach skipped, said so), the dataset at path rewritten after every group (a killed
    run keeps what it measured). header: the dataset's first line (its `elapsed_s` and `candidates` filled in
    here). Returns the rows."""
    plan = collector.plan
    groups = [(heads, op, b) for heads in plan.heads for op in ops
              for b in (plan.decode_buckets if op == "decode" else plan.prefill_buckets)]
    rows, pools = [], None
    for gi, (heads, op, bucket) in enumerate(groups):
        if gi == 0 or groups[gi - 1][0] != heads:
            pools = None  # the last head shape's pools freed before the next one's are made
            pools = make_pools(plan, heads)
            num_blocks, hkv, block, d = pools[0].shape
            print(f"pool {heads}: {num_blocks} rBlocks of {block} ({2 * pools[0].nbytes / 1e9:.1f} GB K+V)", flush=True)
        if collector.left() <= 0:
            print(f"budget spent: {op} heads {heads} bucket {bucket} and later groups skipped", flush=True)
            continue
        schedules = candidates(op, collector.base, bucket, block_size=plan.block)
        seen = collector.compile_seconds
        per_group = max(seen) if seen else 10.0
        rows += collector.group(op, heads, bucket, pools, schedules, len(groups) - gi,
                                est_compile=per_group * (len(groups) - gi - 1))
        header["elapsed_s"] = round(time.time() - collector.t0, 1)
        header["candidates"] = {o: [dict(name=s.name, features=s.features, fields=repr(s.fields), backend=s.backend)
                                    for s in candidates(o, collector.base, max(plan.prefill_buckets),
                                                        block_size=plan.block)]
                                for o in ("decode", "prefill")}
        write_dataset(path, header, rows)
    return rows
