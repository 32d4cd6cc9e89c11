"""The API key check both front ends share: HTTP's `Authorization` header and gRPC's `authorization`
metadata carry `Bearer <key>`, compared with the server's key in constant time."""

from __future__ import annotations

import hmac

MISSING, INCORRECT = "missing", "incorrect"


def bearer_problem(header: str | None, key: str | None) -> str | None:
    """None when no key is set or `header` is "Bearer <key>" with this key; else MISSING (no bearer
    credential at all) or INCORRECT (another key)."""
    if key is None:
        return None
    scheme, _, given = (header or "").partition(" ")
    given = given.strip()
    if scheme.lower() != "bearer" or not given:
        return MISSING
    if not hmac.compare_digest(given.encode(), key.encode()):
        return INCORRECT
    return None
