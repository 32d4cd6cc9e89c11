"""The host tier's store with stand-in programs and transfer: runs of power-of-two lengths, slots pointing into
them, host bytes released when no slot needs a run, and device memory in flight held to max_copy_bytes."""

import threading
import time
import weakref

import numpy as np

from jaxllm.contract import HostCopies
from jaxllm.executor.host_store import HostStore, run_lengths


class _Programs:
    """Gather and scatter over a NumPy pool [blocks] (one int per rBlock: its content)."""

    def __init__(self, log):
        self.log = log

    def gather_blocks(self, pool, blocks):
        self.log.append(("gather", len(blocks)))
        return pool[np.asarray(blocks)]

    def scatter_blocks(self, pool, run, blocks):
        self.log.append(("scatter", len(blocks)))
        pool = pool.copy()
        for row, block in enumerate(blocks):
            if block >= 0:
                pool[block] = run[row]
        return pool


class _Run:
    def __init__(self, arrays, log):
        self._arrays, self.log = arrays, log

    def wait(self):
        # The store's copy clock also waits for every run, on its own thread, whenever that thread runs: only the
        # launcher's waits (the backpressure under test) are logged.
        if threading.current_thread() is threading.main_thread():
            self.log.append(("wait", len(self._arrays)))

    def arrays(self):
        return self._arrays


class _Landing(np.ndarray):
    """A host array still landing (is_ready False) or landed."""

    landed = False

    def is_ready(self):
        return self.landed


class _Transfer:
    def __init__(self, log, landed=False):
        self.log, self.landed = log, landed

    def to_host(self, run, instance=0):
        arrays = np.array(run).view(_Landing)
        arrays.landed = self.landed
        return _Run(arrays, self.log)

    def to_device(self, run):
        return run.arrays()


def _copies(out=(), slots=(), ins=(), into=(), dropped=(), released=None):
    a = lambda x: np.asarray(x, np.int32)  # noqa: E731
    return HostCopies(a(out), a(slots), a(ins), a(into), a(dropped), a(ins if released is None else released))


def test_run_lengths_split_a_count_into_powers_of_two():
    assert run_lengths(0, 8) == [] and run_lengths(5, 8) == [4, 1] and run_lengths(19, 8) == [8, 8, 2, 1]


def test_copies_round_trip_through_runs_and_release_host_bytes():
    log = []
    store = HostStore(_Programs(log), _Transfer(log), max_run=8, block_bytes=10)
    pool = np.arange(100, 116)
    pool = store.apply(pool, _copies(out=[3, 4, 5, 9, 10], slots=[0, 1, 2, 3, 4]))
    assert [e for e in log if e[0] == "gather"] == [("gather", 4), ("gather", 1)]
    assert store.bytes_used == 50 and store.blocks_out == 5
    pool = store.apply(pool, _copies(ins=[4, 1], into=[0, 1]))  # rows of both runs: each run copied back whole
    assert pool[0] == 110 and pool[1] == 104 and store.blocks_in == 2 and store.runs_in == 2
    assert store.bytes_used == 40  # the one-rBlock run's only slot was read back; the other run has three left
    pool = store.apply(pool, _copies(dropped=[0, 2, 3]))
    assert store.bytes_used == 0  # no slot needs either run any more
    store.sync()


def test_runs_in_flight_are_held_to_max_copy_bytes():
    log = []
    store = HostStore(_Programs(log), _Transfer(log), max_run=8, block_bytes=10, max_copy_bytes=40)
    assert store.max_run == 2  # two runs fit max_copy_bytes: the next one is queued while the first lands
    store.apply(np.arange(16), _copies(out=[0, 1, 2, 3, 4, 5, 6], slots=[0, 1, 2, 3, 4, 5, 6]))
    kinds = [e[0] for e in log]
    # Two runs of two rBlocks fill the 40 bytes: each run after the second waits until the oldest landed.
    assert kinds == ["gather", "gather", "wait", "gather", "wait", "gather"], log
    store.sync()


