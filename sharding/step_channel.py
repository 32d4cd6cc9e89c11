"""Process 0's hand-over of each step to the other processes: messages on a host channel (ZeroMQ), no collective.

Every process runs every program (docs/ARCHITECTURE.md, decision 7), and process 0 alone plans them. So
before it runs one, process 0 tells the others which, with its small host inputs: a pytree of NumPy arrays.
That message is the control plane; the data plane is the collectives inside the programs (NCCL, gloo). Sent
as a collective (as this once was, `multihost_utils.broadcast_one_to_all`), a message would queue behind the
program already running on the devices and end in a device-to-host copy, so no process could plan or launch
ahead. Here it is a host message, sent the moment the step is submitted: a follower launches step N+1 while
step N runs, as process 0 does.

Transport: one ZeroMQ ROUTER socket bound by process 0 on a free port (published through jax's key-value
store by sharding.multihost), one DEALER per follower connected to it. A follower says hello first, naming
the token published with the port, and process 0 waits for every hello before it sends anything (so a
follower that connects late misses nothing: PUB/SUB's slow-joiner problem does not arise). Each follower has
its own ordered TCP stream; no queue limit drops a message (high-water marks off); ROUTER_MANDATORY makes a
send to a follower whose connection is gone fail at once (`PeerGone`) instead of vanishing; every message
carries a sequence number, so one lost to a dropped connection is an error, never a silently skipped step.
pyzmq is imported only where a multi-process run starts (`require_zmq`).

A message, frames:

    header   b"D" (data) | b"L" (a new layout, then data) | b"S" (stop), uint64 sequence number,
             int64 CLOCK_MONOTONIC ns at the send (a follower on the same host measures the delivery)
    layout   (b"L" only) pickled (tree structure, [(shape, dtype)]): sent when it changes, which a step's
             bucketed shapes make rare; pickle only for this, from process 0 over its own connection
    data     every array's raw bytes (C order), one after another, each padded to a multiple of 8 bytes: one
             frame, so a send is three frames whatever the tree (a frame each cost ~1.5 us and a release of the
             GIL); the follower's arrays are views into it

A follower answers the stop with b"bye" once it has taken it, so process 0 can wait until every follower
has every message before it leaves (`Sender.stop`).
"""

from __future__ import annotations

import dataclasses
import pickle
import secrets
import socket
import struct
import threading
import time

import numpy as np

__all__ = ["ChannelStats", "PeerGone", "Receiver", "Sender", "endpoint", "require_zmq"]

_HEADER = struct.Struct("<cQq")  # kind, sequence number, monotonic ns at the send
_DATA, _LAYOUT, _STOP = b"D", b"L", b"S"
_HELLO, _BYE = b"hello", b"bye"
_ALIGN = 8  # each array's bytes start at a multiple of this in the data frame (views stay aligned)
_PAD = bytes(_ALIGN)


def require_zmq():
    """The zmq module; ValueError naming the package where it is not installed (a multi-process run needs it)."""
    try:
        import zmq
    except ImportError:
        raise ValueError("a multi-process run hands each step to the other processes over ZeroMQ, and the pyzmq "
                         "package is not installed here: pip install pyzmq") from None
    return zmq


class PeerGone(ConnectionError):
    """A follower's connection to process 0's channel closed: it died or vanished."""


@dataclasses.dataclass(frozen=True)
class ChannelStats:
    """What one end of the channel did. Process 0: `messages` sent; `send_s`, seconds inside `send` (layout and
    bytes to every follower), and `send_cpu_s`, this thread's CPU time in them (on a busy machine the wall time
    also holds the moments the thread waited for a core after waking ZeroMQ's I/O thread). A follower:
    `messages` received; `wait_s`, seconds blocked for them; `late_s`, the part of that wait past the moment
    process 0 sent each message (its delivery, while the follower was already waiting: the hand-over's own
    latency; on one host only, where both ends read one monotonic clock)."""

    messages: int = 0
    send_s: float = 0.0
    send_cpu_s: float = 0.0
    wait_s: float = 0.0
    late_s: float = 0.0


def endpoint(host: str, port: int) -> str:
    """ZeroMQ's TCP address of host:port (an IPv6 literal in brackets)."""
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def _padded(nbytes: int) -> int:
    return nbytes + -nbytes % _ALIGN


def _wire_leaves(tree, flatten) -> tuple[object, list[np.ndarray]]:
    leaves, treedef = flatten(tree)
    arrays = [np.asarray(x) for x in leaves]
    arrays = [x if x.flags.c_contiguous else np.ascontiguousarray(x) for x in arrays]  # (which makes 0-d 1-d)
    for x in arrays:
        if x.dtype.hasobject:
            raise ValueError(f"a step input of dtype {x.dtype} {x.shape} cannot travel as bytes: send arrays of numbers")
    return treedef, arrays


