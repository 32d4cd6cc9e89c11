"""Multi-process start-up and process 0's hand-over of each step's inputs, through JAX itself.

Every process runs the same program (docs/ARCHITECTURE.md, decision 7). Process 0 schedules; before each
step it sends the step's inputs (a pytree of NumPy arrays) to the others with
`multihost_utils.broadcast_one_to_all`, a collective over all devices: no home-made RPC. A step's
shapes come from a few buckets, so the inputs' layout (tree structure, shapes, dtypes) is sent only
when it changes; a steady decode loop costs two broadcasts a step (an 8-byte header and the arrays).
The broadcast sums over processes in JAX, so leaves travel as 8-, 16- or 32-bit numbers (bool as uint8;
64-bit ones are refused unless jax_enable_x64 is on, as JAX would silently narrow them).
When process 0 shuts down it sends a stop, and the others' `receive` returns None.

Faults (README, "Several GPUs and hosts"): joining waits for the coordinator at most `timeout` seconds
(default 300, or $JAXLLM_COORDINATOR_TIMEOUT) and then ends the process with one line naming the
address, status 2. jax's own timeout cannot be used: it aborts the process with a C++ trace, and while
jax.distributed.initialize blocks no Python exception can leave it, so a timer thread leaves first.
Once joined, every process is watched (sharding.liveness): a process that dies ends the others within
milliseconds, instead of leaving them in a collective that never returns.
"""

from __future__ import annotations

import os
import pickle
import socket
import threading
import time

import jax
import numpy as np

from sharding import liveness

_ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
_ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
_ENV_PROCESS_ID = "JAX_PROCESS_ID"
ENV_TIMEOUT = "JAXLLM_COORDINATOR_TIMEOUT"
DEFAULT_TIMEOUT_S = 300.0
_WATCH_KEY = "jaxllm/watch"  # process 0's watch address in jax's key-value store

_watch: liveness.LeaderWatch | liveness.FollowerWatch | None = None  # set by initialize, for this process's run

# Header words: what follows (data / stop) and the byte length of a new layout (0: unchanged).
_DATA, _STOP = 0, 1


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value in (None, ""):
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def coordinator_timeout(timeout: float | None = None) -> float:
    """Seconds to wait for the coordinator: `timeout`, else $JAXLLM_COORDINATOR_TIMEOUT, else 300."""
    if timeout is None:
        value = os.environ.get(ENV_TIMEOUT)
        if value in (None, ""):
            return DEFAULT_TIMEOUT_S
        try:
            timeout = float(value)
        except ValueError:
            raise ValueError(f"environment variable {ENV_TIMEOUT}={value!r} is not a number of seconds") from None
    if not timeout > 0:
        raise ValueError(f"the coordinator timeout must be positive seconds, got {timeout}")
    return float(timeout)


def initialize(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None,
               *, local_device_ids: list[int] | None = None, timeout: float | None = None,
               prog: str = "jaxllm") -> bool:
    """Join a multi-process run (`jax.distributed.initialize`); returns whether one was joined.

    Each argument left None is read from JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID.
    With no coordinator and at most one process this is a single-process run: nothing is done. Must be
    called before anything touches a device. CPU devices exchange collectives through gloo (the CPU
    client has no other cross-process transport); GPUs use NCCL whatever this sets.

    Prints "waiting for the coordinator at HOST:PORT (process I of P) ..." on stderr, and waits at most
    `timeout` seconds (coordinator_timeout) for every process to join and open its watch; past that it
    prints one line naming the address and the timeout, `prog: error: ...`, and ends the process with
    status 2 (see the module docstring for why it cannot raise). Raises ValueError on bad arguments.
    """
    coordinator = coordinator or os.environ.get(_ENV_COORDINATOR) or None
    num_processes = num_processes if num_processes is not None else _env_int(_ENV_NUM_PROCESSES)
    process_id = process_id if process_id is not None else _env_int(_ENV_PROCESS_ID)
    if coordinator is None and (num_processes or 1) <= 1:
        return False
    if coordinator is None or num_processes is None or process_id is None:
        raise ValueError(f"a multi-process run needs a coordinator (HOST:PORT), num_processes and process_id; got "
                         f"coordinator={coordinator!r}, num_processes={num_processes!r}, process_id={process_id!r}")
    host, _, port = coordinator.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"coordinator {coordinator!r} is not HOST:PORT")
    if num_processes <= 0:
        raise ValueError(f"num_processes must be positive, got {num_processes}")
    if not 0 <= process_id < num_processes:
        raise ValueError(f"process_id {process_id} is outside [0, {num_processes})")
    timeout = coordinator_timeout(timeout)
    who = f"process {process_id} of {num_processes}"
    liveness.say(prog, f"waiting for the coordinator at {coordinator} ({who}) ...", 0)
    give_up = _GiveUp(prog, coordinator, host.strip("[]"), int(port), process_id, num_processes, timeout)
    try:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        # jax's own timeout comes later than ours: it would abort with a C++ trace.
        jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                                   process_id=process_id, local_device_ids=local_device_ids,
                                   initialization_timeout=int(timeout) + 60)
    except BaseException:  # e.g. called twice: the caller's to handle, with no timer left behind
        give_up.cancel()
        raise
    give_up.phase = "watch"
    global _watch
    _watch = _open_watch(host.strip("[]"), process_id, num_processes, give_up, prog)
    give_up.cancel()
    return True