def test_copies_in_do_not_wait_for_copies_out_in_flight():
    """Each direction has its own max_copy_bytes: a prompt's history coming back shares the link with spills going
    out instead of queueing behind them."""
    log = []
    store = HostStore(_Programs(log), _Transfer(log), max_run=2, block_bytes=10, max_copy_bytes=40)
    pool = store.apply(np.arange(16), _copies(out=[0, 1], slots=[0, 1]))
    pool = store.apply(pool, _copies(out=[2, 3], slots=[2, 3]))
    pool = store.apply(pool, _copies(out=[4, 5], slots=[4, 5]))  # waits for the first run out: 40 bytes each way
    assert [e[0] for e in log] == ["gather", "gather", "wait", "gather"], log
    log.clear()
    pool = store.apply(pool, _copies(ins=[0, 1], into=[8, 9]))
    # Reads its run once landed (the one wait), but not the runs out still in flight.
    assert [e[0] for e in log] == ["wait", "scatter"], log
    assert pool[8] == 0 and pool[9] == 1
    store.sync()


class _SlowRun(_Run):
    """A run that lands `delay` seconds after it was copied out (the store's copy clock waits for it)."""

    def __init__(self, arrays, log, delay):
        super().__init__(arrays, log)
        self.lands_at = time.perf_counter() + delay

    def wait(self):
        if threading.current_thread() is not threading.main_thread():
            time.sleep(max(0.0, self.lands_at - time.perf_counter()))


class _SlowTransfer(_Transfer):
    def to_host(self, run, instance=0):
        return _SlowRun(np.array(run), self.log, 0.3)


def test_copy_seconds_count_copies_in_flight_together_once():
    """Two runs out in flight at once for 0.3 s: the direction was busy 0.3 s, not 0.6 (the stats tree's
    executor.host_store.copy_out_seconds)."""
    log = []
    store = HostStore(_Programs(log), _SlowTransfer(log), max_run=2, block_bytes=10, max_copy_bytes=40)
    store.apply(np.arange(16), _copies(out=[0, 1, 2, 3], slots=[0, 1, 2, 3]))  # two runs of two, both in flight
    store.sync()
    assert 0.25 <= store.copy_seconds["out"] < 0.5, store.copy_seconds
    assert store.copy_seconds["in"] == 0.0


def test_landed_runs_are_let_go_at_the_next_copy():
    log = []
    store = HostStore(_Programs(log), _Transfer(log, landed=True), max_run=8, block_bytes=10, max_copy_bytes=1000)
    store.apply(np.arange(16), _copies(out=[0], slots=[0]))
    store.apply(np.arange(16), _copies(out=[1], slots=[1]))
    assert [e[0] for e in log] == ["gather", "wait", "gather"], log  # far under max_copy_bytes, but landed
    store.sync()


class _Counting(_Transfer):
    """Counts the host rBlocks alive at once (a run's arrays are freed when the last reference goes)."""

    def __init__(self, log):
        super().__init__(log, landed=True)
        self.alive = self.peak = 0
        self.per_instance = {}

    def to_host(self, run, instance=0):
        host = super().to_host(run, instance)
        self.alive += len(run)
        self.peak = max(self.peak, self.alive)
        self.per_instance[instance] = self.per_instance.get(instance, 0) + len(run)
        weakref.finalize(host, self._freed, len(run))
        return host

    def _freed(self, n):
        self.alive -= n


def test_warm_up_reserves_the_tiers_host_memory_once_and_lets_it_go():
    """Each instance's whole tier is copied out at once (the host allocator grows to it at warm-up, not under the
    first copies served), one run of device memory at a time, and released: nothing is held after."""
    log = []
    transfer = _Counting(log)
    store = HostStore(_Programs(log), transfer, max_run=8, block_bytes=10, reserve_blocks=19)
    pool = store.warm_up(np.arange(100, 132))
    compiled = sum(store.run_lengths())  # warm-up's one copy of each length, let go at the next copy
    assert transfer.alive == compiled and transfer.peak == compiled + 19 and store.bytes_used == 0
    assert transfer.per_instance == {0: compiled + 19}
    assert store.runs_out == 0 and store.reserved_seconds >= 0
    assert np.array_equal(pool, np.arange(100, 132))
