"""The entry points under faults (issue 33), as a new user meets them, on the CPU with processes on loopback:

- a process with no coordinator gives up after --coordinator-timeout / $JAXLLM_COORDINATOR_TIMEOUT with one
  line naming the address, status 2, no C++ trace;
- a follower that dies mid-request: process 0 fails the request with an error naming it and exits 1;
- SIGTERM to scripts/launch.py stops a served run: every process exits 0, none is left behind;
- a closed stdout: generate stops with status 141, a server still shuts down cleanly on SIGTERM.

Each case asserts its own bound (the processes' start-up on a loaded 2-core machine is most of it).
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.workers import free_port, repository_env, xla_flags

ROOT = Path(__file__).resolve().parents[2]
CPU2 = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags(2)}
# A small engine that starts fast: no warm-up (the request compiles its steps), few buckets.
SMALL_SERVER = ["--no-metrics", "--quiet", "--no-warm-up", "--max-running", "4", "--max-tokens-per-step", "64",
                "--max-logprobs", "0"]


def _no_trace(text: str) -> None:
    for mark in ("Traceback", "Check failure", "BrokenPipeError", "*** "):
        assert mark not in text, text


def _wait_for_line(proc, text: str, timeout: float) -> list[str]:
    """proc's stdout lines up to the first containing `text` (proc must still be running then)."""
    deadline, lines = time.monotonic() + timeout, []
    for line in proc.stdout:
        lines.append(line)
        if text in line:
            return lines
        assert time.monotonic() < deadline, "".join(lines)
    raise AssertionError(f"ended before {text!r}:\n" + "".join(lines))


