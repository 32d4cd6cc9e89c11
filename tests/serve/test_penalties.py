"""Penalties and logit bias through every front end: LLM.generate, the threaded Engine, gRPC and HTTP (completions
and chat) give the same tokens for the same request, greedy and sampled; bad values are refused by each with the
engine's one message, naming the field and the limit.

One tiny engine with both servers attached over one threaded Engine, as `python -m jaxllm.serve --http-port` runs
them (no warm-up: the few shapes compile on first use)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import grpc
import numpy as np
import pytest

from jaxllm import LLM, EngineOptions
from jaxllm.contract import SamplingParams
from serve import jaxllm_pb2 as pb
from serve.http import HttpServer
from tests.serve.servers import grpc_and_http, wait_idle
from tests.seeds import seed

MAX_LOGIT_BIAS = 3
PENALTIES = dict(frequency_penalty=1.2, presence_penalty=-0.4, repetition_penalty=1.6, logit_bias={65: 2.0, 7: -3.0})


@pytest.fixture(scope="module")
def llm():
    options = EngineOptions(block_size=4, max_tokens_per_step=32, max_seqs=4, max_logit_bias=MAX_LOGIT_BIAS)
    return LLM("tiny", max_context=64, options=options, progress=False)


@pytest.fixture(scope="module")
def servers(llm):
    with grpc_and_http(llm) as servers:
        yield servers


def _post(http: HttpServer, path: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(http.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())




def _grpc_tokens(stub, **fields) -> list[int]:
    return [t for m in stub.Generate(pb.GenerateRequest(**fields), timeout=120) for t in m.token_ids]


@pytest.mark.parametrize("temperature", [0.0, 0.3])  # hotter, the random model's noise hides the penalties
def test_the_same_tokens_through_every_front_end(llm, servers, temperature):
    engine, stub, http = servers
    prompt = [int(t) for t in np.random.default_rng(seed(4401)).integers(3, 259, 9)]
    sampling = dict(temperature=temperature, seed=22, ignore_eos=True)
    messages = [{"role": "user", "content": "Say something."}]
    wait_idle(engine)
    python = llm.generate([prompt], max_new_tokens=8, **sampling, **PENALTIES)[0]
    plain = llm.generate([prompt], max_new_tokens=8, **sampling)[0]
    chat = llm.chat(messages, max_new_tokens=8, **sampling, **PENALTIES)
    assert python.token_ids != plain.token_ids  # the penalties change these tokens: the comparisons below can fail
    assert python.text != plain.text
    threaded = [t for out in engine.submit(prompt, SamplingParams(max_new_tokens=8, **sampling, **PENALTIES))
                for t in out.token_ids]
    assert threaded == python.token_ids
    assert _grpc_tokens(stub, prompt_token_ids=prompt, max_tokens=8, **sampling, **PENALTIES) == python.token_ids
    # HTTP answers text (token ids decoded): OpenAI's logit_bias keys are strings.
    body = dict(model="tiny", prompt=prompt, max_tokens=8, **sampling,
                **{**PENALTIES, "logit_bias": {str(t): b for t, b in PENALTIES["logit_bias"].items()}})
    status, answer = _post(http, "/completions", body)
    assert status == 200, answer
    assert answer["choices"][0]["text"] == python.text and answer["usage"]["completion_tokens"] == 8
    # Chat: the rendered conversation, through LLM.chat and the chat route.
    status, answer = _post(http, "/chat/completions", {**body, "messages": messages, "prompt": None})
    assert status == 200, answer
    assert answer["choices"][0]["message"]["content"] == chat.text


def test_null_penalties_are_the_neutral_values(llm, servers):
    engine, stub, http = servers
    wait_idle(engine)
    want = llm.generate([[5, 6, 7]], max_new_tokens=4, ignore_eos=True)[0].token_ids
    body = dict(model="tiny", prompt=[5, 6, 7], max_tokens=4, temperature=0.0, ignore_eos=True)
    nulls = dict(frequency_penalty=None, presence_penalty=None, repetition_penalty=None, logit_bias=None)
    _, plain = _post(http, "/completions", body)
    _, neutral = _post(http, "/completions", {**body, **nulls})
    _, zeros = _post(http, "/completions", {**body, "frequency_penalty": 0, "presence_penalty": 0,
                                            "repetition_penalty": 1, "logit_bias": {}})
    assert plain["choices"][0]["text"] == neutral["choices"][0]["text"] == zeros["choices"][0]["text"]
    assert _grpc_tokens(stub, prompt_token_ids=[5, 6, 7], max_tokens=4, ignore_eos=True) == want


@pytest.mark.parametrize("fields, param, message", [
    (dict(frequency_penalty=2.5), "frequency_penalty", "frequency_penalty must be in [-2, 2] (0 disables it), got 2.5"),
    (dict(presence_penalty=-2.01), "presence_penalty", "presence_penalty must be in [-2, 2]"),
    (dict(repetition_penalty=0.0), "repetition_penalty", "repetition_penalty must be a finite number > 0"),
    (dict(logit_bias={5: 101.0}), "logit_bias", "logit_bias[5]: the bias must be in [-100, 100], got 101.0"),
    (dict(logit_bias={259: 1.0}), "logit_bias", "logit_bias: token id 259 is outside the vocabulary [0, 259)"),
    (dict(logit_bias={1: 1.0, 2: 1.0, 3: 1.0, 4: 1.0}), "logit_bias",
     f"logit_bias has 4 entries, over the limit {MAX_LOGIT_BIAS}"),
])
def test_bad_values_are_refused_alike_naming_the_field_and_the_limit(servers, fields, param, message):
    _, stub, http = servers
    http_fields = {k: ({str(t): b for t, b in v.items()} if k == "logit_bias" else v) for k, v in fields.items()}
    status, body = _post(http, "/completions", dict(model="tiny", prompt="a", max_tokens=2, **http_fields))
    assert (status, body["error"]["param"]) == (400, param), body
    assert message in body["error"]["message"]
    with pytest.raises(grpc.RpcError) as err:
        _grpc_tokens(stub, prompt="a", max_tokens=2, **fields)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in err.value.details()


def test_http_logit_bias_keys_must_be_token_ids(servers):
    _, _, http = servers
    for key in ("abc", "1.5", " 7", "1_0", ""):
        status, body = _post(http, "/completions", dict(model="tiny", prompt="a", max_tokens=2, logit_bias={key: 1}))
        assert (status, body["error"]["param"]) == (400, "logit_bias"), body
        assert "is not a token id (an integer)" in body["error"]["message"]
    status, body = _post(http, "/completions", dict(model="tiny", prompt="a", max_tokens=2, logit_bias={"-3": 1}))
    assert status == 400 and "logit_bias: -3 is not a token id" in body["error"]["message"]
    status, body = _post(http, "/completions", dict(model="tiny", prompt="a", max_tokens=2, logit_bias={"3": "x"}))
    assert status == 400 and body["error"]["param"] == "logit_bias.3", body
