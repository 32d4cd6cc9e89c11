"""The edges a new user hits, tried as one would, against gRPC and HTTP in this process on one engine with
an API key (issue 34): a body nested too deeply, a request that can never fit the queue, the key on gRPC,
lone surrogates in any text field, malformed protobufs, seeds, the `tool` role, /tokenize and /detokenize.

A small engine (tiny model, max_context 64, four waiting slots, no warm-up: the few shapes these requests
meet compile on first use) with both servers attached, as `python -m jaxllm.serve --http-port` runs them.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from jaxllm import LLM, EngineOptions
from jaxllm.engine.threaded import Engine
from jaxllm.model.chat import chat_prompt
from serve import jaxllm_pb2 as pb
from serve import jaxllm_pb2_grpc as pb_grpc
from serve.http import HttpConfig, HttpServer
from serve.metrics import parse
from serve.server import SERVICE_NAME, Server, ServerConfig

KEY = "edge-key"
AUTH = (("authorization", f"Bearer {KEY}"),)
MAX_CONTEXT = 64
MAX_WAITING = 4
INVALID, UNAUTHENTICATED = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAUTHENTICATED


@pytest.fixture(scope="module")
def llm():
    options = EngineOptions(block_size=4, max_tokens_per_step=32, max_seqs=4)
    return LLM("tiny", max_context=MAX_CONTEXT, options=options, progress=False)


@pytest.fixture(scope="module")
def servers(llm):
    engine = Engine(llm.core, llm.tokenizer, llm.info(), max_waiting=MAX_WAITING)
    grpc_server = Server(ServerConfig(port=0, api_key=KEY))
    http = HttpServer(HttpConfig(port=0, api_key=KEY), grpc_server.registry)
    grpc_server.attach(engine, "tiny")
    http.attach(engine, "tiny")
    channel = grpc.insecure_channel(f"127.0.0.1:{grpc_server.port}")
    yield engine, grpc_server, channel, http
    channel.close()
    http.stop_accepting()
    grpc_server.shutdown(1.0)  # drains the engine
    http.shutdown(5.0)


@pytest.fixture(scope="module")
def stub(servers):
    return pb_grpc.LLMServiceStub(servers[2])


def _metrics(servers) -> dict[str, float]:
    return parse(servers[1].registry.render())


def _post(http: HttpServer, path: str, body, *, key: str | None = KEY, raw: bytes | None = None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    root = http.url[:-len("/v1")]
    data = raw if raw is not None else json.dumps(body).encode()  # ensure_ascii: a lone surrogate as \ud800
    request = urllib.request.Request(root + path, data, headers)
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _error(status_body: tuple[int, dict], status: int, message: str, param=...) -> dict:
    status_got, body = status_body
    assert status_got == status, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    assert message in body["error"]["message"], body
    if param is not ...:
        assert body["error"]["param"] == param, body
    return body["error"]


def _rpc_error(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        result = call()
        if not isinstance(result, (pb.TokenizeResponse, pb.ModelInfoResponse)):
            list(result)
    return err.value


def _generate(stub, **fields) -> list:
    return list(stub.Generate(pb.GenerateRequest(**fields), timeout=120, metadata=AUTH))


# ----- the body -----

@pytest.mark.parametrize("raw", [b"[" * 100_000, b'{"model": "tiny", "prompt": ' + b"[" * 100_000],
                         ids=["bare", "in-a-field"])
def test_deeply_nested_json_is_a_400_in_openais_shape_and_counted(servers, raw):
    http = servers[3]
    before = _metrics(servers).get('jaxllm_http_requests_total{code="400"}', 0)
    _error(_post(http, "/v1/completions", None, raw=raw), 400, "nested more deeply than the decoder's limit")
    assert _metrics(servers)['jaxllm_http_requests_total{code="400"}'] == before + 1
    assert _post(http, "/v1/completions", dict(model="tiny", prompt="a", max_tokens=1))[0] == 200  # no harm done


# ----- a request that can never fit -----

def test_a_request_that_can_never_fit_the_queue_is_a_400_and_nothing_is_queued(servers):
    engine, http = servers[0], servers[3]
    before = engine.stats()
    cases = [(dict(prompt=["hi"] * 300, n=16), "needs 4800 engine requests (300 prompts x n=16)", "n"),
             (dict(prompt=["hi"] * (MAX_WAITING + 1)), f"needs {MAX_WAITING + 1} engine requests", "prompt"),
             (dict(prompt="hi", n=MAX_WAITING + 1), f"needs {MAX_WAITING + 1} engine requests (1 prompt x n=5)", "n")]
    for fields, message, param in cases:
        error = _error(_post(http, "/v1/completions", dict(model="tiny", max_tokens=1, **fields)), 400, message, param)
        assert f"over the limit {MAX_WAITING} the server can queue at once" in error["message"]
    after = engine.stats()
    assert (after.core.requests_total, after.core.requests_rejected, after.scheduler.waiting) == \
           (before.core.requests_total, before.core.requests_rejected, 0)
    status, body = _post(http, "/v1/completions", dict(model="tiny", prompt=["a", "b"], n=2, max_tokens=1))
    assert status == 200 and len(body["choices"]) == MAX_WAITING  # exactly the queue's size still fits


# ----- the API key on gRPC -----

def test_grpc_needs_the_api_key_like_http_and_counts_refusals(servers, stub):
    channel = servers[2]
    key = 'jaxllm_requests_total{code="UNAUTHENTICATED"}'
    before = _metrics(servers).get(key, 0)
    request = pb.GenerateRequest(prompt="a", max_tokens=1)
    for metadata, message in [((), "missing API key: send the metadata 'authorization: Bearer <key>'"),
                              ((("authorization", "Bearer wrong"),), "incorrect API key"),
                              ((("authorization", KEY),), "missing API key")]:  # no "Bearer"
        err = _rpc_error(lambda: stub.Generate(request, timeout=30, metadata=metadata))
        assert err.code() == UNAUTHENTICATED and err.details().startswith(message), err.details()
    assert _metrics(servers)[key] == before + 3
    for call in (lambda: stub.Tokenize(pb.TokenizeRequest(text="a"), timeout=30),
                 lambda: stub.ModelInfo(pb.ModelInfoRequest(), timeout=30)):
        assert _rpc_error(call).code() == UNAUTHENTICATED
    assert _generate(stub, prompt="a", max_tokens=1)[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert stub.ModelInfo(pb.ModelInfoRequest(), timeout=30, metadata=AUTH).max_context == MAX_CONTEXT
    # Health stays open, as HTTP's /health does: load balancers carry no key.
    health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=10)
    assert health.status == health_pb2.HealthCheckResponse.SERVING


# ----- text fields -----

def test_a_lone_surrogate_is_refused_the_same_way_in_every_text_field(servers, stub, llm):
    http = servers[3]
    lone = "U+D800 at position 1 (text must be valid Unicode, encodable as UTF-8)"
    for fields, message, param in [
            (dict(prompt="a\ud800"), f"prompt is not valid text: it holds the lone surrogate {lone}", "prompt"),
            (dict(prompt=["ok", "a\ud800"]), "prompt 1: prompt is not valid text", "prompt"),
            (dict(prompt="a", stop=["fine", "a\ud800"]), f"stop[1] is not valid text: it holds the lone surrogate {lone}",
             "stop")]:
        _error(_post(http, "/v1/completions", dict(model="tiny", max_tokens=1, **fields)), 400, message, param)
    chat = dict(model="tiny", max_tokens=1, messages=[{"role": "user", "content": "a\ud800"}])
    _error(_post(http, "/v1/chat/completions", chat), 400,
           f"messages[0].content is not valid text: it holds the lone surrogate {lone}", "messages")
    _error(_post(http, "/tokenize", dict(prompt="a\ud800")), 400, "prompt is not valid text", "prompt")
    # gRPC: a surrogate's UTF-8-style bytes in a string field; the same message, naming the field.
    raw = servers[2].unary_stream(f"/{SERVICE_NAME}/Generate")
    for data, message in [(b"\x0a\x04a\xed\xa0\x80", f"prompt is not valid text: it holds the lone surrogate {lone}"),
                          (b"\x0a\x01a\x42\x01x\x42\x04a\xed\xa0\x80", "stop[1] is not valid text: it holds the lone "
                                                                       f"surrogate {lone}")]:
        err = _rpc_error(lambda: raw(data, timeout=30, metadata=AUTH))
        assert err.code() == INVALID and message in err.details(), err.details()
    with pytest.raises(ValueError, match="prompt 0 is not valid text: it holds the lone surrogate U\\+D800"):
        llm.generate(["a\ud800"], max_new_tokens=1)  # the Python API: the same rule
    with pytest.raises(ValueError, match="stop\\[0\\] is not valid text"):
        llm.generate(["a"], max_new_tokens=1, stop=["\udfff"])


def test_the_tool_role_is_refused_in_one_place_naming_the_template(servers):
    status_body = _post(servers[3], "/v1/chat/completions",
                        dict(model="tiny", max_tokens=1, messages=[{"role": "user", "content": "a"},
                                                                   {"role": "tool", "content": "42"}]))
    error = _error(status_body, 400, "message 1 has role 'tool', which Llama-2's [INST] format", "messages")
    assert "roles: ['system', 'user', 'assistant']" in error["message"]
    error = _error(_post(servers[3], "/v1/chat/completions",
                         dict(model="tiny", max_tokens=1, messages=[{"role": "robot", "content": "a"}])), 400,
                   "message 0 must be a dict with role in ['system', 'user', 'assistant']", "messages")
    assert "tool" not in error["message"]  # nothing listed that would then be refused


# ----- malformed protobufs -----

def test_a_malformed_protobuf_is_invalid_argument_counted(servers):
    channel = servers[2]
    key = 'jaxllm_requests_total{code="INVALID_ARGUMENT"}'
    before = _metrics(servers).get(key, 0)
    generate = channel.unary_stream(f"/{SERVICE_NAME}/Generate")
    for data, message in [(b"\x0a\x02\xff\xfe", "malformed GenerateRequest: prompt is not valid text: byte 0xff at "
                                                "position 0 is not UTF-8"),
                          (b"\x0a\x05ab", "malformed GenerateRequest: the message ends in the middle of a field"),
                          (b"\x0f", "malformed GenerateRequest: field 1 has wire type 7")]:
        err = _rpc_error(lambda: generate(data, timeout=30, metadata=AUTH))
        assert err.code() == INVALID and err.details().startswith(message), err.details()
    assert _metrics(servers)[key] == before + 3
    tokenize = channel.unary_unary(f"/{SERVICE_NAME}/Tokenize")
    err = _rpc_error(lambda: tokenize(b"\x0a\x01\xff", timeout=30, metadata=AUTH))
    assert err.code() == INVALID and "malformed TokenizeRequest: text is not valid text" in err.details()
    # Without the key, the key is what is wrong (a malformed body tells nothing to a stranger).
    assert _rpc_error(lambda: generate(b"\x0a\x02\xff\xfe", timeout=30)).code() == UNAUTHENTICATED


def test_every_method_of_the_service_gets_the_tolerant_deserializer():
    from serve.decoding import Malformed
    from serve.server import _add_servicer

    registered = []

    class _Server:
        def add_generic_rpc_handlers(self, handlers):
            registered.extend(handlers)

    _add_servicer(pb_grpc.LLMServiceServicer(), _Server())
    (handler,) = registered
    for name in pb.DESCRIPTOR.services_by_name["LLMService"].methods_by_name:
        call = type("Call", (), {"method": f"/{SERVICE_NAME}/{name}", "invocation_metadata": ()})()
        method_handler = handler.service(call)
        assert method_handler is not None, name
        assert isinstance(method_handler.request_deserializer(b"\x0f"), Malformed), name


# ----- seeds -----

def test_without_a_seed_both_front_ends_sample_afresh_and_with_one_reproduce(servers, stub):
    def grpc_tokens(**seed):
        return tuple(t for m in _generate(stub, prompt="seed me", max_tokens=12, temperature=1.0, ignore_eos=True,
                                          **seed) for t in m.token_ids)

    def http_text(**seed):
        status, body = _post(servers[3], "/v1/completions", dict(model="tiny", prompt="seed me", max_tokens=12,
                                                                 temperature=1.0, ignore_eos=True, **seed))
        assert status == 200, body
        return body["choices"][0]["text"]

    assert len({grpc_tokens() for _ in range(3)}) > 1  # a fresh seed each time (12 near-uniform tokens)
    assert len({http_text() for _ in range(3)}) > 1
    assert len({grpc_tokens(seed=5) for _ in range(2)}) == 1 and len({http_text(seed=5) for _ in range(2)}) == 1
    assert grpc_tokens(seed=0) == grpc_tokens(seed=0)  # seed 0 is a seed like any other, not "unset"


# ----- /tokenize, /detokenize, /v1/models -----

def test_tokenize_and_detokenize_in_vllms_shapes(servers, llm):
    http = servers[3]
    text = "Tokenize me: ünïcode ✓"
    ids = llm.tokenizer.encode(text)
    assert _post(http, "/tokenize", dict(model="tiny", prompt=text)) == \
           (200, {"count": len(ids), "max_model_len": MAX_CONTEXT, "tokens": ids, "token_strs": None})
    status, body = _post(http, "/tokenize", dict(prompt="ab", add_special_tokens=False, return_token_strs=True))
    assert (status, body["tokens"], body["token_strs"]) == (200, llm.tokenizer.encode("ab", add_bos=False), ["a", "b"])
    assert _post(http, "/detokenize", dict(model="tiny", tokens=ids)) == (200, {"prompt": text})
    assert _post(http, "/detokenize", dict(tokens=[])) == (200, {"prompt": ""})
    # Chat messages: the ids /v1/chat/completions feeds the model (its usage.prompt_tokens).
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    status, body = _post(http, "/tokenize", dict(messages=messages))
    assert status == 200 and body["tokens"] == llm.tokenizer.encode(chat_prompt(llm.tokenizer, messages))
    status, chat = _post(http, "/v1/chat/completions", dict(model="tiny", messages=messages, max_tokens=1))
    assert status == 200 and chat["usage"]["prompt_tokens"] == body["count"]
    status, models = _post(http, "/tokenize", dict(prompt="a"))  # and /v1/models states the same limit
    with urllib.request.urlopen(urllib.request.Request(http.url + "/models",
                                                       headers={"Authorization": f"Bearer {KEY}"})) as r:
        assert json.loads(r.read())["data"][0]["max_model_len"] == models["max_model_len"] == MAX_CONTEXT


def test_tokenize_is_capped_checked_authorized_and_counted(servers, stub):
    http = servers[3]
    before = _metrics(servers)
    long_text = "x" * (3 << 20)  # 3 MB of text: 3M ids uncapped
    _error(_post(http, "/tokenize", dict(prompt=long_text)), 400,
           f"prompt has {(3 << 20) + 1} tokens, more than the context limit {MAX_CONTEXT} allows (at most "
           f"{MAX_CONTEXT})", "prompt")
    _error(_post(http, "/detokenize", dict(tokens=[5] * (MAX_CONTEXT + 1))), 400,
           f"tokens has {MAX_CONTEXT + 1} tokens, more than the context limit {MAX_CONTEXT} allows", "tokens")
    _error(_post(http, "/detokenize", dict(tokens=[5, 300])), 400,
           "tokens[1]: token id 300 is outside the vocabulary [0, 259)", "tokens")
    _error(_post(http, "/detokenize", dict(tokens=[1.5])), 400, "tokens[0]: input should be a valid integer", "tokens[0]")
    _error(_post(http, "/tokenize", dict(prompt="a"), key=None), 401, "missing API key")
    _error(_post(http, "/tokenize", dict(model="gpt-4", prompt="a")), 404, "the model 'gpt-4' does not exist", "model")
    _error(_post(http, "/tokenize", dict(messages=[{"role": "user", "content": "a"}], add_special_tokens=True)), 400,
           "add_special_tokens: true is not supported with messages", "add_special_tokens")
    after = _metrics(servers)
    counted = {k: after[k] - before.get(k, 0) for k in after
               if k.startswith("jaxllm_http_tokenizer_requests_total") and after[k] != before.get(k, 0)}
    assert counted == {'jaxllm_http_tokenizer_requests_total{route="tokenize",code="400"}': 2,
                       'jaxllm_http_tokenizer_requests_total{route="detokenize",code="400"}': 3,
                       'jaxllm_http_tokenizer_requests_total{route="tokenize",code="401"}': 1,
                       'jaxllm_http_tokenizer_requests_total{route="tokenize",code="404"}': 1}
    # gRPC's Tokenize has the same cap.
    err = _rpc_error(lambda: stub.Tokenize(pb.TokenizeRequest(text="x" * 100), timeout=30, metadata=AUTH))
    assert err.code() == INVALID and f"text has 101 tokens, more than the context limit {MAX_CONTEXT}" in err.details()
