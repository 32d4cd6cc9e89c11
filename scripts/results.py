"""Names of the benchmark scripts' result files, so every script files its results the same way."""

from __future__ import annotations

import datetime
import time


def result_stem(device: str, name: str, date: str | None = None) -> str:
    """`<device>-<date>-<HHMM>-<name>`: the device kind lower-cased with dashes for spaces, the date
    (today's unless given: pass the one the result records), and the UTC time of day, which keeps a
    second run on the same day from overwriting the first one's file."""
    date = datetime.date.today().isoformat() if date is None else date
    return f"{device.lower().replace(' ', '-')}-{date}-{time.strftime('%H%M', time.gmtime())}-{name}"