def _live_processes_with(text: str) -> list[int]:
    """Process ids whose command line holds `text` (this machine's /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if text in (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


@pytest.mark.parametrize("entry, process_id, how, expected", [
    ("generate", 1, "flag", "no coordinator at {address} after 2 s (process 1 of 2): is process 0 running"),
    ("serve", 0, "env", "not all 2 processes joined the coordinator at {address} after 2 s (process 0 of 2)"),
])
def test_no_coordinator_gives_up_in_time_naming_the_address(entry, process_id, how, expected):
    address = f"127.0.0.1:{free_port()}"
    args = [sys.executable, "-m", f"jaxllm.{entry}", "--coordinator", address, "--num-processes", "2",
            "--process-id", str(process_id)]
    args += ["--coordinator-timeout", "2", "hi"] if how == "flag" else ["--port", str(free_port())]
    env = repository_env(JAXLLM_COORDINATOR_TIMEOUT="2") if how == "env" else repository_env()
    start = time.monotonic()
    proc = subprocess.run(args, env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    elapsed = time.monotonic() - start
    prog = f"python -m jaxllm.{entry}"
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert lines[0] == f"{prog}: waiting for the coordinator at {address} (process {process_id} of 2) ...", lines
    assert lines[-1].startswith(f"{prog}: error: " + expected.format(address=address)), lines
    assert len(lines) == 2, lines  # the waiting line and the error, nothing else
    assert elapsed < 30, elapsed  # 2 s of waiting, plus start-up
    _no_trace(proc.stderr)


@pytest.mark.slow
@pytest.mark.xdist_group("jaxllm_multiprocess")
def test_a_follower_that_dies_fails_the_request_and_process_0_exits_naming_it():
    import grpc

    from serve import jaxllm_pb2 as pb
    from serve import jaxllm_pb2_grpc as pb_grpc

    coordinator, port = f"127.0.0.1:{free_port()}", free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "jaxllm.serve", "--port", str(port), *SMALL_SERVER,
                               "--tensor-parallel", "4", "--coordinator", coordinator, "--num-processes", "2",
                               "--process-id", str(i)],
                              env=repository_env(**CPU2), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
             for i in range(2)]
    try:
        _wait_for_line(procs[0], "jaxllm serving", 240)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.LLMServiceStub(channel)
            stream = stub.Generate(pb.GenerateRequest(prompt_token_ids=[5, 17, 42], max_tokens=1000, ignore_eos=True),
                                   timeout=300)
            next(stream)  # running (its steps compiled): now the follower dies
            procs[1].kill()
            killed = time.monotonic()
            with pytest.raises(grpc.RpcError) as failed:
                for _ in stream:
                    pass
            assert time.monotonic() - killed < 15  # the watch sees it in milliseconds
        assert failed.value.code() == grpc.StatusCode.INTERNAL
        assert "process 1 of 2 died" in failed.value.details(), failed.value.details()
        assert procs[0].wait(timeout=15) == 1
        assert time.monotonic() - killed < 20
        out = procs[0].stdout.read()
        assert out.strip().splitlines()[-1] == (
            "python -m jaxllm.serve: error: process 1 of 2 died (its watch connection to process 0 closed without "
            "a goodbye); stopping"), out
        _no_trace(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.mark.slow
@pytest.mark.xdist_group("jaxllm_multiprocess")
def test_sigterm_to_launch_stops_every_server_process():
    port = free_port()
    launch = subprocess.Popen([sys.executable, str(ROOT / "scripts/launch.py"), "--num-processes", "2", "--cpu-devices",
                               "2", "--port", str(port), "--grace-period", "30", "--", sys.executable, "-m",
                               "jaxllm.serve", "--port", str(free_port()), *SMALL_SERVER, "--tensor-parallel", "4"],
                              env=repository_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
    coordinator = f"--coordinator 127.0.0.1:{port} "
    try:
        _wait_for_line(launch, "[0] jaxllm serving", 240)
        assert len(_live_processes_with(coordinator)) == 2
        launch.send_signal(signal.SIGTERM)
        start = time.monotonic()
        assert launch.wait(timeout=60) == 0, launch.stdout.read()
        assert time.monotonic() - start < 30  # the serve grace period is 10 s; they have nothing in flight
        assert _live_processes_with(coordinator) == []
        out = launch.stdout.read()
        assert "[0] jaxllm: stopped" in out and "[1] python -m jaxllm.serve: process 1: SIGTERM" in out, out
        _no_trace(out)
    finally:
        if launch.poll() is None:
            launch.kill()
            launch.wait()
        for pid in _live_processes_with(coordinator):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
def test_generate_into_a_closed_pipe_stops_with_status_141():
    start = time.monotonic()
    proc = subprocess.run(f"{sys.executable} -m jaxllm.generate --max-new-tokens 200 hi | head -c 1; "
                          "exit ${PIPESTATUS[0]}", shell=True, executable="/bin/bash", env=repository_env(), cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 141, proc.stderr
    assert proc.stdout == "h"
    assert proc.stderr.strip().splitlines()[-1] == "python -m jaxllm.generate: stdout closed; stopped", proc.stderr
    assert time.monotonic() - start < 60
    _no_trace(proc.stderr)


@pytest.mark.slow
def test_a_server_whose_stdout_reader_left_still_shuts_down_on_sigterm(tmp_path):
    """What a server whose launcher died meets: its stdout is a pipe nobody reads. It serves, and SIGTERM
    still stops it (status 0), where a BrokenPipeError used to kill its main thread and wedge it."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    port = free_port()
    stderr = open(tmp_path / "stderr", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "jaxllm.serve", "--port", str(port), "--no-metrics", "--no-warm-up",
                             "--max-running", "4", "--max-tokens-per-step", "64", "--max-logprobs", "0"],
                            env=repository_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=stderr)
    proc.stdout.close()  # the reader leaves before the server says anything
    try:
        deadline = time.monotonic() + 120
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            while True:
                assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "stderr").read_text()
                try:
                    if health.Check(health_pb2.HealthCheckRequest(), timeout=2).status == \
                            health_pb2.HealthCheckResponse.SERVING:
                        break
                except grpc.RpcError:
                    pass
                time.sleep(0.3)
        proc.send_signal(signal.SIGTERM)
        start = time.monotonic()
        assert proc.wait(timeout=30) == 0
        assert time.monotonic() - start < 20
        text = (tmp_path / "stderr").read_text()
        assert text.strip().splitlines()[-1] == "jaxllm: stopped", text
        _no_trace(text)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
