"""Standard output and error that outlive their reader: the entry points' prints never raise.

`python -m jaxllm.generate ... | head -c 1` closes generate's stdout after one byte; a server whose
launcher died writes into a pipe nobody reads. Python then raises BrokenPipeError at the next write,
anywhere (a progress bar, a shutdown message, a worker thread), and once more when it flushes at exit.
`guard()` (entry points only, first thing) wraps sys.stdout and sys.stderr: the first failed write points
the stream's file descriptor at /dev/null (so later writes, C++ logs and the flush at exit go there
quietly) and marks the stream closed; `closed("stdout")` tells a caller whose output is the product
(generate) to stop.

Stdout holds the product alone. A library that writes to file descriptor 1 itself (gloo, a multi-process CPU
run's collectives, prints `[Gloo] Rank 0 is connected to 1 peer ranks. ...` with std::cout when it connects,
in the middle of a streamed completion) is pointed at stderr by `library_stdout_to_stderr()`, while sys.stdout
keeps the real stdout on a descriptor of its own.
"""

from __future__ import annotations

import io
import os
import sys

class _Guarded(io.TextIOBase):
    """A text stream whose writes never raise once its reader is gone (see the module docstring). Closed is a
    property of the stream it wraps (`lost`), not of the name: a stream wrapped later (a test's capture, a stream
    reopened) starts open."""

    def __init__(self, stream, lost: bool = False):
        self._stream = stream
        self.lost = lost

    def _lost(self) -> None:
        self.lost = True
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._stream.fileno())
            os.close(devnull)
        except (OSError, ValueError, AttributeError):  # no descriptor to redirect: drop writes only
            pass

    def moved(self, stream) -> None:
        """Write to `stream` from now on (library_stdout_to_stderr: the same file on another descriptor)."""
        self._stream = stream

    def write(self, text: str) -> int:
        if not self.lost:
            try:
                self._stream.write(text)
            except (OSError, ValueError):
                self._lost()
        return len(text)

    def flush(self) -> None:
        if self.lost:
            return
        try:
            self._stream.flush()
        except (OSError, ValueError):
            self._lost()

    def isatty(self) -> bool:
        return not self.lost and self._stream.isatty()

    def fileno(self) -> int:
        return self._stream.fileno()

    @property
    def encoding(self):
        return self._stream.encoding

    def writable(self) -> bool:
        return True

    def __getattr__(self, name):  # anything else (buffer, errors, ...) is the stream's
        return getattr(self._stream, name)


def guard() -> None:
    """Wrap sys.stdout and sys.stderr (see the module docstring); a stream Python found closed at start
    (sys.stdout is None) counts as closed. Idempotent."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if isinstance(stream, _Guarded):
            continue
        lost = stream is None
        if lost:
            stream = open(os.devnull, "w")
        setattr(sys, name, _Guarded(stream, lost))


def closed(name: str = "stdout") -> bool:
    """Whether the reader of sys.stdout (or "stderr") went away (False for a stream guard() has not wrapped)."""
    stream = getattr(sys, name)
    return isinstance(stream, _Guarded) and stream.lost


def library_stdout_to_stderr() -> None:
    """Point file descriptor 1 at stderr for the C and C++ code of this process, and sys.stdout at a copy of the
    real stdout (the module docstring says why). Before such a library first writes; idempotent; nothing is done
    where stdout has no descriptor (a test's capture) or is already stderr's file."""
    global _library_stdout_moved
    if _library_stdout_moved:
        return
    stream = sys.stdout
    try:
        fd, err = stream.fileno(), sys.stderr.fileno()
    except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
        return
    if os.path.sameopenfile(fd, err):
        return
    stream.flush()
    text = os.dup(fd)
    os.dup2(err, fd)
    _library_stdout_moved = True
    moved = open(text, "w", buffering=1 if getattr(stream, "line_buffering", False) else -1,
                 encoding=stream.encoding, errors=getattr(stream, "errors", None))
    if isinstance(stream, _Guarded):
        stream.moved(moved)
    else:
        sys.stdout = moved


_library_stdout_moved = False