class Sender:
    """Process 0's end: binds, waits for every follower's hello (`wait_joined`), then `send(tree)` to all of them
    in order and `stop()`. `published` ("<port> <token>") is what followers need. Thread-safe (one lock).

    flatten: how a tree becomes (leaves, structure), e.g. jax.tree.flatten (its structure must pickle).
    before_stop: called first in `stop` (process 0 tells its watch the run is stopping on purpose).
    """

    def __init__(self, num_processes: int, *, flatten, before_stop=None):
        zmq = require_zmq()
        self._zmq = zmq
        self.num_processes = num_processes
        self._flatten = flatten
        self._before_stop = before_stop
        self._token = secrets.token_hex(16)
        self._context = zmq.Context(io_threads=1)
        self._sock = self._context.socket(zmq.ROUTER)
        for option, value in ((zmq.ROUTER_MANDATORY, 1), (zmq.SNDHWM, 0), (zmq.RCVHWM, 0), (zmq.LINGER, 5000)):
            self._sock.setsockopt(option, value)
        if socket.has_dualstack_ipv6():
            self._sock.setsockopt(zmq.IPV6, 1)  # "*" is then both IPv4 and IPv6
        self.port = self._sock.bind_to_random_port("tcp://*")
        self._lock = threading.Lock()
        self._peers: dict[int, bytes] = {}  # process id -> its routing id, once its hello came
        self._layout_key = None
        self._seq = 0
        self._messages, self._send_ns, self._send_cpu_ns = 0, 0, 0
        self._stopped = False

    @property
    def published(self) -> str:
        return f"{self.port} {self._token}"

    def wait_joined(self, timeout: float) -> list[int]:
        """Take hellos until every follower said one or `timeout` seconds passed; the process ids still missing."""
        zmq = self._zmq
        deadline = time.monotonic() + timeout
        with self._lock:
            while len(self._peers) < self.num_processes - 1:
                left = deadline - time.monotonic()
                if left <= 0 or not self._sock.poll(max(int(left * 1000), 1), zmq.POLLIN):
                    break
                frames = self._sock.recv_multipart()
                if len(frames) == 4 and frames[1] == self._token.encode() and frames[3] == _HELLO:
                    who = frames[2].decode(errors="replace")
                    if who.isdigit() and 0 < int(who) < self.num_processes and int(who) not in self._peers:
                        self._peers[int(who)] = frames[0]
                # anything else (a stray connection, a bad token) is dropped
            return [i for i in range(1, self.num_processes) if i not in self._peers]

    def send(self, tree) -> int:
        """Hand `tree` (a pytree of arrays) to every follower; returns its sequence number (0, 1, ...: the messages
        sent before it). Raises PeerGone where a follower's connection is gone."""
        start, start_cpu = time.perf_counter_ns(), time.thread_time_ns()
        treedef, arrays = _wire_leaves(tree, self._flatten)
        key = (treedef, tuple((x.shape, x.dtype.str) for x in arrays))
        with self._lock:
            if self._stopped:
                raise ValueError("the step channel was stopped: no more steps can be sent")
            parts = []
            for x in arrays:
                parts.append(x.reshape(-1))  # a 1-d view: its buffer is the bytes
                if x.nbytes % _ALIGN:
                    parts.append(_PAD[:-x.nbytes % _ALIGN])
            frames = [b"".join(parts)]
            if key != self._layout_key:
                kind, frames = _LAYOUT, [pickle.dumps((treedef, list(key[1]))), *frames]
            else:
                kind = _DATA
            seq = self._send_all(kind, frames)
            self._layout_key = key
            self._messages += 1
            self._send_ns += time.perf_counter_ns() - start
            self._send_cpu_ns += time.thread_time_ns() - start_cpu
            return seq

    def stop(self, timeout: float = 60.0) -> list[int]:
        """Tell every follower there are no more steps, then wait up to `timeout` seconds until each has taken
        every message (its bye) and close; the process ids that did not answer (gone ones included). Idempotent."""
        with self._lock:
            if self._stopped:
                return []
            self._stopped = True
        if self._before_stop is not None:
            self._before_stop()
        with self._lock:
            try:
                self._send_all(_STOP, [])
            except PeerGone:
                pass  # the watch names it; the others still get their stop
            waiting = {ident: i for i, ident in self._peers.items()}
            deadline = time.monotonic() + timeout
            while waiting:
                left = deadline - time.monotonic()
                if left <= 0 or not self._sock.poll(max(int(left * 1000), 1), self._zmq.POLLIN):
                    break
                frames = self._sock.recv_multipart()
                if len(frames) >= 2 and frames[-1] == _BYE:
                    waiting.pop(frames[0], None)
            self._sock.close(linger=1000)
            self._context.term()
            return sorted(waiting.values())

    def stats(self) -> ChannelStats:
        with self._lock:
            return ChannelStats(messages=self._messages, send_s=self._send_ns / 1e9, send_cpu_s=self._send_cpu_ns / 1e9)

    def _send_all(self, kind: bytes, frames: list) -> int:
        zmq = self._zmq
        seq = self._seq
        header = _HEADER.pack(kind, seq, time.monotonic_ns())
        self._seq += 1
        gone = []
        for process_id, ident in self._peers.items():
            try:
                self._sock.send_multipart([ident, header, *frames])
            except zmq.ZMQError as e:
                if e.errno != zmq.EHOSTUNREACH:
                    raise
                gone.append(process_id)
        if gone:
            for process_id in gone:
                del self._peers[process_id]
            raise PeerGone(f"process(es) {', '.join(map(str, gone))} of {self.num_processes} left process 0's step "
                           "channel (their connection closed)")
        return seq


