"""What the scripts that start `python -m jaxllm.serve` themselves share (bench_serving.py, bench_end_to_end.py): a
free port for it, and waiting until its /health answers 200 (or it exits, or the time runs out)."""

from __future__ import annotations

import socket
import subprocess
import time
import urllib.error
import urllib.request

__all__ = ["free_port", "wait_healthy"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, server: subprocess.Popen, timeout_s: float, poll_s: float = 0.5) -> None:
    """Return once `url` (the server's /health) answers 200; RuntimeError if the server exits first, TimeoutError
    past timeout_s."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with status {server.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(poll_s)
    raise TimeoutError(f"{url} not healthy after {timeout_s:.0f} s")
