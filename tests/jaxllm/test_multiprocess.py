"""Two processes x two CPU devices (gloo, loopback coordinator), tensor parallel 4, end to end: through
`python -m jaxllm.generate` started by scripts/launch.py, and through `python -m jaxllm.serve` with a
gRPC client talking to process 0, then SIGTERM: both processes exit cleanly."""

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.workers import free_port, repository_env, xla_flags

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("jaxllm_multiprocess")]

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["hello there", "abc"]


def _completions(stdout: str, prefix: str = "") -> list[str]:
    """The completion lines generate --no-stream prints: one line of text, then '[N tokens, reason]'."""
    lines = [line[len(prefix):] for line in stdout.splitlines() if line.startswith(prefix)]
    return [lines[i - 1] for i, line in enumerate(lines) if re.fullmatch(r"\[\d+ tokens, \w+\]", line)]


def test_generate_two_processes_tensor_parallel_4_equals_one_process():
    args = ["-m", "jaxllm.generate", "--no-stream", "--max-new-tokens", "8", *PROMPTS]
    single = subprocess.run([sys.executable, *args], env=repository_env(), cwd=ROOT, capture_output=True, text=True,
                            timeout=300)
    assert single.returncode == 0, single.stderr[-3000:]
    proc = subprocess.run([sys.executable, str(ROOT / "scripts/launch.py"), "--num-processes", "2", "--cpu-devices",
                           "2", "--timeout", "300", "--", sys.executable, *args, "--tensor-parallel", "4"],
                          env=repository_env(), cwd=ROOT, capture_output=True, text=True, timeout=360)
    assert proc.returncode == 0, proc.stdout[-4000:]
    want = _completions(single.stdout)
    assert len(want) == 2
    assert _completions(proc.stdout, "[0] ") == want, proc.stdout[-3000:]
    assert "[1] " not in "".join(line[:4] for line in proc.stdout.splitlines() if "tokens," in line)


def test_generate_two_processes_two_instances_lending_equals_one_process():
    """2 processes x 2 devices as 2 instances x tensor parallel 2, each instance's pool (10 rBlocks of 16)
    shorter than the prompt: the sequence borrows from the instance on the other process, and the text is
    one process's with a pool big enough."""
    prompt = "the quick brown fox jumps over the lazy dog; " * 5  # 225 tokens: more than one pool's 160
    args = ["-m", "jaxllm.generate", "--no-stream", "--max-new-tokens", "8", "--block-size", "16", prompt]
    single = subprocess.run([sys.executable, *args, "--num-blocks", "40"], env=repository_env(), cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert single.returncode == 0, single.stderr[-3000:]
    proc = subprocess.run([sys.executable, str(ROOT / "scripts/launch.py"), "--num-processes", "2", "--cpu-devices",
                           "2", "--timeout", "300", "--", sys.executable, *args, "--num-blocks", "10", "--instances",
                           "2", "--tensor-parallel", "2"], env=repository_env(), cwd=ROOT, capture_output=True,
                          text=True, timeout=360)
    assert proc.returncode == 0, proc.stdout[-4000:]
    want = _completions(single.stdout)
    assert len(want) == 1
    assert _completions(proc.stdout, "[0] ") == want, proc.stdout[-3000:]
    # generate's closing line is on stderr (launch.py keeps each process's stdout and stderr apart)
    lent = re.search(r"\[0\] \[.*, (\d+) rBlocks lent between instances, (\d+) preemptions\]", proc.stderr)
    assert lent and int(lent.group(1)) > 0 and int(lent.group(2)) == 0, proc.stderr[-3000:]


def test_streamed_completion_is_all_of_stdout():
    """The README's example: a streamed completion over 2 processes x 2 CPU devices. gloo prints its connection
    lines (`[Gloo] Rank 0 is connected to 1 peer ranks. ...`) with std::cout as the step's collectives first
    connect, which once landed inside the text; stdout now holds the completion alone, as one process's does."""
    args = ["-m", "jaxllm.generate", "--max-new-tokens", "8", "The capital of France is"]
    # Bytes: the tiny model's text may hold any character (a form feed or a carriage return is no line's end to
    # launch.py, which splits lines on "\n" alone).
    single = subprocess.run([sys.executable, *args], env=repository_env(), cwd=ROOT, capture_output=True, timeout=300)
    assert single.returncode == 0, single.stderr[-3000:]
    assert single.stdout.startswith(b"The capital of France is") and single.stdout.endswith(b"\n"), single.stdout
    proc = subprocess.run([sys.executable, str(ROOT / "scripts/launch.py"), "--num-processes", "2", "--cpu-devices",
                           "2", "--timeout", "300", "--", sys.executable, *args, "--tensor-parallel", "4"],
                          env=repository_env(), cwd=ROOT, capture_output=True, timeout=360)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    # launch.py prefixes each line with the process's id; process 1 prints nothing on stdout
    want = b"".join(b"[0] " + line + b"\n" for line in single.stdout.split(b"\n")[:-1])
    assert proc.stdout == want, (proc.stdout, proc.stderr[-3000:])
    assert b"[Gloo]" not in proc.stdout


def test_serve_two_processes_grpc_then_sigterm_stops_both():
    import grpc

    from jaxllm import LLM
    from serve import jaxllm_pb2 as pb
    from serve import jaxllm_pb2_grpc as pb_grpc

    coordinator, port = f"127.0.0.1:{free_port()}", free_port()
    procs = []
    for i in range(2):
        env = dict(repository_env(), JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(2))
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "jaxllm.serve", "--port", str(port), "--no-metrics", "--quiet",
             "--tensor-parallel", "4", "--coordinator", coordinator, "--num-processes", "2", "--process-id", str(i),
             # A small engine: warm-up compiles (mirrored on both processes) are most of this test's time.
             "--max-running", "4", "--max-tokens-per-step", "64", "--max-logprobs", "0"],
            env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    try:
        deadline = time.monotonic() + 240
        for line in procs[0].stdout:
            if "jaxllm serving" in line or time.monotonic() > deadline:
                break
        assert procs[0].poll() is None and procs[1].poll() is None
        want = LLM("tiny", progress=False)
        ids = [5, 17, 42, 7, 99, 3]
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.LLMServiceStub(channel)
            info = stub.ModelInfo(pb.ModelInfoRequest(), timeout=30)
            assert (info.tensor_parallel, info.instances, info.processes, info.devices) == (4, 1, 2, 4)
            for temperature, seed in ((0.0, 0), (0.9, 11)):
                got = [t for m in stub.Generate(pb.GenerateRequest(prompt_token_ids=ids, max_tokens=6, ignore_eos=True,
                                                                   temperature=temperature, seed=seed), timeout=120)
                       for t in m.token_ids]
                expected = want.generate([ids], max_new_tokens=6, temperature=temperature, seed=seed,
                                         ignore_eos=True)[0].token_ids
                assert got == expected, (temperature, got, expected)
        procs[0].send_signal(signal.SIGTERM)
        for p in procs:
            assert p.wait(timeout=60) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
