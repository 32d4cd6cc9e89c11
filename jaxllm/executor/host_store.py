"""The host tier's data: which host run holds each host slot's rBlock, and the copies a StepPlan asks for.

The ledger (jaxllm.engine.host_tier) names slots; this store keeps, per slot, the run of rBlocks it was copied
out in and its row there. Host copies move whole runs: a plan's out copies are gathered from the pool into
compact runs of power-of-two lengths (a binary decomposition of their count, each run at most `max_run`
rBlocks: the gather and scatter programs are compiled for those lengths at warm-up, and no rBlock is padded), each
run handed to the HostTransfer (jaxllm.executor.host_transfer) as one copy; a plan's in copies bring back every
run they read from (whole, as it was copied out) and scatter the rows they need into the pool, donated, before
the step. Runs are immutable: a slot written again points at a new run, so a copy still in flight is never
overwritten, and a run's host memory is released once no slot points into it (`bytes_used` counts what is
held, which may exceed the ledger's slots while part of a run is still needed).

Device memory: a run gathered out, or copied back before its scatter, is a device array beside the pool. The runs
in flight each way are held to `max_copy_bytes` (the oldest of that direction is waited for before another starts
past it, which happens only when copies of more than that are still landing), so a big swap never needs more
device memory than twice that beside the pool. A run is at most half that long: two are in flight each way, so the
next copy is queued on the link before the one in front of it lands (with one run in flight the link idled while
the launcher saw it land and issued the next: ~74% of the link's rate into the devices on an H200). The two
directions are held apart so that copies out (a prefix cache spilling) and copies in (another prompt's history
coming back) share the host link's two directions instead of waiting for each other. Landed runs are let go at
the next copy.

Host memory: the backend's allocator for a host memory kind grows as runs arrive, and each growth pins fresh pages
(page-locking runs at a few GB/s, far below the link), on the launcher thread, before the copy can start. Warm-up
therefore copies the whole tier's bytes out once and lets them go (`reserve_blocks`): the allocator keeps what it
pinned, and serving's copies reuse it.

Called on the launcher thread (jaxllm.executor.launcher), between the steps: the order of device work is the
order of the calls, so the step after a copy reads the pool the copy left.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import queue
import threading
import time

import jax
import numpy as np

from jaxllm.contract import HostCopies
from jaxllm.contract import HostStoreStats
from jaxllm.executor.host_transfer import HostRun, HostTransfer

__all__ = ["MAX_COPY_BYTES", "HostStore", "run_lengths"]

MAX_COPY_BYTES = 1 << 30  # device bytes of runs in flight at once each way, by default (the module docstring)


def run_lengths(count: int, max_run: int) -> list[int]:
    """`count` rBlocks as runs of power-of-two lengths, longest first, none over max_run (a power of two)."""
    lengths = [max_run] * (count // max_run)
    rest = count % max_run
    bit = max_run
    while rest:
        bit //= 2
        if rest & bit:
            lengths.append(bit)
            rest -= bit
    return lengths


def _landed(host: HostRun) -> None:
    """Block until a run copied out has landed on the host (its HostRun and its arrays)."""
    host.wait()
    jax.block_until_ready(host.arrays())


@dataclasses.dataclass(eq=False)
class _Run:
    host: HostRun
    length: int
    live: int = 0  # slots pointing into it


class _CopyClock:
    """Times each direction's copies, on its own thread (the launcher never waits for one): the seconds that direction
    had a copy in flight, from a copy's start to its landing, copies in flight together counted once."""

    def __init__(self):
        self.seconds = {"out": 0.0, "in": 0.0}
        self._last_landed = {"out": 0.0, "in": 0.0}  # when the direction's previous copy was seen landed
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._done = threading.Condition()
        self._started = self._landed = 0
        threading.Thread(target=self._watch, name="jaxllm-host-copies", daemon=True).start()

    def started(self, direction: str, landed) -> None:
        """landed(): blocks until the copy started now has landed."""
        with self._done:
            self._started += 1
        self._queue.put((direction, time.perf_counter(), landed))

    def sync(self) -> None:
        """Wait until every copy started so far has landed (or failed)."""
        with self._done:
            target = self._started
            self._done.wait_for(lambda: self._landed >= target)

    def _watch(self) -> None:
        while True:
            direction, start, landed = self._queue.get()
            try:
                landed()
                # Copies are watched in the order they started, so a direction was busy from the later of this
                # copy's start and its previous copy's landing until now.
                now = time.perf_counter()
                self.seconds[direction] += now - max(start, self._last_landed[direction])
                self._last_landed[direction] = now
            except Exception:  # noqa: BLE001  (a failed copy fails its step; the clock only stops timing it)
                pass
            with self._done:
                self._landed += 1
                self._done.notify_all()


