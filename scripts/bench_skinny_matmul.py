"""Skinny matmul benchmark: pallas_kernels.skinny_matmul vs XLA's jnp.dot on Llama-2-7B weight shapes.

  XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 PYTHONPATH=$PWD python3 scripts/bench_skinny_matmul.py [--out DIR]
  PYTHONPATH=$PWD python scripts/bench_skinny_matmul.py --smoke --out /tmp   # tiny sizes, CPU interpret mode

bf16 x [M, K] @ w [K, N] for M in (1, 8) and (K, N) = q/k/v/o 4096x4096, fused qkv 4096x12288, gate or
up 4096x11008, fused gate+up 4096x22016, down 11008x4096, lm_head 4096x32000, with default XLA flags:
 1. table: ours (default block sizes; split-K partials summed and cast by XLA) and `jnp.dot(x, w)`
    (bf16 out): wall time per layer, and the kernels' own time from a profiler trace.
 2. sweep: a list of block sizes on a few (M, K, N), with kernel times, to pick the defaults.
Each timed function runs the matmul over several distinct weight matrices inside one jit (like
layers; their bytes together > 4x the 50 MB L2), each layer's x made to depend on the previous
layer's output through an optimization barrier (no kernel), so launches are amortised and nothing
runs concurrently or fuses across layers. us = median over reps of elapsed / calls / layers;
TB/s = K * N * 2 weight bytes / us. Writes `<device>-<date>-<HHMM>-skinny-matmul.json` under --out
(default benchmarks/results/) and prints a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import os
import platform
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import compat
from pallas_kernels.skinny_matmul import SkinnyBlockSizes, default_block_sizes, skinny_matmul, skinny_matmul_reference
from scripts.common import harness
from scripts.common.device_trace import kernel_times
from scripts.common.harness import time_calls


@dataclasses.dataclass(frozen=True)
class Plan:
    """Sizes of one run; SMOKE shrinks everything to CPU interpret-mode size."""

    shapes: tuple[tuple[int, int], ...] = ((4096, 4096), (4096, 12288), (4096, 11008), (4096, 22016),
                                           (11008, 4096), (4096, 32000))
    rows: tuple[int, ...] = (1, 8)
    # (M, K, N) x (block_n, block_k, programs, warps, stages), all combinations; k_splits =
    # round(programs / column tiles), at least 1 (programs 1: never split, no reduction).
    sweep_cases: tuple[tuple[int, int, int], ...] = ((1, 4096, 4096), (1, 11008, 4096), (1, 4096, 12288),
                                                     (8, 4096, 4096), (8, 11008, 4096), (8, 4096, 12288))
    sweep_configs: tuple[tuple[int, int, int, int, int], ...] = tuple(
        (block_n, block_k, programs, 4, stages) for block_n, block_k in ((64, 128), (128, 64))
        for programs in (256, 320, 384, 512) for stages in (3, 4))
    sweep_trace: bool = False  # also profile each sweep row (ranks by the kernels' own time; ~1 s a row)
    trace_reps: int = 3  # profiled calls per table row, for the kernels' own time (0: no profile)
    layer_bytes: float = 256e6  # distinct weight matrices per timed step until their bytes reach this
    max_layers: int = 8
    reps: int = 5
    target_s: float = 0.12  # timed seconds per measurement, all reps together
    budget_s: float = 200.0  # sweep items past this are skipped, so the run ends inside its device limit


SMOKE = Plan(shapes=((256, 384), (200, 100)), rows=(1, 3), sweep_cases=((1, 256, 384),),
             sweep_configs=((64, 64, 4, 4, 2), (128, 128, 1, 4, 3)),
             layer_bytes=1e6, max_layers=2, reps=1, target_s=0.0, budget_s=1e9, trace_reps=0)


class Bench:
    """Times functions over layers of weights, prints a progress line each, keeps the rows."""

    def __init__(self, plan: Plan, interpret: bool):
        self.plan, self.interpret = plan, interpret
        self.t0 = time.time()
        self.rows: dict[str, list[dict]] = {"table": [], "sweep": []}
        self.seed = int(time.time())  # fresh inputs every run; recorded in the JSON
        self.keys = iter(jax.random.split(jax.random.key(self.seed), 100_000))
        self._problems = {}

    def over_budget(self) -> bool:
        return time.time() - self.t0 > self.plan.budget_s

    def problem(self, m: int, k: int, n: int):
        """(xs, ws): per-layer activations [M, K] and distinct weights [K, N], bf16, cached per shape."""
        key = (m, k, n)
        if key not in self._problems:
            self._problems.clear()  # one shape's weights on the device at a time
            layers = int(np.clip(math.ceil(self.plan.layer_bytes / (k * n * 2)), 2, self.plan.max_layers))
            ws = [jax.random.normal(next(self.keys), (k, n), jnp.bfloat16) * (k ** -0.5) for _ in range(layers)]
            xs = [jax.random.normal(next(self.keys), (m, k), jnp.bfloat16) for _ in range(layers)]
            self._problems[key] = (xs, ws)
        return self._problems[key]

    def measure(self, section: str, m: int, k: int, n: int, impl: str, fn, *, trace: bool = False, **extra) -> dict:
        """Time fn(x, w) chained over the layers inside one jit; with trace, also its kernels' own time."""
        row = dict(m=m, k=k, n=n, impl=impl, **extra)
        try:
            xs, ws = self.problem(m, k, n)

            def step(xs, ws):
                outs, prev = [], None
                for x, w in zip(xs, ws):
                    if prev is not None:  # a data dependency on the previous layer, no kernel
                        x, _ = jax.lax.optimization_barrier((x, prev))
                    prev = fn(x, w)
                    outs.append(prev)
                return outs

            step = jax.jit(step)
            start = time.perf_counter()
            outs = jax.block_until_ready(step(xs, ws))
            row["compile_s"] = round(time.perf_counter() - start, 2)
            if outs[0].ndim == 2:
                ref = skinny_matmul_reference(xs[0], ws[0], out_dtype=jnp.float32)
                err = jnp.max(jnp.abs(outs[0].astype(jnp.float32) - ref)) / jnp.max(jnp.abs(ref))
                row["rel_err"] = float(err)
            del outs
            times, calls = time_calls(step, (xs, ws), reps=self.plan.reps, target_s=self.plan.target_s,
                                      max_calls=200, per=len(xs))
            spread = harness.spread(times)
            t = spread["median"]
            row.update(us=round(t * 1e6, 2), tbps=round(k * n * 2 / t / 1e12, 3), layers=len(xs),
                       calls=calls * self.plan.reps, spread=round((spread["max"] - spread["min"]) / t, 3),
                       iqr=round(spread["iqr"] / t, 3))
            if trace and self.plan.trace_reps and not self.interpret:
                kernels = kernel_times(lambda: step(xs, ws), self.plan.trace_reps)
                if kernels:
                    kernel_us = sum(kernels.values()) / len(xs)
                    row.update(kernel_us=round(kernel_us, 2), kernel_tbps=round(k * n * 2 / kernel_us / 1e6, 3),
                               kernels={name[:80]: round(v / len(xs), 2) for name, v in kernels.items()})
        except Exception as e:  # one failing configuration must not hide the others
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            traceback.print_exc()
        self.rows[section].append(row)
        shown = {key: v for key, v in row.items() if key not in ("m", "k", "n", "impl")}
        print(f"[{time.time() - self.t0:6.1f}s] {section} | M={m} {k}x{n} | {impl} | {shown}", flush=True)
        return row


