"""GPU kernels of a function's calls, read from a jax.profiler trace (for the benchmark scripts).

jax.profiler.ProfileData parses the trace in-process, so no TensorBoard or xprof is needed.
"""

from __future__ import annotations

import bisect
import glob
import os
import re
import shutil
import tempfile
from collections import defaultdict

import jax

_MATMUL_WORDS = ("gemm", "gemv", "xmma", "cublas", "cutlass", "wgmma", "nvjet", "skinny_matmul")
_COLLECTIVE = re.compile(r"(AllReduce|AllGather|ReduceScatter|AllToAll|SendRecv|Broadcast|Reduce)", re.I)


def traced(run, host_detail: bool = False):
    """The jax.profiler trace of run() (ProfileData), or None where none was written (events_by_device and
    host_summary read one). host_detail: XLA's runtime events in detail and no Python calls (TraceWindow)."""
    window = TraceWindow(host_detail)
    window.start()
    try:
        run()
    finally:
        data = window.stop()
    return data


def _gpu_kernels(data):
    """Every GPU kernel event of a trace. Only the stream lines hold kernels; the "XLA Ops" / "XLA Modules"
    lines summarise them again."""
    for plane in data.planes:
        if plane.name.startswith("/device:GPU"):
            for line in plane.lines:
                if line.name.startswith("Stream"):
                    yield from line.events


def gpu_kernel_events(fn, reps: int) -> list[tuple[str, int, int]]:
    """(kernel name, start ns, duration ns) of every GPU kernel run by `reps` calls of fn.

    fn is called once untraced first (compiles stay out of the trace). Empty when no trace or no
    GPU plane was written (e.g. on a CPU).
    """
    jax.block_until_ready(fn())

    def run():
        for _ in range(reps):
            out = fn()
        jax.block_until_ready(out)

    data = traced(run)
    return [] if data is None else [(e.name, e.start_ns, e.duration_ns) for e in _gpu_kernels(data)]


def host_summary(data, reps: int, top: int = 30) -> dict:
    """What the host threads did in a trace of `reps` steps: per thread (line) its events' time a step at the top
    level (events nest), and the `top` event names by time a step with their calls a step (nested ones counted
    under their own names too, so names overlap). Empty where no trace was written."""
    if data is None:
        return {}
    per = lambda ns: ns / reps / 1e3  # noqa: E731  (us per step)
    threads, names = {}, defaultdict(lambda: [0, 0])
    for plane in data.planes:
        if not plane.name.startswith("/host"):
            continue
        for line in plane.lines:
            top_level, end_so_far = 0, None
            for e in sorted(line.events, key=lambda e: e.start_ns):
                names[e.name[:100]][0] += e.duration_ns
                names[e.name[:100]][1] += 1
                if end_so_far is None or e.start_ns >= end_so_far:
                    top_level += e.duration_ns
                    end_so_far = e.start_ns + e.duration_ns
                elif e.start_ns + e.duration_ns > end_so_far:
                    top_level += e.start_ns + e.duration_ns - end_so_far
                    end_so_far = e.start_ns + e.duration_ns
            if top_level:
                threads[f"{plane.name} {line.name}"[:100]] = per(top_level)
    busiest = sorted(threads.items(), key=lambda kv: -kv[1])[:top]
    heaviest = sorted(names.items(), key=lambda kv: -kv[1][0])[:top]
    return {"threads_us_per_step": dict(busiest),
            "events": [{"name": k, "us_per_step": per(t), "calls_per_step": n / reps} for k, (t, n) in heaviest]}


def events_by_device(data) -> dict[str, list[tuple[str, int, int]]]:
    """device plane name (e.g. `/device:GPU:0`) -> (kernel name, start ns, duration ns) of every GPU kernel in a
    trace (ProfileData, from traced(run): run must wait for its device work); empty for None or no GPU plane."""
    if data is None:
        return {}
    out = {}
    for plane in data.planes:
        if plane.name.startswith("/device:GPU"):
            events = [(e.name, e.start_ns, e.duration_ns) for line in plane.lines if line.name.startswith("Stream")
                      for e in line.events]
            if events:
                out[plane.name] = sorted(events, key=lambda e: e[1])
    return out


class TraceWindow:
    """A trace started and stopped by hand, around work that is not one function call (some steps of an engine
    running its own loop): start(), then stop() -> the trace (events_by_device reads its kernels). The caller makes
    sure the device work it wants has finished before stop() (or counts whole steps inside the window)."""

    def __init__(self, host_detail: bool = False):
        """host_detail: the host tracer at its verbose level (XLA's runtime events: thunks, command buffers) and
        the Python tracer off, whose events would slow the host and hide what the runtime does."""
        self._dir: str | None = None
        self._options = None
        if host_detail:
            self._options = jax.profiler.ProfileOptions()
            self._options.host_tracer_level = 2
            self._options.python_tracer_level = 0

    @property
    def running(self) -> bool:
        return self._dir is not None

    def start(self) -> None:
        if self._dir is not None:
            raise RuntimeError("TraceWindow.start: a trace is already running")
        self._dir = tempfile.mkdtemp(prefix="trace-window-")
        jax.profiler.start_trace(self._dir, profiler_options=self._options)

    def stop(self):
        """The trace since start() (jax.profiler.ProfileData), or None where none was written."""
        if self._dir is None:
            raise RuntimeError("TraceWindow.stop: no trace is running")
        tmp, self._dir = self._dir, None
        try:
            jax.profiler.stop_trace()
            paths = glob.glob(os.path.join(tmp, "**", "*.xplane.pb"), recursive=True)
            return jax.profiler.ProfileData.from_file(paths[0]) if paths else None
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def per_kernel_us(events: list[tuple[str, int, int]], reps: int) -> dict[str, float]:
    """gpu_kernel_events of `reps` calls -> us per call spent in each kernel, by name (first seen first)."""
    totals = defaultdict(float)
    for name, _, duration_ns in events:
        totals[name] += duration_ns
    return {name: total / reps / 1e3 for name, total in totals.items()}


