"""Start P processes of one multi-process JAX program on this machine, with a loopback coordinator.

    python scripts/launch.py --num-processes 2 --cpu-devices 2 -- python -m jaxllm.generate --tensor-parallel 4 ...

Each process gets the command with `--coordinator 127.0.0.1:PORT --num-processes P --process-id I`
appended (and the same in JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID, which
sharding.multihost.initialize reads when the flags are not parsed). --cpu-devices D gives each process
D CPU devices (JAX_PLATFORMS=cpu, collectives through gloo); --gpus-per-process G gives process I the
GPUs I*G .. I*G + G - 1 (CUDA_VISIBLE_DEVICES). Each process's stdout goes to this script's stdout and its
stderr to this script's stderr, line by line, each line prefixed with the process id (and dropped, not blocked,
once the stream it goes to is closed): what a program prints as its product stays apart from its logs.

Ending: when one process fails the others get SIGTERM; the exit status is the first failure's. SIGTERM or
SIGINT to this script goes to every process (each runs in its own session, so a terminal's Ctrl-C reaches
them through this script only, once); the exit status is then theirs (the first non-zero, else 0). Either
way, processes still running --grace-period seconds later (default 30) get SIGKILL: none is left behind.
A process killed by signal N counts as status 128 + N; --timeout's expiry is 124.

Several hosts: run the program once per host yourself, with the same --coordinator HOST0:PORT (an
address of host 0 the others can reach), --num-processes P and each host's own --process-id; this
script is the one-machine case.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Callable


def free_port() -> int:
    """A TCP port free on the loopback interface now (the coordinator binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_env(base: dict, *, coordinator: str, num_processes: int, process_id: int, cpu_devices: int | None,
                gpus_per_process: int | None) -> dict:
    """The environment of process `process_id`."""
    env = dict(base)
    env.update(JAX_COORDINATOR_ADDRESS=coordinator, JAX_NUM_PROCESSES=str(num_processes),
               JAX_PROCESS_ID=str(process_id))
    if cpu_devices:
        env["JAX_PLATFORMS"] = "cpu"
        flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
        env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={cpu_devices}"])
    if gpus_per_process:
        first = process_id * gpus_per_process
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(first + i) for i in range(gpus_per_process))
    return env


def _pump(stream, prefix: str, name: str) -> None:
    """Copy a process's output to ours (sys.stdout or sys.stderr, by `name`), line by line; once ours is closed,
    keep reading (so the process never blocks on a full pipe) and drop it."""
    out = getattr(sys, name)
    for line in iter(stream.readline, b""):
        if out is None:
            continue
        try:
            out.write(f"{prefix}{line.decode(errors='replace')}")
            out.flush()
        except (OSError, ValueError):  # our reader went away
            out = None


def _status(returncode: int) -> int:
    """A process's exit status as a shell shows it (killed by signal N: 128 + N)."""
    return 128 - returncode if returncode < 0 else returncode


def launch(command: list[str], *, num_processes: int, cpu_devices: int | None = None,
           gpus_per_process: int | None = None, port: int | None = None, timeout: float | None = None,
           append_flags: bool = True, grace_period: float = 30.0) -> int:
    """Run `command` as `num_processes` processes and wait for all; returns the exit status (module docstring)."""
    if num_processes <= 0:
        raise ValueError(f"--num-processes must be positive, got {num_processes}")
    if grace_period < 0:
        raise ValueError(f"--grace-period must be >= 0, got {grace_period}")
    if not command:
        raise ValueError("no command to launch (put it after `--`)")
    coordinator = f"127.0.0.1:{port or free_port()}"
    procs, pumps = [], []
    signals: list[int] = []
    restore = _forward_signals(signals, procs)
    try:
        for i in range(num_processes):
            flags = ["--coordinator", coordinator, "--num-processes", str(num_processes), "--process-id", str(i)]
            env = process_env(os.environ, coordinator=coordinator, num_processes=num_processes, process_id=i,
                              cpu_devices=cpu_devices, gpus_per_process=gpus_per_process)
            proc = subprocess.Popen(command + (flags if append_flags else []), env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, start_new_session=True)
            procs.append(proc)
            for stream, name in ((proc.stdout, "stdout"), (proc.stderr, "stderr")):
                pump = threading.Thread(target=_pump, args=(stream, f"[{i}] ", name), daemon=True)
                pump.start()
                pumps.append(pump)
        if signals:  # one came while starting: the processes started since have not had it
            _send(procs, signals[0])
        return _wait(procs, pumps, signals, timeout, grace_period)
    finally:
        _stop(procs, grace_period)  # only the processes this call started; a no-op once all ended
        restore()


