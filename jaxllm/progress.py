"""A tiny dependency-free progress reporter for long work (weight loading, warm-up compiles, benchmarks).

    with Progress(total=num_bytes, desc="loading", unit="B") as bar:
        for name, tensor in tensors:
            ...
            bar.update(tensor.nbytes, detail=name)

On a terminal it redraws one line in place (\\r); into a file or pipe (logs, CI) it writes a plain
line every 10% or 5 s, whichever comes first, so logs stay short and still show the job is alive.
"""

from __future__ import annotations

import sys
import time
from typing import Callable, TextIO

_TTY_MIN_INTERVAL_S = 0.1  # redraws faster than this only burn the terminal
_PLAIN_INTERVAL_S = 5.0
_PLAIN_FRACTION = 0.1
_BYTE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def _format_amount(value: float, unit: str) -> str:
    if unit == "B":
        for name in _BYTE_UNITS:
            if abs(value) < 1024 or name == _BYTE_UNITS[-1]:
                return f"{value:.0f} {name}" if name == "B" else f"{value:.1f} {name}"
            value /= 1024
    text = f"{value:g}" if isinstance(value, float) and not value.is_integer() else f"{int(value)}"
    return f"{text} {unit}" if unit else text


def _format_rate(rate: float, unit: str) -> str:
    if unit == "B":
        return _format_amount(rate, "B") + "/s"
    return f"{rate:.3g} {unit or 'it'}/s"


def _format_duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class Progress:
    """Counts work done out of `total` (None or 0 if unknown) and reports it with rate and ETA.

    Args:
      total: amount of work, in `unit`s ("B" formats as KiB/MiB/GiB).
      desc: what is being done, printed first on the line.
      stream: where to write; None means sys.stderr at construction time.
      enabled: False prints nothing at all (update still counts).
      clock: seconds, monotonic (tests pass a fake one).
    """

    def __init__(self, total: float | None, desc: str, unit: str = "", stream: TextIO | None = None,
                 enabled: bool = True, clock: Callable[[], float] = time.monotonic):
        if total is not None and total < 0:
            raise ValueError(f"progress total must be >= 0 or None, got {total}")
        self.total = total
        self.desc = desc
        self.unit = unit
        self.stream = sys.stderr if stream is None else stream
        self.enabled = enabled
        self.done = 0.0
        self._clock = clock
        self._tty = enabled and bool(getattr(self.stream, "isatty", lambda: False)())
        self._start = self._last_print = clock()
        self._next_fraction = _PLAIN_FRACTION
        self._line_width = 0
        self._closed = False

    def __enter__(self) -> "Progress":
        self._start = self._last_print = self._clock()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(failed=exc_type is not None)

    @property
    def elapsed(self) -> float:
        return self._clock() - self._start

    def update(self, n: float = 1, detail: str = "") -> None:
        """Record `n` more units done; `detail` (e.g. the tensor's name) is shown after the counts."""
        self.done += n
        if not self.enabled or self._closed:
            return
        now = self._clock()
        if self._tty:
            finished = bool(self.total) and self.done >= self.total
            if finished or now - self._last_print >= _TTY_MIN_INTERVAL_S:
                self._draw(self.line(detail), now)
            return
        fraction = self.done / self.total if self.total else 0.0
        if fraction >= self._next_fraction or now - self._last_print >= _PLAIN_INTERVAL_S:
            while self._next_fraction <= fraction:
                self._next_fraction += _PLAIN_FRACTION
            if fraction < 1.0:  # the 100% line is close()'s, with the total time
                self._write(self.line(detail) + "\n", now)

    def close(self, failed: bool = False) -> None:
        """Print the final line (once): counts, total time and average rate."""
        if self._closed:
            return
        self._closed = True
        if not self.enabled:
            return
        elapsed = self.elapsed
        rate = self.done / elapsed if elapsed > 0 else 0.0
        status = "failed" if failed else "done"
        text = f"{self.desc}: {status} {self._counts()} in {_format_duration(elapsed)}"
        if rate:
            text += f" ({_format_rate(rate, self.unit)})"
        if self._tty:
            self._draw(text, self._clock())
            self.stream.write("\n")
            self.stream.flush()
        else:
            self._write(text + "\n", self._clock())

    def line(self, detail: str = "") -> str:
        """The current status line: desc, percent, counts, rate, ETA, detail."""
        elapsed = self.elapsed
        parts = [f"{self.desc}:"]
        if self.total:
            parts.append(f"{100.0 * min(self.done / self.total, 1.0):5.1f}%")
        parts.append(self._counts())
        if elapsed > 0 and self.done > 0:
            rate = self.done / elapsed
            stats = _format_rate(rate, self.unit)
            if self.total and self.done < self.total:
                stats += f", ETA {_format_duration((self.total - self.done) / rate)}"
            parts.append(f"[{stats}]")
        if detail:
            parts.append(detail)
        return " ".join(parts)

    def _counts(self) -> str:
        done = _format_amount(self.done, self.unit)
        return f"{done}/{_format_amount(self.total, self.unit)}" if self.total else done

    def _draw(self, text: str, now: float) -> None:
        # Pad so a shorter line fully covers the previous one.
        pad = max(self._line_width - len(text), 0)
        self._line_width = len(text)
        self._write("\r" + text + " " * pad, now)

    def _write(self, text: str, now: float) -> None:
        self.stream.write(text)
        self.stream.flush()
        self._last_print = now