def _ours(bench: Bench, block_sizes):
    return lambda x, w: skinny_matmul(x, w, block_sizes=block_sizes, interpret=bench.interpret)


def table_section(bench: Bench):
    for k, n in bench.plan.shapes:
        for m in bench.plan.rows:
            bs = default_block_sizes(m, k, n)
            bench.measure("table", m, k, n, "xla", lambda x, w: jnp.dot(x, w), trace=True)
            bench.measure("table", m, k, n, "ours", _ours(bench, bs), trace=True, block_sizes=dataclasses.asdict(bs))


def _sizes(k: int, n: int, block_n: int, block_k: int, programs: int, warps: int = 4, stages: int = 3):
    splits = max(1, min(round(programs / math.ceil(n / block_n)), math.ceil(k / block_k)))
    return SkinnyBlockSizes(block_n=block_n, block_k=block_k, k_splits=splits, num_warps=warps, num_stages=stages)


def sweep_section(bench: Bench):
    plan = bench.plan
    for (m, k, n), (block_n, block_k, programs, warps, stages) in itertools.product(plan.sweep_cases,
                                                                                   plan.sweep_configs):
        if bench.over_budget():
            print("sweep: over budget, stopping", flush=True)
            return
        bs = _sizes(k, n, block_n, block_k, programs, warps, stages)
        bench.measure("sweep", m, k, n, "ours", _ours(bench, bs), trace=plan.sweep_trace,
                      block_sizes=dataclasses.asdict(bs), programs=math.ceil(n / block_n) * bs.plan(k)[2])


SECTIONS = {"table": table_section, "sweep": sweep_section}


def _cell(row: dict, us: str, tbps: str) -> str:
    return f"{row[us]} ({row[tbps]})" if us in row else row.get("error", "-")[:40]


