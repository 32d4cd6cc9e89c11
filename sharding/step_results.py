"""The followers' share of a step's outputs, back to process 0 on a host channel (ZeroMQ), not a collective.

Process 0 reads every step's sampled tokens (and, where asked, log-probabilities and logits). A step's outputs
are split over the mesh's `instance` axis, as on one process, so a step in which nothing is borrowed runs no
collective at all, across processes too. Replicating them instead would add an all-gather to every step: over
gloo on the CPU about a millisecond, with a thread of each process busy for it (benchmarks/NOTES.md). So the
rows of an instance whose devices are all on other processes come to process 0 as bytes: each follower sends
the pieces (distinct shards) of an output that no device of process 0 holds and that no lower-numbered process
holds too (`pieces`, computed alike on every process from the sharding alone), on a thread of its own once the
step is done (`Returner`), so its loop launches the next steps meanwhile. Process 0's `Collector` takes them on
its own thread and `read` puts a whole host array together from its own shards and the followers' pieces.
An output held by process 0 whole (tensor parallelism: every device holds its instance's tokens) travels not.

Messages, follower -> process 0 (PUSH -> PULL: one ordered stream a follower):
    header   uint64 sequence number of the step call (the step channel's), uint16 output number, uint16 process
    pieces   each piece's raw bytes (C order), in `pieces` order
"""

from __future__ import annotations

import functools
import queue
import socket
import struct
import threading
import time

import numpy as np

from sharding.step_channel import endpoint, require_zmq

__all__ = ["Collector", "Returner", "pieces"]

_HEADER = struct.Struct("<QHH")
_KEEP = 1024  # the most recent step calls whose unread pieces process 0 keeps (warm-up's steps are never read)


def _key(index: tuple) -> tuple:
    return tuple((s.start, s.stop, s.step) if isinstance(s, slice) else s for s in index)


def pieces(sharding, shape: tuple[int, ...], process: int) -> tuple:
    """The shards (index tuples of slices, in a fixed order) of an array of `shape` on `sharding` that `process`
    sends to process 0: those no device of process 0 holds, where `process` is the lowest process holding them.
    Process 0's own list is empty; the same on every process (it reads only the sharding)."""
    return _pieces(sharding, tuple(shape)).get(process, ())


@functools.lru_cache(maxsize=256)
def _pieces(sharding, shape: tuple[int, ...]) -> dict[int, tuple]:
    holders: dict[tuple, set[int]] = {}
    index_of: dict[tuple, tuple] = {}
    for device, index in sharding.devices_indices_map(shape).items():
        key = _key(index)
        holders.setdefault(key, set()).add(device.process_index)
        index_of[key] = index
    out: dict[int, list] = {}
    for key in sorted(holders, key=str):
        if 0 not in holders[key]:
            out.setdefault(min(holders[key]), []).append(index_of[key])
    return {p: tuple(v) for p, v in out.items()}


def _local_piece(x, index) -> np.ndarray:
    key = _key(index)
    for shard in x.addressable_shards:
        if _key(shard.index) == key:
            return np.asarray(shard.data)
    raise ValueError(f"this process holds no shard {index} of an output {x.shape}")


class Returner:
    """A follower's end: `send(seq, outputs)` queues a step's outputs (jax arrays, numbered by position); its thread
    waits for each to be computed and sends the pieces process 0 lacks. `close()` sends what is queued and stops."""

    def __init__(self, process_id: int, host: str, port: int):
        zmq = require_zmq()
        self.process_id = process_id
        self._context = zmq.Context(io_threads=1)
        self._sock = self._context.socket(zmq.PUSH)
        for option, value in ((zmq.SNDHWM, 0), (zmq.LINGER, 5000)):
            self._sock.setsockopt(option, value)
        if ":" in host or socket.has_dualstack_ipv6():
            self._sock.setsockopt(zmq.IPV6, 1)  # a name may resolve to IPv6
        self._sock.connect(endpoint(host, port))
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="jaxllm-results", daemon=True)
        self._thread.start()

    def send(self, seq: int, outputs) -> None:
        """Queue step call `seq`'s outputs (each a jax.Array, or None for none); returns at once."""
        if any(o is not None and pieces(o.sharding, o.shape, self.process_id) for o in outputs):
            self._queue.put((seq, outputs))

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()
        self._sock.close()
        self._context.term()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            seq, outputs = item
            for k, x in enumerate(outputs):
                mine = [] if x is None else pieces(x.sharding, x.shape, self.process_id)
                if mine:
                    frames = [_HEADER.pack(seq, k, self.process_id)] + [_local_piece(x, i) for i in mine]
                    self._sock.send_multipart(frames)


class Collector:
    """Process 0's end: binds (`port`, to publish), and `read(x, seq, k)` returns output k of step call `seq` whole
    on the host, taking the followers' pieces off the socket itself (no thread of its own: one wake-up fewer
    between a follower's send and the reader; pieces of other calls that come first are kept for their readers).
    dead() -> a message once a process of the run died (a wait for its pieces then ends with that message, as
    ValueError). Thread-safe (one lock)."""

    def __init__(self, *, dead=lambda: None):
        zmq = require_zmq()
        self._zmq = zmq
        self._dead = dead
        self._context = zmq.Context(io_threads=1)
        self._sock = self._context.socket(zmq.PULL)
        self._sock.setsockopt(zmq.RCVHWM, 0)
        self._sock.setsockopt(zmq.LINGER, 0)
        if socket.has_dualstack_ipv6():
            self._sock.setsockopt(zmq.IPV6, 1)
        self.port = self._sock.bind_to_random_port("tcp://*")
        self._got: dict[tuple[int, int, int], list[bytes]] = {}  # (seq, k, process) -> the pieces' bytes
        self._newest = -1
        self._lock = threading.Lock()
        self._closed = False

    def read(self, x, seq: int, k: int, timeout: float = 600.0) -> np.ndarray:
        """Output `k` of step call `seq` (`x`, as process 0 holds it) on the host, whole."""
        out = np.empty(x.shape, x.dtype)
        seen = set()
        for shard in x.addressable_shards:
            if (key := _key(shard.index)) not in seen:  # a replica once
                seen.add(key)
                out[shard.index] = np.asarray(shard.data)
        owed = _pieces(x.sharding, tuple(x.shape))
        deadline = time.monotonic() + timeout
        for process, indices in owed.items():
            frames = self._take((seq, k, process), deadline)
            if len(frames) != len(indices):
                raise ValueError(f"process {process} sent {len(frames)} pieces of output {k} of step {seq}, "
                                 f"not {len(indices)}")
            for index, frame in zip(indices, frames):
                view = out[index]
                view[...] = np.frombuffer(frame, x.dtype).reshape(view.shape)
        return out

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._sock.close()
            self._context.term()

    def _take(self, key, deadline: float) -> list[bytes]:
        with self._lock:
            while key not in self._got:
                if self._closed:
                    raise ValueError("the results channel is closed")
                message = self._dead()
                if message:
                    raise ValueError(message)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ValueError(f"process {key[2]}'s outputs of step {key[0]} did not come in time")
                if self._sock.poll(max(int(min(left, 0.5) * 1000), 1), self._zmq.POLLIN):
                    self._keep(self._sock.recv_multipart())
            return self._got.pop(key)

    def _keep(self, frames: list[bytes]) -> None:
        seq, k, process = _HEADER.unpack(frames[0])
        self._got[(seq, k, process)] = frames[1:]
        if seq > self._newest:
            self._newest = seq
            for old in [key for key in self._got if key[0] < seq - _KEEP]:
                del self._got[old]