class _GiveUp:
    """The deadline of joining. A timer thread covers jax.distributed.initialize (phase "coordinator"): at the
    deadline, one line naming the coordinator and the timeout, then exit status 2. The watch's waits (phase
    "watch") are Python's own, bounded by `left()`, and call `fail` themselves."""

    def __init__(self, prog, coordinator, host, port, process_id, num_processes, timeout):
        self.prog, self.coordinator, self.host, self.port = prog, coordinator, host, port
        self.process_id, self.num_processes, self.timeout = process_id, num_processes, timeout
        self.deadline = time.monotonic() + timeout
        self.phase = "coordinator"
        self._once = threading.Lock()
        self._timer = threading.Timer(timeout, self._expired)
        self._timer.daemon = True
        self._timer.start()

    def left(self) -> float:
        return max(self.deadline - time.monotonic(), 0.0)

    def cancel(self) -> None:
        self._timer.cancel()

    def _expired(self) -> None:
        if self.phase == "coordinator":
            self.fail()

    def fail(self, detail: str = "") -> None:
        """Say why the run did not start and end the process with status 2."""
        if not self._once.acquire(blocking=False):
            return
        who = f"process {self.process_id} of {self.num_processes}"
        after = f"after {self.timeout:g} s ({who})"
        longer = f"(to wait longer: --coordinator-timeout or ${ENV_TIMEOUT})"
        if self.phase == "watch":
            message = f"the run at {self.coordinator} did not finish starting {after}: {detail}"
        elif self.process_id == 0:
            message = (f"not all {self.num_processes} processes joined the coordinator at {self.coordinator} {after}: "
                       f"start the others with --coordinator {self.coordinator} --num-processes "
                       f"{self.num_processes} {longer}")
        elif not _answers(self.host, self.port):
            message = (f"no coordinator at {self.coordinator} {after}: is process 0 running with --coordinator "
                       f"{self.coordinator}? {longer}")
        else:
            message = (f"the coordinator at {self.coordinator} answers, but not all {self.num_processes} processes "
                       f"joined {after}: check every process's --num-processes and --process-id {longer}")
        liveness.leave(self.prog)(message, 2)


def _answers(host: str, port: int) -> bool:
    """Whether something listens at host:port (a plain TCP connect, closed at once)."""
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


def _open_watch(host: str, process_id: int, num_processes: int, give_up: _GiveUp, prog: str):
    """Process 0 listens and publishes its watch address in jax's key-value store; every follower
    connects to it. Bounded by the same deadline as the coordinator."""
    client = jax._src.distributed.global_state.client  # jax's key-value store: no public spelling
    if process_id == 0:
        watch = liveness.LeaderWatch(num_processes, prog=prog)
        client.key_value_set(_WATCH_KEY, watch.published)
        missing = watch.wait_joined(give_up.left())
        if missing:
            give_up.fail(f"process(es) {', '.join(map(str, missing))} did not connect to process 0's watch "
                        f"(port {watch.port} on this host)")
        return watch
    try:
        published = client.blocking_key_value_get(_WATCH_KEY, max(int(give_up.left() * 1000), 1))
        return liveness.FollowerWatch(process_id, num_processes, host, published, timeout=give_up.left() + 1.0,
                                      prog=prog)
    except Exception as e:  # jax's key-value store raises its own error type; a refused connection OSError
        give_up.fail(f"cannot reach process 0's watch at {host}: {type(e).__name__}: {str(e).splitlines()[0]}")
        raise  # not reached: give_up ends the process


def on_end(callback) -> None:
    """What this process does when the run ends under it (sharding.liveness): `callback(message, status)` on
    the watch's thread instead of printing the message and leaving with the status. No-op on one process."""
    if _watch is not None:
        _watch.on_end = callback