class HostStore:
    """The host runs of one engine's host tier (see the module docstring). programs: the StepPrograms whose
    gather_blocks / scatter_blocks move runs; transfer: how runs cross the host link; max_run: the longest run
    (a power of two; it is lowered until two runs fit max_copy_bytes); block_bytes: one rBlock's bytes (all layers);
    max_copy_bytes: device bytes the runs in flight may take together; slots_per_instance: each instance's host
    tier's slots (slot // slots_per_instance: the instance whose host keeps it; None: one instance);
    reserve_blocks: rBlocks of each instance's host memory warm-up copies out once and lets go (the tier's size:
    the module docstring's Host memory; 0: none)."""

    def __init__(self, programs, transfer: HostTransfer, *, max_run: int, block_bytes: int,
                 max_copy_bytes: int = MAX_COPY_BYTES, slots_per_instance: int | None = None,
                 reserve_blocks: int = 0):
        if max_run <= 0 or max_run & (max_run - 1):
            raise ValueError(f"max_run must be a power of two, got {max_run}")
        while max_run > 1 and 2 * max_run * block_bytes > max_copy_bytes:  # two runs in flight (the docstring)
            max_run //= 2
        self.programs = programs
        self.transfer = transfer
        self.max_run = max_run
        self.block_bytes = block_bytes
        self.max_copy_bytes = max(max_copy_bytes, block_bytes)
        self.slots_per_instance = slots_per_instance
        self.reserve_blocks = reserve_blocks
        self.reserved_seconds = 0.0  # warm-up's reservation (the module docstring's Host memory)
        # Per direction ("out", "in"): (bytes, wait until it landed, whether it landed (never waits)), oldest first
        self._in_flight = {"out": collections.deque(), "in": collections.deque()}
        self._in_flight_bytes = {"out": 0, "in": 0}
        self.bytes_used = 0  # host bytes held by runs some slot still points into
        self.blocks_out = self.blocks_in = 0  # rBlocks copied, each way
        self.runs_out = self.runs_in = 0  # copies (runs) issued, each way
        self._slots: dict[int, tuple[_Run, int]] = {}
        self._clock = _CopyClock()

    @property
    def copy_seconds(self) -> dict[str, float]:
        """Seconds each direction, "out" (to the host) and "in", had a copy in flight so far (from a copy's start to
        its landing; copies in flight together counted once)."""
        return dict(self._clock.seconds)

    def stats(self) -> HostStoreStats:
        """Host bytes held and copy seconds each way, a snapshot."""
        seconds = self.copy_seconds
        return HostStoreStats(bytes_used=self.bytes_used, copy_out_seconds=seconds["out"],
                              copy_in_seconds=seconds["in"])

    def run_lengths(self) -> list[int]:
        """Every run length a copy can have (each one gather and one scatter program)."""
        return [1 << i for i in range(self.max_run.bit_length())]

    def apply(self, pool, copies: HostCopies):
        """Run a plan's host copies (HostCopies says in which order); returns the pool for the step."""
        return self.copy_in(self.copy_out(pool, copies), copies)

    def copy_out(self, pool, copies: HostCopies):
        """A plan's dropped slots and copies out (before its recall copies); returns the pool, unchanged."""
        for slot in copies.dropped.tolist():
            self._forget(slot)
        out_blocks, out_slots = copies.out_blocks, copies.out_slots
        owners = np.zeros(len(out_slots), np.int64) if self.slots_per_instance is None else \
            out_slots // self.slots_per_instance
        for instance in np.unique(owners).tolist():  # a run lands in one instance's host tier
            mine = owners == instance
            blocks, slots = out_blocks[mine], out_slots[mine].tolist()
            start = 0
            for length in run_lengths(len(slots), self.max_run):
                self._make_room(length, "out")
                run = _Run(self._to_host(self.programs.gather_blocks(pool, blocks[start:start + length]), instance),
                           length)
                self.bytes_used += length * self.block_bytes
                for row, slot in enumerate(slots[start:start + length]):
                    self._forget(slot)
                    self._slots[slot] = (run, row)
                    run.live += 1
                start += length
        self.blocks_out += copies.num_out
        return pool

    def copy_in(self, pool, copies: HostCopies):
        """A plan's copies in (after its recall copies); returns the pool for the step."""
        # Rows needed of each run read, in the order the runs are first named.
        wanted: dict[_Run, np.ndarray] = {}
        for slot, block in zip(copies.in_slots.tolist(), copies.in_blocks.tolist()):
            run, row = self._slots[slot]
            targets = wanted.setdefault(run, np.full(run.length, -1, np.int32))
            targets[row] = block
        for run, targets in wanted.items():
            run.host.wait()  # never read a run before it has landed on the host
            self._make_room(run.length, "in")
            device = self.transfer.to_device(run.host)
            self._hold(run.length, "in", device, lambda arrays=device: jax.block_until_ready(arrays))
            self._clock.started("in", lambda arrays=device: jax.block_until_ready(arrays))
            pool = self.programs.scatter_blocks(pool, device, targets)
        for slot in copies.released.tolist():  # read for the last time (their runs stay until the copies land)
            self._forget(slot)
        self.blocks_in += copies.num_in
        self.runs_in += len(wanted)
        return pool

    def sync(self) -> None:
        """Wait until every copy issued so far has landed (benchmarks time copies with it; serving never waits)."""
        self._clock.sync()

    def warm_up(self, pool):
        """Compile the gather and scatter of every run length (and make one copy each way of each); returns the
        pool, unchanged."""
        for length in self.run_lengths():
            host = self._to_host(self.programs.gather_blocks(pool, np.zeros(length, np.int32)), 0)
            host.wait()
            pool = self.programs.scatter_blocks(pool, self.transfer.to_device(host), np.full(length, -1, np.int32))
        self.runs_out = 0
        jax.block_until_ready(pool)
        self.reserve(pool)
        return pool

    def reserve(self, pool) -> None:
        """Copy `reserve_blocks` rBlocks out to each instance's host memory, a run at a time, and let them go: the
        host allocator grows (pins) now rather than under the first copies served (the module docstring)."""
        start = time.perf_counter()
        instances = 1 if self.slots_per_instance is None else self.programs.instances
        for instance in range(instances):
            held = []  # held until the instance's whole reservation exists: each run new memory, none reused
            for length in run_lengths(self.reserve_blocks, self.max_run):
                host = self.transfer.to_host(self.programs.gather_blocks(pool, np.zeros(length, np.int32)), instance)
                _landed(host)  # one run's device copy at a time beside the pool
                held.append(host)
            del held
        self.reserved_seconds = time.perf_counter() - start

    def _make_room(self, length: int, direction: str) -> None:
        """Wait for the oldest runs in flight `direction` ("out" or "in") until one of `length` rBlocks fits
        max_copy_bytes beside the rest of them."""
        need, flying = length * self.block_bytes, self._in_flight[direction]
        while flying and (self._in_flight_bytes[direction] + need > self.max_copy_bytes or flying[0][2]()):
            nbytes, landed, _ = flying.popleft()
            landed()  # at once where it already landed
            self._in_flight_bytes[direction] -= nbytes

    def _hold(self, length: int, direction: str, arrays, landed) -> None:
        """Count a copy of `length` rBlocks in flight `direction` until `arrays` (its destination) are ready."""
        ready = lambda: all(getattr(x, "is_ready", lambda: True)() for x in jax.tree.leaves(arrays))  # noqa: E731
        self._in_flight[direction].append((length * self.block_bytes, landed, ready))
        self._in_flight_bytes[direction] += length * self.block_bytes

    def _to_host(self, run, instance: int) -> HostRun:
        host = self.transfer.to_host(run, instance)
        landed = functools.partial(_landed, host)
        self._hold(len(jax.tree.leaves(run)[0]), "out", host.arrays(), landed)
        self.runs_out += 1
        self._clock.started("out", landed)
        return host

    def _forget(self, slot: int) -> None:
        entry = self._slots.pop(slot, None)
        if entry is None:
            return
        run = entry[0]
        run.live -= 1
        if run.live == 0:
            self.bytes_used -= run.length * self.block_bytes