def kernel_times(fn, reps: int) -> dict[str, float]:
    """us per call of fn spent in each GPU kernel (empty where no GPU trace was written)."""
    return per_kernel_us(gpu_kernel_events(fn, reps), reps)


def kernel_ns_per_batch(batches) -> dict[str, dict[str, tuple[int, int]]]:
    """Runs each (label, thunk) of batches in order under one trace, each inside a TraceAnnotation named by its
    label; a thunk must wait for its own device work before it returns (so the windows never overlap).
    Returns label -> {hlo module: (kernel ns, kernel count)} over every GPU kernel whose start lies in that
    label's window (a jit's module is `jit_<its function's name>`). Labels must be unique. Empty where no trace
    or no GPU plane was written."""
    labels = [label for label, _ in batches]
    if len(set(labels)) != len(labels):
        raise ValueError("kernel_ns_per_batch: batch labels must be unique")

    def run():
        for label, thunk in batches:
            with jax.profiler.TraceAnnotation(label):
                thunk()

    data = traced(run)
    if data is None:
        return {}
    kernels = [(e.start_ns, e.duration_ns, dict(e.stats).get("hlo_module", "")) for e in _gpu_kernels(data)]
    wanted = set(labels)
    windows = [(e.start_ns, e.start_ns + e.duration_ns, e.name) for plane in data.planes
               if plane.name.startswith("/host") for line in plane.lines for e in line.events if e.name in wanted]
    return assign_to_windows(kernels, windows, labels) if kernels else {}


def assign_to_windows(kernels, windows, labels) -> dict[str, dict[str, tuple[int, int]]]:
    """kernels [(start ns, duration ns, hlo module)], windows [(start ns, end ns, label)] (not overlapping) ->
    label -> {module: (ns, count)} of the kernels that start inside each window (others are dropped)."""
    windows = sorted(windows)
    starts = [w[0] for w in windows]
    out = {label: defaultdict(lambda: [0, 0]) for label in labels}
    for start, duration, module in kernels:
        i = bisect.bisect_right(starts, start) - 1
        if i >= 0 and start <= windows[i][1]:
            acc = out[windows[i][2]][module]
            acc[0] += duration
            acc[1] += 1
    return {label: {m: (int(ns), count) for m, (ns, count) in mods.items()} for label, mods in out.items()}


def kernel_kind(name: str) -> str:
    lowered = name.lower()
    if "nccl" in lowered:
        return "collective"
    if any(w in lowered for w in _MATMUL_WORDS):
        return "matmul"
    return "attention" if "ragged" in lowered or "attention" in lowered else "other"


def device_summary(events: list[tuple[str, int, int]], reps: int, top: int = 12) -> dict:
    """One GPU's kernels over `reps` steps (sorted by start) -> per-step figures (see the module docstring)."""
    busy, end_so_far = 0, None
    gaps = defaultdict(lambda: [0.0, 0])
    by_kind = defaultdict(lambda: [0.0, 0])
    collectives = defaultdict(lambda: [0.0, 0])
    for name, start, duration in events:
        kind = kernel_kind(name)
        by_kind[kind][0] += duration
        by_kind[kind][1] += 1
        if kind == "collective":
            match = _COLLECTIVE.search(name)
            entry = collectives[match.group(1) if match else name[:40]]
            entry[0] += duration
            entry[1] += 1
        end = start + duration
        if end_so_far is None or start >= end_so_far:  # a new busy interval; the gap before it was idle
            if end_so_far is not None:
                gap = gaps[name[:100]]
                gap[0] += start - end_so_far
                gap[1] += 1
            busy += duration
            end_so_far = end
        elif end > end_so_far:  # overlapping kernels: only the part past the interval's end is new busy time
            busy += end - end_so_far
            end_so_far = end
    span = end_so_far - events[0][1]
    per = lambda ns: ns / reps / 1e3  # noqa: E731  (us per step)
    largest = sorted(gaps.items(), key=lambda kv: -kv[1][0])[:top]
    kernels = defaultdict(lambda: [0.0, 0])
    for name, _, duration in events:
        kernels[name[:100]][0] += duration
        kernels[name[:100]][1] += 1
    heaviest = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:3 * top]
    return {"kernels_per_step": len(events) / reps, "kernel_us_per_step": per(sum(d for _, _, d in events)),
            "busy_us_per_step": per(busy), "span_us_per_step": per(span), "idle_us_per_step": per(span - busy),
            "by_kind": {k: {"us_per_step": per(t), "kernels_per_step": n / reps} for k, (t, n) in by_kind.items()},
            "collectives": {k: {"us_per_step": per(t), "calls_per_step": n / reps} for k, (t, n) in collectives.items()},
            "idle_gaps_before": [{"kernel": k, "us_per_step": per(t), "gaps_per_step": n / reps}
                                 for k, (t, n) in largest],
            "heaviest": [{"kernel": k, "us_per_step": per(t), "calls_per_step": n / reps} for k, (t, n) in heaviest]}