def forward_signals() -> None:
    """A follower: SIGTERM / SIGINT go to process 0, which stops the whole run (FollowerWatch.forward_signals).
    Main thread only; no-op on process 0 and on one process."""
    if isinstance(_watch, liveness.FollowerWatch):
        _watch.forward_signals()


def peer_lost(timeout: float = 0.0) -> str | None:
    """Process 0: the message naming a process of the run that died, waiting up to `timeout` seconds for the
    watch to see one (a step that just failed on a multi-process run most likely lost a peer, and the watch
    sees that within milliseconds); None when none died, and on other processes."""
    if isinstance(_watch, liveness.LeaderWatch):
        return _watch.died(timeout)
    return None


def stopping() -> None:
    """Process 0: tell the followers the run is stopping on purpose (StepBroadcast.stop does; an entry
    point that leaves before any step does it itself). No-op elsewhere."""
    if isinstance(_watch, liveness.LeaderWatch):
        _watch.stopping()


def is_leader() -> bool:
    """Process 0: the one that schedules, serves and sends every step's inputs."""
    return jax.process_index() == 0


def _wire(x: np.ndarray) -> np.ndarray:
    """How a leaf travels: the broadcast adds the processes' copies (all zero but the source's), and
    JAX adds booleans as integers."""
    return x.astype(np.uint8) if x.dtype == np.bool_ else x


def _broadcast(tree):
    from jax.experimental import multihost_utils

    return multihost_utils.broadcast_one_to_all(tree, is_source=is_leader())


class StepBroadcast:
    """Process 0's `send(inputs)` / `stop()` paired with every other process's `receive()`, in lock step.

    inputs: any pytree of arrays whose node types every process can import (the step's inputs
    dataclass). Each send must be matched by one receive on every other process.
    """

    def __init__(self):
        self._layout: bytes | None = None  # the last layout sent / received (pickled treedef, shapes, dtypes)
        self._treedef = None
        self._shapes: list[tuple[tuple[int, ...], np.dtype]] = []

    def _header(self, kind: int, layout_bytes: int) -> tuple[int, int]:
        header = _broadcast(np.array([kind, layout_bytes], np.int32))
        return int(header[0]), int(header[1])

    def _set_layout(self, layout: bytes) -> None:
        self._layout = layout
        self._treedef, self._shapes = pickle.loads(layout)

    def send(self, inputs) -> None:
        """Process 0: hand `inputs` to every process (the caller keeps using its own copy)."""
        if not is_leader():
            raise ValueError(f"StepBroadcast.send runs on process 0 only (this is process {jax.process_index()})")
        leaves, treedef = jax.tree.flatten(inputs)
        leaves = [np.asarray(x) for x in leaves]
        for x in leaves:
            if x.dtype.itemsize > 4 and not jax.config.jax_enable_x64:
                raise ValueError(f"step input of dtype {x.dtype} {x.shape}: 64-bit leaves would be narrowed by the "
                                 "broadcast; send 32-bit arrays")
        layout = pickle.dumps((treedef, [(x.shape, x.dtype.str) for x in leaves]))
        changed = layout != self._layout
        self._header(_DATA, len(layout) if changed else 0)
        if changed:
            _broadcast(np.frombuffer(layout, np.uint8))
            self._set_layout(layout)
        _broadcast([_wire(x) for x in leaves])

    def stop(self) -> None:
        """Process 0: tell the others there are no more steps."""
        if not is_leader():
            raise ValueError(f"StepBroadcast.stop runs on process 0 only (this is process {jax.process_index()})")
        stopping()  # before the stop: a follower may leave as soon as it has it
        self._header(_STOP, 0)

    def receive(self):
        """Other processes: the next inputs process 0 sent (NumPy leaves), or None once it stopped."""
        if is_leader():
            raise ValueError("StepBroadcast.receive runs on processes other than 0")
        kind, layout_bytes = self._header(_DATA, 0)
        if kind == _STOP:
            if isinstance(_watch, liveness.FollowerWatch):
                _watch.close()  # goodbye: this process's end is no failure now
            return None
        if layout_bytes:
            layout = _broadcast(np.zeros(layout_bytes, np.uint8))
            self._set_layout(np.asarray(layout, np.uint8).tobytes())
        placeholders = [_wire(np.zeros(shape, np.dtype(dtype))) for shape, dtype in self._shapes]
        leaves = _broadcast(placeholders)
        return jax.tree.unflatten(self._treedef, [np.asarray(x).astype(np.dtype(dtype))
                                                  for x, (_, dtype) in zip(leaves, self._shapes)])