def _wait(procs, pumps, signals: list[int], timeout: float | None, grace_period: float) -> int:
    deadline = None if timeout is None else time.monotonic() + timeout
    status = 0
    while any([p.poll() is None for p in procs]):  # a list: poll every process, not up to the first running
        failed = [_status(p.returncode) for p in procs if p.returncode not in (None, 0)]
        if signals:
            break  # they have it: wait for them below
        if failed or (deadline is not None and time.monotonic() > deadline):
            status = failed[0] if failed else 124
            break
        time.sleep(0.05)
    _stop(procs, grace_period, terminate=not signals)
    for pump in pumps:
        pump.join(timeout=5)
    if status == 0:
        status = next((_status(p.returncode) for p in procs if p.returncode != 0), 0)
    return status


def _send(procs, signum: int) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                p.send_signal(signum)
            except ProcessLookupError:
                pass


def _stop(procs, grace_period: float, terminate: bool = True) -> None:
    """SIGTERM (unless they already had a signal) to the processes still running, SIGKILL past the grace period."""
    if terminate:
        _send(procs, signal.SIGTERM)
    deadline = time.monotonic() + grace_period
    for p in procs:
        try:
            p.wait(timeout=max(deadline - time.monotonic(), 0))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _forward_signals(signals: list[int], procs: list) -> Callable[[], None]:
    """SIGTERM / SIGINT to this script: recorded in `signals` and sent to every process started; returns
    what puts the old handlers back. Only the main thread can take signals (elsewhere: nothing is done)."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def forward(signum, frame):
        signals.append(signum)
        _send(procs, signum)

    old = {signum: signal.signal(signum, forward) for signum in (signal.SIGTERM, signal.SIGINT)}
    return lambda: [signal.signal(signum, handler) for signum, handler in old.items()]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" in argv:
        split = argv.index("--")
        argv, command = argv[:split], argv[split + 1:]
    else:
        command = []
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-processes", type=int, required=True)
    devices = parser.add_mutually_exclusive_group()
    devices.add_argument("--cpu-devices", type=int, help="CPU devices per process (gloo collectives)")
    devices.add_argument("--gpus-per-process", type=int, help="GPUs per process (CUDA_VISIBLE_DEVICES)")
    parser.add_argument("--port", type=int, help="coordinator port (default: a free one)")
    parser.add_argument("--timeout", type=float, help="seconds before every process is stopped (exit 124)")
    parser.add_argument("--grace-period", type=float, default=30.0,
                        help="seconds processes get to end after SIGTERM before SIGKILL (default: 30)")
    parser.add_argument("--no-flags", action="store_true",
                        help="do not append --coordinator/--num-processes/--process-id (the environment still has them)")
    args = parser.parse_args(argv)
    try:
        status = launch(command, num_processes=args.num_processes, cpu_devices=args.cpu_devices,
                        gpus_per_process=args.gpus_per_process, port=args.port, timeout=args.timeout,
                        append_flags=not args.no_flags, grace_period=args.grace_period)
    except ValueError as e:
        parser.error(str(e))
    try:
        if sys.stdout is not None:
            sys.stdout.flush()
    except OSError:  # our reader went away: nothing left to say, and no error at exit either
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return status


if __name__ == "__main__":
    sys.exit(main())
