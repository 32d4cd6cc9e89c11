"""What every benchmark script shares: timing, the device and its HBM floor, result files, tables.

Scripts import this module (`from scripts.common import harness`) and the rest of scripts/common, and never
each other, so one script's private helpers can change without breaking another. Nothing here runs at
import time: `python -m scripts.X --help` works on a machine without a GPU.
"""

from __future__ import annotations

import datetime
import json
import os
import time
import traceback

import numpy as np

# Datasheet HBM bandwidth per device kind (jax.Device.device_kind), TB/s. Only cards the figures in
# BENCHMARKS.md were measured on: a floor for any other card would be a guess, so it is None.
HBM_TB_S = {
    "NVIDIA H100 80GB HBM3": 3.35,
    "NVIDIA H200": 4.8,
}

# The repository's benchmarks/results/ (this file is scripts/common/harness.py).
RESULTS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks",
                           "results")


def device_kind() -> str:
    """The first device's kind, e.g. `NVIDIA H200` (`cpu` on a CPU machine)."""
    import jax  # here, so that importing the harness stays cheap for --help

    return jax.devices()[0].device_kind


def hbm_floor_tb_s(device: str) -> float | None:
    """The device's datasheet HBM bandwidth in TB/s, or None (with a note on stderr) for an unlisted one."""
    tb_s = HBM_TB_S.get(device)
    if tb_s is None:
        print(f"note: no HBM bandwidth known for {device!r} (known: {sorted(HBM_TB_S)}); "
              "floor and fraction-of-HBM columns are left empty", flush=True)
    return tb_s


def today() -> str:
    """The local date, ISO format: the `date` field of every result."""
    return datetime.date.today().isoformat()


def result_stem(device: str, name: str, date: str | None = None) -> str:
    """`<device>-<date>-<HHMM>-<name>`: the device kind lower-cased with dashes for spaces, the date
    (today's unless given: pass the one the result records), and the UTC time of day, which keeps a
    second run on the same day from overwriting the first one's file."""
    date = today() if date is None else date
    return f"{device.lower().replace(' ', '-')}-{date}-{time.strftime('%H%M', time.gmtime())}-{name}"


def write_json(path: str, result: dict) -> None:
    """Writes result to path (directories made), after stamping the fields every result carries.

    `device`, `date` and `hbm_floor_tb_s` are filled in where the script has not set them, so every
    JSON under benchmarks/results/ says where and when it was measured and against which floor.
    """
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if "device" not in result:
        result["device"] = device_kind()
    result.setdefault("date", today())
    if "hbm_floor_tb_s" not in result:
        result["hbm_floor_tb_s"] = HBM_TB_S.get(result["device"])
    with open(path, "w") as f:
        json.dump(result, f, indent=1, default=str)


def write_result_and_table(out_dir: str, stem: str, result: dict, table_md: str) -> str:
    """write_json to <out_dir>/<stem>.json and the markdown table beside it (<stem>.md); returns the path
    without its extension."""
    path = os.path.join(out_dir, stem)
    write_json(path + ".json", result)
    with open(path + ".md", "w") as f:
        f.write(table_md)
    return path


def spread(times) -> dict:
    """Median, min, max and interquartile range of a list of timings (same unit as given)."""
    x = np.asarray(times, dtype=np.float64)
    if x.size == 0:
        raise ValueError("spread of no timings: times is empty")
    q1, q3 = np.percentile(x, [25, 75])
    return dict(median=float(np.median(x)), min=float(x.min()), max=float(x.max()), iqr=float(q3 - q1))


