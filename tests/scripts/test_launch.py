"""scripts/launch.py's ending: a signal to it reaches every process it started, it waits for them (SIGKILL past
--grace-period) and exits with their status, leaving no process behind; a closed stdout blocks nothing. The
processes are small Python programs (no jax): each case takes about a second."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Prints its pid, then waits; on SIGTERM it exits with 0, unless told to ignore it.
CHILD = ("import os, signal, sys, time\n"
         "if os.environ.get('IGNORE_TERM') and os.environ['JAX_PROCESS_ID'] == '1':\n"
         "    signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
         "else:\n"
         "    signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))\n"
         "print('pid', os.getpid(), flush=True)\n"
         "time.sleep(60)\n")


def _start(*launch_args, env=None):
    return subprocess.Popen([sys.executable, str(ROOT / "scripts/launch.py"), "--num-processes", "2", "--no-flags",
                             *launch_args, "--", sys.executable, "-c", CHILD],
                            cwd=ROOT, env={**os.environ, **(env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _pids(proc) -> list[int]:
    pids = []
    for line in proc.stdout:
        m = re.fullmatch(r"\[\d\] pid (\d+)\n", line)
        if m:
            pids.append(int(m.group(1)))
        if len(pids) == 2:
            return pids
    raise AssertionError(f"the processes did not start: {proc.stderr.read()}")


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_sigterm_reaches_every_process_and_launch_exits_with_their_status():
    proc = _start()
    pids = _pids(proc)
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=20) == 0, proc.stderr.read()
    assert time.monotonic() - start < 10
    assert all(_gone(pid) for pid in pids)


def test_sigint_is_forwarded_too():
    proc = _start()
    pids = _pids(proc)
    proc.send_signal(signal.SIGINT)
    # The children do not handle SIGINT: they die of it, and launch says so as a shell would (128 + 2).
    assert proc.wait(timeout=20) == 128 + signal.SIGINT, proc.stderr.read()
    assert all(_gone(pid) for pid in pids)


def test_a_process_that_ignores_sigterm_is_killed_after_the_grace_period():
    proc = _start("--grace-period", "1", env={"IGNORE_TERM": "1"})
    pids = _pids(proc)
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=20) == 128 + signal.SIGKILL, proc.stderr.read()
    assert 1 <= time.monotonic() - start < 10
    assert all(_gone(pid) for pid in pids)


def test_a_closed_stdout_blocks_no_process():
    """Processes that write far more than a pipe holds, after launch's reader went away: they finish, and
    launch exits 0 without a trace."""
    writer = "import sys\nfor i in range(20000): print('x' * 100)\n"
    proc = subprocess.Popen([sys.executable, str(ROOT / "scripts/launch.py"), "--num-processes", "2", "--no-flags", "--",
                             sys.executable, "-c", writer], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    proc.stdout.close()
    assert proc.wait(timeout=60) == 0
    stderr = proc.stderr.read()
    assert "Traceback" not in stderr and "BrokenPipe" not in stderr, stderr


def test_stdout_and_stderr_stay_apart():
    """A process's product (stdout) and its logs (stderr) reach launch's stdout and stderr, each line prefixed
    with its process id, so a log line cannot land inside the product's text."""
    child = ("import os, sys\n"
             "sys.stdout.write('text of ' + os.environ['JAX_PROCESS_ID']); sys.stdout.flush()\n"
             "print('a log line', file=sys.stderr, flush=True)\n"
             "print(' and its end')\n")
    proc = subprocess.run([sys.executable, str(ROOT / "scripts/launch.py"), "--num-processes", "2", "--no-flags", "--",
                           sys.executable, "-c", child], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.splitlines()) == ["[0] text of 0 and its end", "[1] text of 1 and its end"]
    assert sorted(proc.stderr.splitlines()) == ["[0] a log line", "[1] a log line"]
