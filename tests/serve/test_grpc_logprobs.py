"""gRPC's logprobs and prompt_logprobs: the same numbers as the Python API and the HTTP API's echo, one
entry per token, the prompt's first token without a logprob, and the same limit refused alike.

A small engine (tiny model, max_context 64, max_logprobs 3) with both servers attached in this process.
"""

from __future__ import annotations

import json
import urllib.request

import grpc
import pytest

from jaxllm import LLM, EngineOptions
from serve import jaxllm_pb2 as pb
from serve.client import format_logprobs
from tests.serve.servers import grpc_and_http, wait_idle

MAX_LOGPROBS = 3
PROMPT = [1, 17, 230, 9, 41, 230, 9]  # a repeated pair: the second time its logprobs differ from the first


@pytest.fixture(scope="module")
def llm():
    options = EngineOptions(block_size=4, max_tokens_per_step=32, max_seqs=4, max_logprobs=MAX_LOGPROBS)
    return LLM("tiny", max_context=64, options=options, progress=False)


@pytest.fixture(scope="module")
def servers(llm):
    with grpc_and_http(llm) as servers:
        yield servers




def _messages(stub, **fields) -> list:
    return list(stub.Generate(pb.GenerateRequest(**fields), timeout=120))


def _as_entries(messages) -> list:
    """TokenLogprob messages -> the engine's `(logprob, ((id, logprob), ...))` shape (None: no logprob)."""
    return [(m.logprob, tuple((t.token_id, t.logprob) for t in m.top)) if m.HasField("logprob") else None
            for m in messages]


def _close(got, want) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        if w is None:
            assert g is None
            continue
        assert g[0] == pytest.approx(w[0], abs=1e-5)  # float32 on the wire
        assert [t for t, _ in g[1]] == [t for t, _ in w[1]]
        assert [lp for _, lp in g[1]] == pytest.approx([lp for _, lp in w[1]], abs=1e-5)


def test_prompt_logprobs_match_the_python_api_and_http_echo(llm, servers):
    engine, stub, http = servers
    wait_idle(engine)
    want = llm.generate(PROMPT, max_new_tokens=0, prompt_logprobs=2)[0].prompt_logprobs
    messages = _messages(stub, prompt_token_ids=PROMPT, max_tokens=0, prompt_logprobs=2)
    scored = [entry for m in messages for entry in m.prompt_logprobs]
    assert [m.token_id for m in scored] == PROMPT
    assert sum(1 for m in messages if m.prompt_logprobs) == 1  # on one message only
    assert not scored[0].HasField("logprob") and all(m.HasField("logprob") for m in scored[1:])
    _close(_as_entries(scored), want)
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 2}
    request = urllib.request.Request(http.url + "/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        echoed = json.loads(response.read())["choices"][0]["logprobs"]["token_logprobs"]
    assert echoed[0] is None
    assert echoed[1:] == pytest.approx([m.logprob for m in scored[1:]], abs=1e-5)


def test_generated_logprobs_one_per_token_as_the_python_api(llm, servers):
    engine, stub, _ = servers
    wait_idle(engine)
    want = llm.generate(PROMPT, max_new_tokens=5, logprobs=MAX_LOGPROBS, ignore_eos=True)[0]
    messages = _messages(stub, prompt_token_ids=PROMPT, max_tokens=5, logprobs=MAX_LOGPROBS, ignore_eos=True)
    for m in messages:
        assert [e.token_id for e in m.logprobs] == list(m.token_ids)
        assert not m.prompt_logprobs  # not asked for
    tokens = [t for m in messages for t in m.token_ids]
    assert tokens == want.token_ids
    _close(_as_entries([e for m in messages for e in m.logprobs]), want.logprobs)
    plain = _messages(stub, prompt_token_ids=PROMPT, max_tokens=5, ignore_eos=True)
    assert all(not m.logprobs for m in plain)  # unset returns none


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
def test_more_than_the_limit_is_refused_naming_the_field_and_the_limit(servers, field):
    _, stub, _ = servers
    with pytest.raises(grpc.RpcError) as err:
        _messages(stub, prompt_token_ids=PROMPT, max_tokens=1, **{field: MAX_LOGPROBS + 1})
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in err.value.details() and str(MAX_LOGPROBS) in err.value.details()


def test_zero_max_tokens_without_prompt_logprobs_is_refused(servers):
    _, stub, _ = servers
    with pytest.raises(grpc.RpcError) as err:
        _messages(stub, prompt_token_ids=PROMPT, max_tokens=0, logprobs=1)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt_logprobs" in err.value.details()


def test_the_client_prints_them():
    entries = [pb.TokenLogprob(token_id=1), pb.TokenLogprob(token_id=7, logprob=-0.5, top=[{"token_id": 7,
                                                                                          "logprob": -0.5}])]
    assert format_logprobs("t:", entries).splitlines() == ["t:", "        1         -", "        7   -0.5000  top: 7:-0.5000"]
