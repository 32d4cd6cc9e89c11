"""The run's watch: one TCP connection from every follower to process 0, so a process that ends is seen at once.

A collective with a dead peer blocks for good (gloo and NCCL wait; jax's coordination service notices a
silent task only after its heartbeat timeout, 100 s by default, and then aborts every process with a C++
trace). So beside the collectives each follower holds one plain TCP connection to process 0 (opened by
sharding.multihost.initialize). The kernel closes a process's sockets however it ends, SIGKILL included,
so the other end reads end-of-file within milliseconds; TCP keep-alive (idle 5 s, 3 probes 1 s apart)
covers a host that vanishes. One byte says each thing:

    follower -> 0   b"."  goodbye: this process received process 0's stop; its end is no failure
                    b"T" / b"I": it got SIGTERM / SIGINT; process 0 takes the signal as its own
    0 -> follower   b"."  goodbye: process 0 is stopping the run (its stop follows)

End-of-file without a goodbye means the peer died: the watch calls `on_end(message, status)` on its own
thread; the default prints the message and leaves with that status at once (`os._exit`: the main thread
may be blocked in a collective that never returns). Processes say which end they are with a hello line,
"<token> <process id>", the token published with the port so a stray connection is refused.
"""

from __future__ import annotations

import os
import secrets
import select
import selectors
import signal
import socket
import sys
import threading
import time
from typing import Callable

GOODBYE = b"."
_SIGNAL_BYTES = {signal.SIGTERM: b"T", signal.SIGINT: b"I"}
_BYTE_SIGNALS = {v: k for k, v in _SIGNAL_BYTES.items()}
STOP_GRACE_S = 5.0  # after process 0's goodbye and end-of-file: time a follower's own stop gets to arrive

OnEnd = Callable[[str, int], None]


def say(prog: str, message: str, status: int) -> None:
    """One line on stderr, `prog: error: message` when status is non-zero; never raises (stderr may be closed)."""
    try:
        print(f"{prog}: {'error: ' if status else ''}{message}", file=sys.stderr, flush=True)
    except (OSError, ValueError, AttributeError):  # a closed or absent stderr: nobody to tell
        pass


def leave(prog: str) -> OnEnd:
    """The default `on_end`: say the message, then end the process with the status at once."""

    def on_end(message: str, status: int) -> None:
        say(prog, message, status)
        try:
            sys.stdout.flush()
        except (OSError, ValueError, AttributeError):
            pass
        os._exit(status)

    return on_end


def _keepalive(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 5), ("TCP_KEEPINTVL", 1), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _send(sock: socket.socket, data: bytes) -> None:
    try:
        sock.sendall(data)
    except OSError:  # the peer is gone: its end-of-file tells the watch
        pass


class LeaderWatch:
    """Process 0's end: listens, takes each follower's hello, and watches every connection.

    `published` is what followers need to connect ("<port> <token>"); `wait_joined` waits for every
    follower's hello. A follower's end-of-file without its goodbye calls `on_end("process I of P died ...", 1)`;
    a follower's forwarded signal calls `on_signal(process_id, signum)` (default: this process signals itself).
    """

    def __init__(self, num_processes: int, *, prog: str = "jaxllm", on_end: OnEnd | None = None,
                 on_signal: Callable[[int, int], None] | None = None):
        self.num_processes = num_processes
        self.prog = prog
        self.on_end = on_end or leave(prog)
        self.on_signal = on_signal or self._signal_self
        self._token = secrets.token_hex(16)
        if socket.has_dualstack_ipv6():
            self._server = socket.create_server(("", 0), family=socket.AF_INET6, dualstack_ipv6=True)
        else:
            self._server = socket.create_server(("", 0))
        self.port = self._server.getsockname()[1]
        self._lock = threading.Condition()
        self._peers: dict[int, socket.socket] = {}  # process id -> connection, once its hello arrived
        self._stopping = False
        self._closed = False
        self._died = threading.Event()
        self.died_message: str | None = None  # the first death seen, set before on_end runs
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._server, selectors.EVENT_READ, None)
        self._thread = threading.Thread(target=self._run, name="jaxllm-watch", daemon=True)
        self._thread.start()

    @property
    def published(self) -> str:
        return f"{self.port} {self._token}"

    def wait_joined(self, timeout: float) -> list[int]:
        """Wait until every follower said hello, at most `timeout` seconds; the process ids still missing."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while len(self._peers) < self.num_processes - 1 and not self._closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._lock.wait(left)
            return [i for i in range(1, self.num_processes) if i not in self._peers]

    def died(self, timeout: float = 0.0) -> str | None:
        """The message of the first follower seen dead, waiting up to `timeout` seconds for one; else None."""
        self._died.wait(timeout)
        return self.died_message

    def stopping(self) -> None:
        """Process 0 is stopping the run: tell every follower, so its end-of-file is no failure to them."""
        with self._lock:
            self._stopping = True
            peers = list(self._peers.values())
        for sock in peers:
            _send(sock, GOODBYE)

    def close(self) -> None:
        """Stop watching and hang up, as this process's exit would (tests; the exit closes everything anyway)."""
        with self._lock:
            self._closed = True
            self._lock.notify_all()
            peers = list(self._peers.values())
        for sock in [self._server] + peers:
            sock.close()

    def _signal_self(self, process_id: int, signum: int) -> None:
        say(self.prog, f"process {process_id} of {self.num_processes} got {signal.Signals(signum).name}: "
                       f"stopping the run as on {signal.Signals(signum).name} here", 0)
        os.kill(os.getpid(), signum)

    def _run(self) -> None:
        pending: dict[socket.socket, bytes] = {}  # connections whose hello is not complete yet
        ids: dict[socket.socket, int] = {}
        said_goodbye: set[int] = set()
        while not self._closed:
            try:
                events = self._selector.select(timeout=0.5)
            except (OSError, ValueError):
                return
            if self._closed:
                return
            for key, _ in events:
                sock = key.fileobj
                if sock is self._server:
                    try:
                        conn, _ = self._server.accept()
                    except OSError:
                        continue
                    _keepalive(conn)
                    pending[conn] = b""
                    self._selector.register(conn, selectors.EVENT_READ, None)
                    continue
                try:
                    data = sock.recv(256)
                except OSError:
                    data = b""
                if sock in pending:
                    self._hello(sock, pending, ids, data)
                    continue
                process_id = ids[sock]
                if not data:
                    try:
                        self._selector.unregister(sock)
                    except (KeyError, ValueError):
                        pass
                    sock.close()
                    if process_id not in said_goodbye and not self._closed:
                        message = (f"process {process_id} of {self.num_processes} died (its watch connection to "
                                   f"process 0 closed without a goodbye)")
                        if self.died_message is None:
                            self.died_message = message
                            self._died.set()
                        self.on_end(message, 1)
                    continue
                for byte in data:
                    b = bytes([byte])
                    if b == GOODBYE:
                        said_goodbye.add(process_id)
                    elif b in _BYTE_SIGNALS:
                        self.on_signal(process_id, _BYTE_SIGNALS[b])

    def _hello(self, sock, pending, ids, data: bytes) -> None:
        """Take a hello line; a bad one (or none) drops the connection unwatched."""
        line = pending[sock] + data
        if data and b"\n" not in line and len(line) < 128:
            pending[sock] = line
            return
        del pending[sock]
        words = line.split(b"\n", 1)[0].decode(errors="replace").split()
        ok = (data and len(words) == 2 and secrets.compare_digest(words[0], self._token) and words[1].isdigit()
              and 0 < int(words[1]) < self.num_processes)
        with self._lock:
            if ok and int(words[1]) not in self._peers:
                self._peers[int(words[1])] = sock
                ids[sock] = int(words[1])
                self._lock.notify_all()
                if self._stopping:
                    _send(sock, GOODBYE)
                return
        self._selector.unregister(sock)
        sock.close()


