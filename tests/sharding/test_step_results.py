"""The results channel in one process over loopback, with stand-ins for a multi-process array (no
jax.distributed): which process sends which shards, process 0 putting a whole array together, and a follower
that died ending the wait with the watch's message."""

import threading

import numpy as np
import pytest

from sharding import step_results

pytest.importorskip("zmq")


class _Device:
    def __init__(self, i: int, per_process: int):
        self.id, self.process_index = i, i // per_process

    def __hash__(self):
        return self.id


class _Sharding:
    """Rows split over `groups` (each group of devices holds the same rows: an instance's tensor shards)."""

    def __init__(self, devices: int, per_process: int, groups: int):
        self.devices = [_Device(i, per_process) for i in range(devices)]
        self.groups = groups

    def devices_indices_map(self, shape):
        rows = shape[0] // self.groups
        per_group = len(self.devices) // self.groups
        return {d: (slice(d.id // per_group * rows, (d.id // per_group + 1) * rows), slice(None)) for d in self.devices}

    def __hash__(self):
        return hash((len(self.devices), self.groups))

    def __eq__(self, other):
        return isinstance(other, _Sharding) and (len(self.devices), self.groups) == (len(other.devices), other.groups)


class _Shard:
    def __init__(self, index, data):
        self.index, self.data = index, data


class _Array:
    """What process `process` holds of `whole` on `sharding`."""

    def __init__(self, whole: np.ndarray, sharding: _Sharding, process: int):
        self.shape, self.dtype, self.sharding = whole.shape, whole.dtype, sharding
        self.addressable_shards = [_Shard(index, whole[index]) for d, index in
                                   sharding.devices_indices_map(whole.shape).items() if d.process_index == process]


def test_each_shard_process_0_lacks_comes_from_one_process():
    # 4 instances x 2 tensor devices over 4 processes of 2 devices: instance i on process i
    sharding = _Sharding(8, 2, 4)
    assert step_results.pieces(sharding, (8, 3), 0) == ()
    assert [p[0] for p in step_results.pieces(sharding, (8, 3), 2)] == [slice(4, 6)]
    # 2 instances x 4 tensor devices over 4 processes: instance 1 on processes 2 and 3, the lower one sends
    sharding = _Sharding(8, 2, 2)
    assert step_results.pieces(sharding, (4, 3), 1) == ()
    assert [p[0] for p in step_results.pieces(sharding, (4, 3), 2)] == [slice(2, 4)]
    assert step_results.pieces(sharding, (4, 3), 3) == ()
    # one instance over every process (tensor parallelism): process 0 holds it all, nothing travels
    assert all(step_results.pieces(_Sharding(8, 2, 1), (4, 3), p) == () for p in range(4))


def test_process_0_reads_the_whole_array():
    collector = step_results.Collector()
    sharding = _Sharding(4, 2, 4)  # 4 instances over 2 processes
    returner = step_results.Returner(1, "127.0.0.1", collector.port)
    try:
        for seq in range(3):
            tokens = np.arange(8, dtype=np.int32).reshape(4, 2) + 100 * seq
            logprobs = np.linspace(0, 1, 12, dtype=np.float32).reshape(4, 3) - seq
            returner.send(seq, [_Array(tokens, sharding, 1), None, _Array(logprobs, sharding, 1)])
            assert np.array_equal(collector.read(_Array(tokens, sharding, 0), seq, 0, timeout=10), tokens)
            assert np.array_equal(collector.read(_Array(logprobs, sharding, 0), seq, 2, timeout=10), logprobs)
    finally:
        returner.close()
        collector.close()


def test_a_follower_that_died_ends_the_wait_with_the_watchs_message():
    died = threading.Event()
    collector = step_results.Collector(dead=lambda: "process 1 of 2 died" if died.is_set() else None)
    tokens = np.zeros((4, 2), np.int32)
    threading.Timer(0.3, died.set).start()
    with pytest.raises(ValueError, match="process 1 of 2 died"):
        collector.read(_Array(tokens, _Sharding(4, 2, 4), 0), 0, 0, timeout=30)
    collector.close()