def summarize(result: dict) -> str:
    rows = result["sections"]["table"]
    get = {(r["m"], r["k"], r["n"], r["impl"]): r for r in rows}
    lines = ["| M | K x N | XLA us (TB/s) | ours us (TB/s) | XLA / ours | XLA kernels us (TB/s) "
             "| ours kernels us (TB/s) | XLA / ours, kernels | ours sum of splits us | ours rel err |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for key in dict.fromkeys((r["m"], r["k"], r["n"]) for r in rows):
        xla, ours = get.get((*key, "xla"), {}), get.get((*key, "ours"), {})
        ratio = f"{xla['us'] / ours['us']:.2f}" if "us" in xla and "us" in ours else "-"
        both = "kernel_us" in xla and "kernel_us" in ours
        kratio = f"{xla['kernel_us'] / ours['kernel_us']:.2f}" if both else "-"
        # The kernels other than ours: XLA's reduction of the split partials (and the cast).
        reduce_us = sum(v for name, v in ours.get("kernels", {}).items() if "skinny_matmul" not in name)
        err = f"{ours['rel_err']:.1e}" if "rel_err" in ours else "-"
        lines.append(f"| {key[0]} | {key[1]} x {key[2]} | {_cell(xla, 'us', 'tbps')} | {_cell(ours, 'us', 'tbps')} "
                     f"| {ratio} | {_cell(xla, 'kernel_us', 'kernel_tbps')} "
                     f"| {_cell(ours, 'kernel_us', 'kernel_tbps')} | {kratio} | {reduce_us:.2f} | {err} |")
    sweep = [r for r in result["sections"]["sweep"] if "us" in r]
    if sweep:
        lines += ["", "Sweep, best five per case by kernel time (block_n, block_k, k_splits, warps, stages, programs):"]
        for m, k, n in dict.fromkeys((r["m"], r["k"], r["n"]) for r in sweep):
            best = sorted((r for r in sweep if (r["m"], r["k"], r["n"]) == (m, k, n)),
                          key=lambda r: r.get("kernel_us", r["us"]))[:5]
            cells = [f"{r['us']} us {r['tbps']} TB/s, kernels {r.get('kernel_us', '-')} us "
                     f"({r['block_sizes']['block_n']}, {r['block_sizes']['block_k']}, "
                     f"{r['block_sizes']['k_splits']}, {r['block_sizes']['num_warps']}, "
                     f"{r['block_sizes']['num_stages']}, {r['programs']})" for r in best]
            lines.append(f"- M={m} {k} x {n}: " + "; ".join(cells))
    return "\n".join(lines) + "\n"


def _shape(text: str) -> tuple[int, int]:
    """'KxN' -> (K, N), both positive."""
    try:
        k, n = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"shape {text!r} is not KxN (two integers, e.g. 1280x5120)") from None
    if k < 1 or n < 1:
        raise argparse.ArgumentTypeError(f"shape {text!r} needs K and N >= 1")
    return k, n


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=harness.RESULTS_DIR)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes; on a CPU the kernel runs interpreted")
    parser.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=list(SECTIONS))
    parser.add_argument("--budget-s", type=float, default=None, help="skip sweep items past this many seconds")
    parser.add_argument("--shapes", nargs="+", type=_shape, default=None, metavar="KxN",
                        help="the table's weight shapes (default: Llama-2-7B's), e.g. a tensor shard's: 1280x5120")
    parser.add_argument("--rows", nargs="+", type=int, default=None, help="the table's M values (default 1 8)")
    args = parser.parse_args(argv)
    compat.silence_triton_deprecation()
    plan = SMOKE if args.smoke else Plan()
    if args.shapes:
        plan = dataclasses.replace(plan, shapes=tuple(args.shapes))
    if args.rows:
        plan = dataclasses.replace(plan, rows=tuple(args.rows))
    if args.budget_s is not None:
        plan = dataclasses.replace(plan, budget_s=args.budget_s)
    interpret = not compat.on_gpu()
    device = harness.device_kind()
    hbm = harness.hbm_floor_tb_s(device)
    print(f"jax {jax.__version__}, {jax.devices()}, interpret={interpret}, smoke={args.smoke}", flush=True)
    date = harness.today()
    stem = harness.result_stem(device, "skinny-matmul" + ("-smoke" if args.smoke else ""), date)
    os.makedirs(args.out, exist_ok=True)
    bench = Bench(plan, interpret)
    result = dict(script="scripts/bench_skinny_matmul.py", argv=sys.argv[1:], device=device, date=date,
                  jax=jax.__version__, python=platform.python_version(), smoke=args.smoke, seed=bench.seed,
                  command="XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 PYTHONPATH=$PWD python3 scripts/bench_skinny_matmul.py "
                          + " ".join(sys.argv[1:]),
                  plan=dataclasses.asdict(plan), hbm_tbps_datasheet=hbm, hbm_floor_tb_s=hbm, sections=bench.rows,
                  definitions=dict(
                      us="median over reps of elapsed / calls / layers, layers chained inside one jit",
                      tbps="K * N * 2 bytes of bf16 weights / us",
                      xla="jnp.dot(x, w), bf16 in and out, default XLA flags",
                      ours="skinny_matmul with default_block_sizes (split-K partials summed and cast by XLA)",
                      kernel_us="sum of the GPU kernels' own durations per layer, from a jax.profiler trace "
                                "(no launch gaps); kernels: each kernel's share",
                      rel_err="max |out - float32 reference| / max |reference|, first layer"))
    path = os.path.join(args.out, stem + ".json")
    for name in args.sections:
        SECTIONS[name](bench)
        result["elapsed_s"] = round(time.time() - bench.t0, 1)
        harness.write_json(path, result)  # after each section, so a killed run still leaves its numbers
    table = summarize(result)
    result["table_md"] = table
    harness.write_json(path, result)
    print("\n" + table, flush=True)
    print(f"wrote {path} ({result['elapsed_s']} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
