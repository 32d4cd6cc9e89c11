"""Start P processes of one multi-process JAX program on this machine, with a loopback coordinator.

    python scripts/launch.py --num-processes 2 --cpu-devices 2 -- python -m jaxllm.generate --tensor-parallel 4 ...

Each process gets the command with `--coordinator 127.0.0.1:PORT --num-processes P --process-id I`
appended (and the same in JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID, which
sharding.multihost.initialize reads when the flags are not parsed). --cpu-devices D gives each process
D CPU devices (JAX_PLATFORMS=cpu, collectives through gloo); --gpus-per-process G gives process I the
GPUs I*G .. I*G + G - 1 (CUDA_VISIBLE_DEVICES). Output is prefixed with the process id. When one process
fails the others are terminated; the exit status is the first failure's, else 0.

Several hosts: run the program once per host yourself, with the same --coordinator HOST0:PORT (an
address of host 0 the others can reach), --num-processes P and each host's own --process-id; this
script is the one-machine case.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import threading
import time


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


def _pump(stream, prefix: str) -> None:
    for line in iter(stream.readline, b""):
        sys.stdout.write(f"{prefix}{line.decode(errors='replace')}")
        sys.stdout.flush()


def launch(command: list[str], *, num_processes: int, cpu_devices: int | None = None,
           gpus_per_process: int | None = None, port: int | None = None, timeout: float | None = None,
           append_flags: bool = True) -> int:
    """Run `command` as `num_processes` processes and wait for all; returns the exit status."""
    if num_processes <= 0:
        raise ValueError(f"--num-processes must be positive, got {num_processes}")
    if not command:
        raise ValueError("no command to launch (put it after `--`)")
    coordinator = f"127.0.0.1:{port or free_port()}"
    procs, pumps = [], []
    for i in range(num_processes):
        flags = ["--coordinator", coordinator, "--num-processes", str(num_processes), "--process-id", str(i)]
        env = process_env(os.environ, coordinator=coordinator, num_processes=num_processes, process_id=i,
                          cpu_devices=cpu_devices, gpus_per_process=gpus_per_process)
        proc = subprocess.Popen(command + (flags if append_flags else []), env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT)
        procs.append(proc)
        pump = threading.Thread(target=_pump, args=(proc.stdout, f"[{i}] "), daemon=True)
        pump.start()
        pumps.append(pump)
    deadline = None if timeout is None else time.monotonic() + timeout
    status = 0
    try:
        while any([p.poll() is None for p in procs]):  # a list: poll every process, not up to the first running
            failed = [p.returncode for p in procs if p.returncode not in (None, 0)]
            if failed or (deadline is not None and time.monotonic() > deadline):
                status = failed[0] if failed else 124
                break
            time.sleep(0.05)
    finally:
        for p in procs:  # only the processes this call started
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for pump in pumps:
            pump.join(timeout=5)
    if status == 0:
        status = next((p.returncode for p in procs if p.returncode != 0), 0)
    return status


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
    parser.add_argument("--no-flags", action="store_true",
                        help="do not append --coordinator/--num-processes/--process-id (the environment still has them)")
    args = parser.parse_args(argv)
    try:
        return launch(command, num_processes=args.num_processes, cpu_devices=args.cpu_devices,
                      gpus_per_process=args.gpus_per_process, port=args.port, timeout=args.timeout,
                      append_flags=not args.no_flags)
    except ValueError as e:
        parser.error(str(e))


if __name__ == "__main__":
    sys.exit(main())
