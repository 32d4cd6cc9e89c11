"""gRPC and HTTP in this process over one threaded Engine: both read the engine's one RequestLimits, and
an HTTP request of several choices is queued all together or not at all.

A small engine (tiny model, max_context 64, request limits set in EngineOptions, two waiting slots)
with both servers attached, as `python -m jaxllm.serve --http-port` runs them; no warm-up, so the
few shapes these requests meet compile on first use.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import grpc
import pytest

from jaxllm import LLM, EngineOptions
from serve import jaxllm_pb2 as pb
from serve.http import HttpServer
from tests.serve.servers import grpc_and_http

MAX_STOP = 20  # over the default 16: a front end reading its own limits would refuse what the engine takes
DEFAULT_MAX_TOKENS = 3
MAX_WAITING = 2


@pytest.fixture(scope="module")
def llm():
    options = EngineOptions(block_size=4, max_tokens_per_step=32, max_seqs=4, default_max_tokens=DEFAULT_MAX_TOKENS,
                            max_stop_strings=MAX_STOP, max_stop_length=8)
    return LLM("tiny", max_context=64, options=options, progress=False)


@pytest.fixture(scope="module")
def servers(llm):
    with grpc_and_http(llm, max_waiting=MAX_WAITING) as servers:
        yield servers


def _post(http: HttpServer, path: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(http.url + path, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _generate(stub, **fields) -> list:
    return list(stub.Generate(pb.GenerateRequest(**fields), timeout=120))


def test_both_servers_report_the_engines_limits(llm, servers):
    engine, stub, http = servers
    assert http.state.adapter.limits is engine.limits is llm.limits
    info = stub.ModelInfo(pb.ModelInfoRequest(), timeout=10)
    assert (info.max_context, info.default_max_tokens, info.max_stop_strings, info.max_stop_length) == \
           (64, DEFAULT_MAX_TOKENS, MAX_STOP, 8)
    with urllib.request.urlopen(http.url + "/models", timeout=10) as response:
        assert json.loads(response.read())["data"][0]["max_model_len"] == 64


def test_stop_strings_up_to_the_engines_limit_are_served_one_more_refused(servers):
    engine, stub, http = servers
    stops = [f"#{i}" for i in range(MAX_STOP)]
    status, body = _post(http, "/completions", dict(model="tiny", prompt="a", max_tokens=2, stop=stops))
    assert status == 200, body
    assert _generate(stub, prompt="a", max_tokens=2, stop=stops)[-1].finish_reason != pb.FINISH_REASON_UNSPECIFIED
    message = f"stop has {MAX_STOP + 1} strings, over the limit {MAX_STOP}"
    status, body = _post(http, "/completions", dict(model="tiny", prompt="a", max_tokens=2, stop=stops + ["x"]))
    assert (status, body["error"]["param"]) == (400, "stop") and message in body["error"]["message"]
    with pytest.raises(grpc.RpcError) as err:
        _generate(stub, prompt="a", max_tokens=2, stop=stops + ["x"])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in err.value.details()


def test_unset_max_tokens_is_the_engines_default(servers):
    engine, stub, http = servers
    status, body = _post(http, "/completions", dict(model="tiny", prompt="a", ignore_eos=True))
    assert status == 200 and body["usage"]["completion_tokens"] == DEFAULT_MAX_TOKENS
    assert sum(len(m.token_ids) for m in _generate(stub, prompt="a", ignore_eos=True)) == DEFAULT_MAX_TOKENS


def test_choices_that_do_not_all_fit_are_refused_with_none_queued(servers):
    engine, stub, http = servers
    before = engine.stats()
    # More choices than the queue can ever hold: a 400 naming both, before the engine is asked (the engine's own
    # all-or-none QueueFull, a 429 when the queue is full for now: tests/jaxllm/engine/test_threaded.py).
    status, body = _post(http, "/completions", dict(model="tiny", prompt="a", max_tokens=2, n=MAX_WAITING + 1))
    assert status == 400 and body["error"]["param"] == "n", body
    assert f"needs {MAX_WAITING + 1} engine requests (1 prompt x n={MAX_WAITING + 1}), over the limit " \
           f"{MAX_WAITING}" in body["error"]["message"]
    after = engine.stats()
    assert (after.core.requests_total, after.scheduler.waiting, after.scheduler.running) == \
           (before.core.requests_total, 0, 0)
    assert after.core.requests_rejected == before.core.requests_rejected
    # A bad prompt after a good one: refused before either is queued.
    status, body = _post(http, "/completions", dict(model="tiny", prompt=["a", "x" * 70], max_tokens=2))
    assert status == 400 and body["error"]["message"].startswith("prompt 1: prompt has 71 tokens"), body
    assert engine.stats().core.requests_total == before.core.requests_total
    status, body = _post(http, "/completions", dict(model="tiny", prompt="a", max_tokens=2, n=MAX_WAITING))
    assert status == 200 and [c["index"] for c in body["choices"]] == list(range(MAX_WAITING))
    assert engine.stats().core.requests_total == before.core.requests_total + MAX_WAITING
