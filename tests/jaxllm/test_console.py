"""jaxllm.console: what a library writes to file descriptor 1 goes to stderr, the program's own text to stdout
(gloo's connection lines inside a streamed completion, issue 52); and a closed stdout is still quiet after it."""

import subprocess
import sys

from tests.workers import ROOT, repository_env

_PROGRAM = """
import os, sys
from jaxllm import console
console.guard()
sys.stdout.write("The capital of France is")
sys.stdout.flush()
console.library_stdout_to_stderr()
console.library_stdout_to_stderr()  # idempotent
os.write(1, b"[Gloo] Rank 0 is connected to 1 peer ranks.\\n")  # as C++'s std::cout does
sys.stdout.write(" Paris\\n")
print("a log line", file=sys.stderr)
"""


def test_library_output_on_fd_1_goes_to_stderr():
    proc = subprocess.run([sys.executable, "-c", _PROGRAM], env=repository_env(), cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "The capital of France is Paris\n"
    assert proc.stderr.splitlines() == ["[Gloo] Rank 0 is connected to 1 peer ranks.", "a log line"]


def test_a_closed_stdout_stays_quiet_after_the_move(tmp_path):
    program = tmp_path / "program.py"
    program.write_text(_PROGRAM.replace('sys.stdout.write(" Paris\\n")', 'sys.stdout.write(" Paris\\n" * 100000)\n'
                                        'print("closed:", console.closed(), file=sys.stderr)'))
    proc = subprocess.run(f"{sys.executable} {program} | head -c 4", shell=True, executable="/bin/bash",
                          env=repository_env(), cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.stdout == "The "
    assert "closed: True" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
