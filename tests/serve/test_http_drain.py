"""An HTTP-only server (`--http-only`): its own /metrics, a full queue answering 429, SIGTERM draining.

A server of its own (one running slot, one waiting slot, no warm-up), so the queue fills at once.
"""

from __future__ import annotations

import signal
import threading
import time

import openai
import pytest

from tests.serve.test_http import HttpServerProcess, _wait_metric

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("http")]


def _consume(stream, into: list, first: threading.Event, done: threading.Event):
    try:
        for chunk in stream:
            into.append(chunk)
            first.set()
    except Exception as e:  # noqa: BLE001 (recorded for the test to look at)
        into.append(e)
    finally:
        first.set()
        done.set()


def test_http_only_queue_full_then_sigterm_drains(tmp_path):
    grace = 3.0
    s = HttpServerProcess(tmp_path, "--http-only", "--max-context", "8192", "--allow-long-context", "--max-running",
                          "1", "--max-queue", "1", "--no-warm-up", "--grace-period", str(grace))
    try:
        s.wait_line(r"jaxllm serving tiny on http://127\.0\.0\.1:\d+/v1", 120)
        client = openai.OpenAI(base_url=s.url, api_key="unused", max_retries=0, timeout=60)
        m = s.metrics()  # no gRPC servicer: the HTTP server registered the engine's series itself
        assert m["jaxllm_ready"] == 1 and m["jaxllm_kv_pool_usage_ratio"] == 0 and m["jaxllm_queue_depth"] == 0

        streams = {}
        for name in ("long", "queued"):
            chunks, first, done = [], threading.Event(), threading.Event()
            stream = client.completions.create(model="tiny", prompt=f"{name} stream", max_tokens=8000,
                                               stream=True, extra_body={"ignore_eos": True})
            threading.Thread(target=_consume, args=(stream, chunks, first, done), daemon=True).start()
            streams[name] = (chunks, first, done)
            if name == "long":
                assert first.wait(60)  # running: the one slot is taken
        assert _wait_metric(s, "jaxllm_queue_depth", lambda v: v == 1) == 1
        with pytest.raises(openai.RateLimitError, match="limit 1"):  # refused at once, not held
            client.completions.create(model="tiny", prompt="one too many", max_tokens=2)

        t0 = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 5
        while s.get("/health")[0] != 503 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert s.get("/health")[0] == 503
        with pytest.raises(openai.InternalServerError, match="shutting down"):  # 503
            client.completions.create(model="tiny", prompt="too late", max_tokens=2)
        assert s.proc.wait(timeout=grace + 15) == 0, s.log()
        assert time.monotonic() - t0 < grace + 5, "exit took too long"
        for name, (chunks, _, done) in streams.items():
            assert done.wait(5)
            assert chunks and not isinstance(chunks[-1], Exception), f"{name}: {chunks[-1:]}"
            # Still running (or waiting) when the grace period ran out: ended cleanly, not cut off.
            assert chunks[-1].choices[0].finish_reason == "cancelled", name
        assert "jaxllm: stopped" in s.log()
    finally:
        s.close()
