"""Multi-process start-up, the run's watch and process 0's step channel, through JAX itself.

Every process runs the same program (docs/ARCHITECTURE.md, decision 7). Process 0 schedules; before each
program it runs it sends the call and its host inputs to the others on the step channel (sharding.step_channel:
ZeroMQ messages, no device collective), which `initialize` opens and `step_channel()` returns. The others launch
each step on receipt, so every process runs ahead of its devices as one process does; the data plane stays the
collectives inside the programs (NCCL, gloo). The rows of a step's outputs that only other processes' devices
hold (an instance there) come back to process 0 on a second channel (sharding.step_results: `step_results()`),
so a step that borrows nothing runs no collective across processes either; `put` places host inputs without the
cross-process comparison jax.device_put makes (a collective). When process 0 stops it sends a stop, and the
others' `receive` returns None.

Joining: `initialize` takes the coordinator, the process count and this process's id from its arguments, else
JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID, else from a cluster launcher's environment
(SLURM's `srun`, Open MPI's `mpirun`), read by jax's own cluster detection (`launcher_run`), as a bare
`jax.distributed.initialize()` would. Process 0 then publishes the ports of its watch and its step channel in
jax's key-value store; the others connect to both on the coordinator's host.

Faults (README, "Several GPUs and hosts"): joining waits for the coordinator at most `timeout` seconds
(default 300, or $JAXLLM_COORDINATOR_TIMEOUT) and then ends the process with one line naming the
address, status 2. jax's own timeout cannot be used: it aborts the process with a C++ trace, and while
jax.distributed.initialize blocks no Python exception can leave it, so a timer thread leaves first.
Once joined, every process is watched (sharding.liveness): a process that dies ends the others within
milliseconds, instead of leaving them in a collective (or a wait for the next step) that never returns.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import threading
import time

import jax
import numpy as np

from sharding import liveness, step_channel as channels, step_results as returns

_ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
_ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
_ENV_PROCESS_ID = "JAX_PROCESS_ID"
ENV_TIMEOUT = "JAXLLM_COORDINATOR_TIMEOUT"
DEFAULT_TIMEOUT_S = 300.0
_WATCH_KEY = "jaxllm/watch"  # process 0's watch address in jax's key-value store
_STEPS_KEY = "jaxllm/steps"  # process 0's step-channel address, beside it
_RESULTS_KEY = "jaxllm/results"  # and its results channel's port

_watch: liveness.LeaderWatch | liveness.FollowerWatch | None = None  # set by initialize, for this process's run
_channel: channels.Sender | channels.Receiver | None = None  # likewise
_results: returns.Collector | returns.Returner | None = None  # likewise


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value in (None, ""):
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


@dataclasses.dataclass(frozen=True)
class LauncherRun:
    """A run a cluster launcher started (launcher_run): its name, the coordinator address jax derives from the
    launcher's environment, the process count, this process's id, and the devices jax gives it (None: all)."""

    launcher: str
    coordinator: str
    num_processes: int
    process_id: int
    local_device_ids: list[int] | None


def launcher_run(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None,
                 local_device_ids: list[int] | None = None) -> LauncherRun | None:
    """The run SLURM (`srun`) or Open MPI (`mpirun`) started this process in, None outside both: the values not
    given, read from the launcher's environment by jax's own cluster detection (what a bare
    `jax.distributed.initialize()` does; JAX_COORDINATOR_PORT overrides the port jax derives from the job id).
    Under a launcher jax gives each process the one device of its local rank (JAX_LOCAL_DEVICE_IDS, or
    local_device_ids, instead). Reads nothing but the environment."""
    from jax._src import clusters  # jax's detection has no public spelling but jax.distributed.initialize()

    for env, name in ((clusters.OmpiCluster, "Open MPI"), (clusters.SlurmCluster, "SLURM")):  # jax's own order
        if env.is_env_present():
            found = clusters.ClusterEnv.auto_detect_unset_distributed_params(
                coordinator, num_processes, process_id, local_device_ids, env.name, None)
            ids = None if found[3] is None else [int(i) for i in found[3]]
            return LauncherRun(name, found[0], int(found[1]), int(found[2]), ids)
    return None


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
    """Join a multi-process run (`jax.distributed.initialize`) and open its watch and step channel; returns
    whether one was joined.

    Each argument left None is read from JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID, and
    what is still missing from a cluster launcher's environment (launcher_run: SLURM, Open MPI). With no
    coordinator and at most one process (a launcher's single task too) this is a single-process run: nothing
    is done. Must be called before anything touches a device. CPU devices exchange collectives through gloo
    (the CPU client has no other cross-process transport); GPUs use NCCL whatever this sets.

    Prints "waiting for the coordinator at HOST:PORT (process I of P) ..." on stderr, and waits at most
    `timeout` seconds (coordinator_timeout) for every process to join and connect to process 0's watch and step
    channel; past that it prints one line naming the address and the timeout, `prog: error: ...`, and ends the
    process with status 2 (see the module docstring for why it cannot raise). Raises ValueError on bad
    arguments, and where pyzmq (the step channel's transport) is not installed.
    """
    coordinator = coordinator or os.environ.get(_ENV_COORDINATOR) or None
    num_processes = num_processes if num_processes is not None else _env_int(_ENV_NUM_PROCESSES)
    process_id = process_id if process_id is not None else _env_int(_ENV_PROCESS_ID)
    launcher = None
    if None in (coordinator, num_processes, process_id):
        if local_device_ids is None and os.environ.get("JAX_LOCAL_DEVICE_IDS"):  # as jax.distributed reads it
            local_device_ids = [int(i) for i in os.environ["JAX_LOCAL_DEVICE_IDS"].split(",")]
        run = launcher_run(coordinator, num_processes, process_id, local_device_ids)
        if run is not None:
            if run.num_processes <= 1:
                return False  # one task: nothing to join
            launcher = run.launcher
            coordinator, num_processes, process_id = run.coordinator, run.num_processes, run.process_id
            local_device_ids = run.local_device_ids
    if coordinator is None and (num_processes or 1) <= 1:
        size = _env_int("OMPI_COMM_WORLD_SIZE")  # mpirun started this process, and jax read nothing of it
        if launcher is None and size is not None and size > 1:
            raise ValueError(f"mpirun started {size} processes (OMPI_COMM_WORLD_SIZE={size}), but jax's cluster "
                             "detection finds no Open MPI run here (it reads OMPI_MCA_orte_hnp_uri, which Open MPI "
                             "4's mpirun sets): give the coordinator (JAX_COORDINATOR_ADDRESS=HOST:PORT, or "
                             "--coordinator) with JAX_NUM_PROCESSES and JAX_PROCESS_ID")
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
    channels.require_zmq()  # before joining: a missing package is said at once, not after the others wait
    who = f"process {process_id} of {num_processes}" + (f", started by {launcher}" if launcher else "")
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
    global _watch, _channel, _results
    _watch, _channel, _results = _open_run(host.strip("[]"), process_id, num_processes, give_up, prog)
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


def _open_run(host: str, process_id: int, num_processes: int, give_up: _GiveUp, prog: str):
    """(watch, step channel, results channel). Process 0 listens on all three and publishes their ports in jax's
    key-value store; every follower connects to them. Bounded by the same deadline as the coordinator."""
    client = jax._src.distributed.global_state.client  # jax's key-value store: no public spelling
    if process_id == 0:
        watch = liveness.LeaderWatch(num_processes, prog=prog)
        client.key_value_set(_WATCH_KEY, watch.published)
        sender = channels.Sender(num_processes, flatten=jax.tree.flatten, before_stop=watch.stopping)
        client.key_value_set(_STEPS_KEY, sender.published)
        collector = returns.Collector(dead=watch.died)
        client.key_value_set(_RESULTS_KEY, str(collector.port))
        for what, joined, port in (("watch", watch.wait_joined, watch.port), ("step channel", sender.wait_joined,
                                                                             sender.port)):
            missing = joined(give_up.left())
            if missing:
                give_up.fail(f"process(es) {', '.join(map(str, missing))} did not connect to process 0's {what} "
                             f"(port {port} on this host)")
        return watch, sender, collector
    what = "watch"
    try:
        published = client.blocking_key_value_get(_WATCH_KEY, max(int(give_up.left() * 1000), 1))
        watch = liveness.FollowerWatch(process_id, num_processes, host, published, timeout=give_up.left() + 1.0,
                                       prog=prog)
        what = "step channel"
        published = client.blocking_key_value_get(_STEPS_KEY, max(int(give_up.left() * 1000), 1))
        receiver = channels.Receiver(process_id, num_processes, host, published, unflatten=jax.tree.unflatten,
                                     on_stop=watch.close)  # goodbye: this process's end is no failure now
        what = "results channel"
        port = client.blocking_key_value_get(_RESULTS_KEY, max(int(give_up.left() * 1000), 1))
        return watch, receiver, returns.Returner(process_id, host, int(port))
    except Exception as e:  # jax's key-value store raises its own error type; a refused connection OSError
        give_up.fail(f"cannot reach process 0's {what} at {host}: {type(e).__name__}: {str(e).splitlines()[0]}")
        raise  # not reached: give_up ends the process


def step_channel() -> channels.Sender | channels.Receiver | None:
    """This process's end of the step channel (sharding.step_channel): process 0's Sender, another process's
    Receiver; None on one process (nothing to hand over)."""
    return _channel


def step_results() -> returns.Collector | returns.Returner | None:
    """This process's end of the results channel (sharding.step_results): process 0's Collector, another
    process's Returner; None on one process."""
    return _results


def put(tree, sharding):
    """Host arrays (the same on every process) and device arrays onto `sharding`, as jax.device_put; on a sharding
    that spans processes each process places its own shards of a host array, where jax.device_put would first
    compare every process's copy (multihost_utils.assert_equal: a collective and a device sync, each call)."""
    if sharding.is_fully_addressable:
        return jax.device_put(tree, sharding)

    def one(x):
        if isinstance(x, jax.Array):
            return jax.device_put(x, sharding)  # placed already: kept (or resharded) as jax does
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

    return jax.tree.map(one, tree)


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
    """Process 0: tell the followers the run is stopping on purpose (the step channel's stop does; an entry
    point that leaves before any step does it itself). No-op elsewhere."""
    if isinstance(_watch, liveness.LeaderWatch):
        _watch.stopping()


def is_leader() -> bool:
    """Process 0: the one that schedules, serves and sends every step's inputs."""
    return jax.process_index() == 0