class Receiver:
    """A follower's end: connects to process 0 at `host` (`published`: its "<port> <token>"), says hello, and
    `receive()` returns each tree process 0 sent, in order, or None once it stopped.

    unflatten: the inverse of the sender's flatten (e.g. jax.tree.unflatten). on_stop: called when the stop
    arrives (the follower's watch says goodbye: its end is no failure now).
    """

    def __init__(self, process_id: int, num_processes: int, host: str, published: str, *, unflatten, on_stop=None):
        zmq = require_zmq()
        self._zmq = zmq
        self.process_id, self.num_processes = process_id, num_processes
        self._unflatten = unflatten
        self._on_stop = on_stop
        port, token = published.split()
        self._context = zmq.Context(io_threads=1)
        self._sock = self._context.socket(zmq.DEALER)
        for option, value in ((zmq.SNDHWM, 0), (zmq.RCVHWM, 0), (zmq.LINGER, 2000)):
            self._sock.setsockopt(option, value)
        if ":" in host or socket.has_dualstack_ipv6():
            self._sock.setsockopt(zmq.IPV6, 1)  # a name may resolve to IPv6
        self._sock.connect(endpoint(host, int(port)))
        self._sock.send_multipart([token.encode(), str(process_id).encode(), _HELLO])
        self._treedef, self._leaves, self._nbytes = None, [], 0
        self._seq = 0
        self.last_seq = -1  # the sequence number of the last message received
        self._messages, self._wait_ns, self._late_ns = 0, 0, 0
        self._closed = False

    def receive(self):
        """The next tree process 0 sent (NumPy leaves, read-only), or None once it stopped."""
        if self._closed:
            return None
        start = time.monotonic_ns()
        frames = self._sock.recv_multipart()
        now = time.monotonic_ns()
        kind, seq, sent = _HEADER.unpack(frames[0])
        self._wait_ns += now - start
        self._late_ns += max(now - max(sent, start), 0)
        if seq != self._seq:
            raise ConnectionError(f"process {self.process_id} missed steps {self._seq}..{seq - 1} of process 0's "
                                  "step channel (its connection dropped): the processes no longer run the same "
                                  "programs")
        self.last_seq = seq
        self._seq += 1
        if kind == _STOP:
            self._close()
            return None
        if kind == _LAYOUT:
            self._set_layout(frames[1])
        if kind not in (_DATA, _LAYOUT) or self._treedef is None or len(frames[-1]) != self._nbytes:
            raise ConnectionError(f"process {self.process_id}: a malformed message on process 0's step channel")
        self._messages += 1
        data = frames[-1]
        arrays = [np.frombuffer(data, dtype, count, offset).reshape(shape)
                  for shape, dtype, count, offset in self._leaves]
        return self._unflatten(self._treedef, arrays)

    def _set_layout(self, layout: bytes) -> None:
        self._treedef, shapes = pickle.loads(layout)
        self._leaves, offset = [], 0  # (shape, dtype, count, offset in the data frame)
        for shape, dtype in shapes:
            dtype, count = np.dtype(dtype), int(np.prod(shape, dtype=np.int64))
            self._leaves.append((tuple(shape), dtype, count, offset))
            offset += _padded(count * dtype.itemsize)
        self._nbytes = offset

    def stats(self) -> ChannelStats:
        return ChannelStats(messages=self._messages, wait_s=self._wait_ns / 1e9, late_s=self._late_ns / 1e9)

    def _close(self) -> None:
        self._closed = True
        try:
            self._sock.send(_BYE)
        finally:
            if self._on_stop is not None:
                self._on_stop()
            self._sock.close()
            self._context.term()
