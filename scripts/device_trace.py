"""GPU kernels of a function's calls, read from a jax.profiler trace (for the benchmark scripts).

jax.profiler.ProfileData parses the trace in-process, so no TensorBoard or xprof is needed.
"""

from __future__ import annotations

import glob
import os
import tempfile
from collections import defaultdict

import jax


def gpu_kernel_events(fn, reps: int) -> list[tuple[str, int, int]]:
    """(kernel name, start ns, duration ns) of every GPU kernel run by `reps` calls of fn.

    fn is called once untraced first (compiles stay out of the trace). Empty when no trace or no
    GPU plane was written (e.g. on a CPU).
    """
    jax.block_until_ready(fn())
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp):
            for _ in range(reps):
                out = fn()
            jax.block_until_ready(out)
        paths = glob.glob(os.path.join(tmp, "**", "*.xplane.pb"), recursive=True)
        if not paths:
            return []
        data = jax.profiler.ProfileData.from_file(paths[0])
    events = []
    for plane in data.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            # Only the stream lines hold kernels; "XLA Ops"/"XLA Modules" lines summarise them again.
            if line.name.startswith("Stream"):
                events += [(event.name, event.start_ns, event.duration_ns) for event in line.events]
    return events


def per_kernel_us(events: list[tuple[str, int, int]], reps: int) -> dict[str, float]:
    """gpu_kernel_events of `reps` calls -> us per call spent in each kernel, by name (first seen first)."""
    totals = defaultdict(float)
    for name, _, duration_ns in events:
        totals[name] += duration_ns
    return {name: total / reps / 1e3 for name, total in totals.items()}


def kernel_times(fn, reps: int) -> dict[str, float]:
    """us per call of fn spent in each GPU kernel (empty where no GPU trace was written)."""
    return per_kernel_us(gpu_kernel_events(fn, reps), reps)
