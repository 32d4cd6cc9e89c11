"""The executor's device calls, run in order on one background thread.

Launching a jitted step costs the host milliseconds: XLA enqueues each of the step's few hundred kernels on
each device from the calling thread (1.8 ms a 7B decode step on one H200, 3.7 ms on four: benchmarks/NOTES.md,
"instance step"). Done on the thread that also plans the next step, the two add up, and on a mesh of
several devices the host, not the devices, sets the pace. Here the calls run on their own thread, in the
order they were submitted (so every device sees the same program order, and a continuation finds the step
it continues already launched), while the caller plans on. jax releases the GIL while it launches.
"""

from __future__ import annotations

import concurrent.futures
from typing import Callable

__all__ = ["Launcher"]


class Launcher:
    """One worker thread; `submit` returns a Future of the call's result (its exception, if it raised)."""

    def __init__(self):
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="jaxllm-launch")
        self._last: concurrent.futures.Future | None = None

    def submit(self, fn: Callable, *args) -> concurrent.futures.Future:
        self._last = self._pool.submit(fn, *args)
        return self._last

    def run(self, fn: Callable, *args):
        """submit and wait: the result, or the exception raised."""
        return self.submit(fn, *args).result()

    def drain(self) -> None:
        """Wait until every submitted call has run (whether it raised or not)."""
        if self._last is not None:
            concurrent.futures.wait([self._last])