class FollowerWatch:
    """A follower's end: connects to process 0's watch and reads it. End-of-file without process 0's
    goodbye calls `on_end("process 0 ... ended ...", 1)`; with it, the follower's own stop has
    STOP_GRACE_S to arrive (`close`), else `on_end("process 0 stopped the run ...", 0)`."""

    def __init__(self, process_id: int, num_processes: int, host: str, published: str, *, timeout: float,
                 prog: str = "jaxllm", on_end: OnEnd | None = None):
        self.process_id = process_id
        self.num_processes = num_processes
        self.prog = prog
        self.on_end = on_end or leave(prog)
        port, token = published.split()
        self._sock = socket.create_connection((host, int(port)), timeout=timeout)
        self._sock.settimeout(None)
        _keepalive(self._sock)
        self._sock.sendall(f"{token} {process_id}\n".encode())
        self._closed = threading.Event()
        self._signals_r: socket.socket | None = None
        self._thread = threading.Thread(target=self._run, name="jaxllm-watch", daemon=True)
        self._thread.start()

    def forward_signals(self) -> None:
        """SIGTERM and SIGINT go to process 0, which stops the run (a follower that left alone would fail
        it); a second one ends this process at once. Main thread only (signal.set_wakeup_fd): the signal
        is read on the watch's thread, since the main thread may sit in a collective for long."""
        r, w = socket.socketpair()
        r.setblocking(False)
        w.setblocking(False)
        self._signals_r, self._signals_w = r, w
        for signum in _SIGNAL_BYTES:
            signal.signal(signum, lambda s, f: None)  # the C handler writes the wakeup fd; nothing else to do
        signal.set_wakeup_fd(w.fileno(), warn_on_full_buffer=False)

    def close(self) -> None:
        """This process received process 0's stop: say goodbye and stop watching."""
        if self._closed.is_set():
            return
        self._closed.set()
        _send(self._sock, GOODBYE)
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()

    def _run(self) -> None:
        got_goodbye = False
        signals = 0
        while not self._closed.is_set():
            readable = [self._sock] + ([self._signals_r] if self._signals_r is not None else [])
            try:
                ready = select.select(readable, [], [], 0.5)[0]
            except (OSError, ValueError):  # close() on the main thread closed the socket
                ready = [self._sock]
            if self._signals_r is not None and self._signals_r in ready:
                for signum in self._signals_r.recv(64):
                    if signum not in _SIGNAL_BYTES:
                        continue
                    signals += 1
                    name = signal.Signals(signum).name
                    if signals > 1:
                        self.on_end(f"process {self.process_id}: a second {name}: leaving now, which fails "
                                    f"process 0's run", 128 + signum)
                        return
                    say(self.prog, f"process {self.process_id}: {name}: process 0 stops the run (a second "
                                   f"signal leaves at once)", 0)
                    _send(self._sock, _SIGNAL_BYTES[signum])
            if self._sock not in ready or self._closed.is_set():
                continue
            try:
                data = self._sock.recv(64)
            except OSError:
                data = b""
            if data:
                got_goodbye = got_goodbye or GOODBYE in data
                continue
            if self._closed.is_set():
                return
            if not got_goodbye:
                self.on_end(f"process 0 of {self.num_processes} ended without stopping the run (its watch "
                            f"connection closed); process {self.process_id} exits", 1)
                return
            if self._closed.wait(STOP_GRACE_S):
                return
            self.on_end(f"process 0 stopped the run before process {self.process_id} received its stop; exiting", 0)
            return