def markdown_table(header: list[str], rows: list[list]) -> str:
    """A Markdown table; None cells print as `-`."""
    lines = ["| " + " | ".join(header) + " |", "| --- " * len(header) + "|"]
    lines += ["| " + " | ".join("-" if c is None else str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def row_value(rows, case, impl, key):
    """The value of key in the first row of rows for (case, impl), or None."""
    for r in rows:
        if r["case"] == case and r.get("impl") == impl and key in r:
            return r[key]
    return None


def ratio(a, b) -> str:
    """`a / b` to two places, `-` if either is missing."""
    return "-" if a is None or b is None else f"{a / b:.2f}"


# ---- timing: compiled JAX steps, dispatched back to back ----

def time_batch(step, args: tuple, *, calls: int, per: int) -> float:
    """Seconds per call / per of step(*args) (compiled and warm): `calls` calls dispatched back to back,
    one wait at the end, so dispatch overlaps the device work. `per` divides out the layers inside one call."""
    import jax

    start = time.perf_counter()
    for _ in range(calls):
        r = step(*args)
    jax.block_until_ready(r)
    return (time.perf_counter() - start) / calls / per


def size_calls(step, args: tuple, *, reps: int, target_s: float, max_calls: int) -> int:
    """Calls per rep so that `reps` reps take about target_s: one call, not counted, times step(*args)
    (compiled already, so it doubles as the warm-up); clipped to [1, max_calls]."""
    import jax

    start = time.perf_counter()
    jax.block_until_ready(step(*args))
    once = time.perf_counter() - start
    return int(np.clip(target_s / reps / max(once, 1e-6), 1, max_calls))


def time_calls(step, args: tuple, *, reps: int, target_s: float, max_calls: int, per: int) -> tuple[list[float], int]:
    """Times step(*args), compiled already: (seconds per call / per, one value per rep; calls per rep),
    the calls sized by size_calls, each rep one time_batch."""
    calls = size_calls(step, args, reps=reps, target_s=target_s, max_calls=max_calls)
    return [time_batch(step, args, calls=calls, per=per) for _ in range(reps)], calls


def median_time(fn, *args, reps: int = 7, target_s: float = 0.35, max_calls: int = 100) -> float:
    """Seconds per call of fn(*args): compiled and warmed first, then the median of time_calls' reps."""
    import jax

    jax.block_until_ready(fn(*args))
    times, _ = time_calls(fn, args, reps=reps, target_s=target_s, max_calls=max_calls, per=1)
    return float(np.median(times))


# ---- interleaved measurement of several implementations of one case ----

class Bench:
    """Runs measurements, prints a progress line each, keeps the rows per section.

    plan: anything with `reps`, `target_s`, `budget_s` and `settle` (a script's frozen Plan).
    hbm_tb_s: the device's HBM bandwidth (hbm_floor_tb_s), None to leave `frac_hbm` out.
    """

    def __init__(self, plan, interpret: bool, sections=("decode", "ragged", "fragmented", "prefill"),
                 hbm_tb_s: float | None = None):
        import jax

        from scripts.common.gpu_state import GpuSampler

        self.plan, self.interpret, self.hbm_tb_s = plan, interpret, hbm_tb_s
        self.t0 = time.time()
        self.rows: dict[str, list[dict]] = {name: [] for name in sections}
        self.seed = int(time.time())  # fresh inputs every run; recorded in the JSON
        self.keys = iter(jax.random.split(jax.random.key(self.seed), 100_000))
        # Clock and power during each implementation's timed batches (none on CPU machines).
        self.gpu = None if interpret else GpuSampler.start()

    def normal(self, shape, dtype=None):
        import jax
        import jax.numpy as jnp

        return jax.random.normal(next(self.keys), shape, jnp.bfloat16 if dtype is None else dtype)

    def over_budget(self) -> bool:
        return time.time() - self.t0 > self.plan.budget_s

    def measure(self, section, case, impl, fn, shared, layers, *, kv_bytes=None, flops=None, ref=None,
                err_of=None, note=None):
        """Time fn(shared, layer) over the layers inside one jit; returns the first layer's output or None."""
        return self.measure_interleaved(section, case, [dict(impl=impl, fn=fn, shared=shared, layers=layers,
                                                             ref=ref, err_of=err_of, note=note)],
                                        kv_bytes=kv_bytes, flops=flops)[0]

    def measure_interleaved(self, section, case, entries, *, kv_bytes=None, flops=None):
        """Time several implementations of one case in turns: rep r times every entry once, starting at
        entry r mod n, so a drift of the card's speed over the run (seen: 3-5% between the first and
        the last of back-to-back measurements) is shared by all of them instead of favouring whichever
        runs first. With plan.settle each timed batch follows an untimed one of the same
        implementation: without it, a kernel timed right after another inherits that one's clock and
        power state (on the H200, causal prefill in plain turns timed the Mosaic kernel 6% faster and
        the Triton one 7% slower than in sustained blocks). entries: dicts of impl, fn, shared, layers,
        and optional ref (an output to compare with, or the string "first": the first entry's output),
        err_of, note. Returns each entry's first layer's output (None where it failed)."""
        import jax
        import jax.numpy as jnp

        prepared, outs = [], []
        for e in entries:
            row = dict(case=case, impl=e["impl"])
            if e.get("note"):
                row["note"] = e["note"]
            ref = outs[0] if isinstance(e.get("ref"), str) else e.get("ref")
            out, timed = None, None
            try:
                step = jax.jit(lambda s, ls, fn=e["fn"]: [fn(s, layer) for layer in ls])
                args = (e["shared"], e["layers"])
                start = time.perf_counter()
                outs_all = jax.block_until_ready(step(*args))
                row["compile_s"] = round(time.perf_counter() - start, 2)
                out = outs_all[0]
                del outs_all
                if not all(bool(jnp.all(jnp.isfinite(x.astype(jnp.float32)))) for x in jax.tree.leaves(out)):
                    row["nonfinite"] = True
                if ref is not None:
                    err_of = e.get("err_of")
                    row["max_abs_err"] = float(err_of(out, ref) if err_of else
                                               jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))))
                calls = size_calls(step, args, reps=self.plan.reps, target_s=self.plan.target_s, max_calls=100)
                timed = (step, args, calls, len(e["layers"]))
            except Exception as exc:  # one failing implementation must not hide the others
                row["error"] = f"{type(exc).__name__}: {str(exc)[:400]}"
                traceback.print_exc()
                out = None
            prepared.append((row, timed, [], []))
            outs.append(out)
        live = [p for p in prepared if p[1] is not None]
        for rep in range(self.plan.reps):
            for i in range(len(live)):
                _, (step, args, calls, per), times, windows = live[(rep + i) % len(live)]
                try:
                    if self.plan.settle and len(live) > 1:
                        # Untimed first: the card's clocks and power settle to this kernel's own steady
                        # state instead of carrying over the previous implementation's.
                        time_batch(step, args, calls=calls, per=per)
                    start = time.time()
                    times.append(time_batch(step, args, calls=calls, per=per))
                    windows.append((start, time.time()))
                except Exception as exc:
                    live[(rep + i) % len(live)][0]["error"] = f"{type(exc).__name__}: {str(exc)[:400]}"
        for row, timed, times, windows in prepared:
            if timed is not None and times and "error" not in row:
                if self.gpu is not None:
                    row["gpu"] = self.gpu.summary(windows)
                s = spread(times)
                t = s["median"]
                row.update(us=round(t * 1e6, 1), calls=timed[2] * len(times), buffers=timed[3],
                           spread=round((s["max"] - s["min"]) / t, 3), iqr=round(s["iqr"] / t, 3))
                if len(entries) > 1:
                    row["timing"] = "interleaved with " + ", ".join(e["impl"] for e in entries if e["impl"] != row["impl"])
                if kv_bytes is not None:
                    row["tbps"] = round(kv_bytes / t / 1e12, 3)
                    if self.hbm_tb_s is not None:
                        row["frac_hbm"] = round(kv_bytes / t / 1e12 / self.hbm_tb_s, 3)
                if flops is not None:
                    row.update(tflops=round(flops / t / 1e12, 1), ms=round(t * 1e3, 3))
            self.rows[section].append(row)
            shown = {k: v for k, v in row.items() if k not in ("case", "impl")}
            print(f"[{time.time() - self.t0:6.1f}s] {section} | {case} | {row['impl']} | {shown}", flush=True)
        return outs

    def skip(self, section, case, impl, why):
        self.rows[section].append(dict(case=case, impl=impl, skipped=why))
        print(f"[{time.time() - self.t0:6.1f}s] {section} | {case} | {impl} | skipped: {why}", flush=True)


def gpu_state_table(rows) -> str:
    """Markdown: each timed implementation's median SM clock and power during its timed batches, and the
    share of samples at the software power cap (gpu_state.py); empty when nothing was sampled."""
    sampled = [r for r in rows if r.get("gpu")]
    if not sampled:
        return ""
    lines = ["| case | implementation | us | SM MHz | W | power-capped |", "| --- | --- | --- | --- | --- | --- |"]
    for r in sampled:
        g = r["gpu"]
        lines.append(f"| {r['case']} | {r['impl']} | {r['us']:,.1f} | {g['sm_mhz']} | {g['power_w']:.0f} | "
                     f"{g['power_capped']:.0%} |")
    return "\n".join(lines) + "\n"
