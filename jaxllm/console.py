"""Standard output and error that outlive their reader: the entry points' prints never raise.

`python -m jaxllm.generate ... | head -c 1` closes generate's stdout after one byte; a server whose
launcher died writes into a pipe nobody reads. Python then raises BrokenPipeError at the next write,
anywhere (a progress bar, a shutdown message, a worker thread), and once more when it flushes at exit.
`guard()` (entry points only, first thing) wraps sys.stdout and sys.stderr: the first failed write points
the stream's file descriptor at /dev/null (so later writes, C++ logs and the flush at exit go there
quietly) and marks the stream closed; `closed("stdout")` tells a caller whose output is the product
(generate) to stop.
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
