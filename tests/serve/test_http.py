"""The OpenAI-compatible HTTP API: the real server in a subprocess, driven by the official `openai` client.

One server (tiny model, gRPC and HTTP on the same engine, an API key from $JAXLLM_API_KEY for both) serves
the module; outputs are compared with an in-process `LLM` and with the gRPC side. Queue-full and
SIGTERM are in test_http_drain.py (a server of their own).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import http.client
import json
import re
import subprocess
import sys
import time

import numpy as np
import openai
import pytest

from jaxllm import LLM, EngineOptions
from serve import jaxllm_pb2 as pb
from serve.http import HttpConfig
from serve.http.logprobs import top_by_text
from serve.metrics import parse
from tests.serve.test_server import ROOT, ServerProcess, _env

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("http")]

MAX_CONTEXT = 512  # prompts up to the limit are prefilled in 4 chunks
STEP_TOKENS = 128
MAX_RUNNING = 16  # few batch buckets to warm up; 64 concurrent streams then queue, as under real load
MAX_LOGPROBS = 3  # the server's --max-logprobs
KEY = "test-key-123"


class HttpServerProcess(ServerProcess):
    """ServerProcess with --http-port 0: `url` is the API's base URL."""

    def __init__(self, tmp_path, *args: str):
        super().__init__(tmp_path, "--http-port", "0", *args)
        if "--http-only" in args:  # the first "listening on" line (read by ServerProcess) was HTTP's
            self.http_port = self.port
        else:
            line = self.wait_line(r"HTTP listening on ", 60)
            self.http_port = int(re.search(r"http://127\.0\.0\.1:(\d+)/v1", line).group(1))
        self.url = f"http://127.0.0.1:{self.http_port}/v1"

    def get(self, path: str) -> tuple[int, dict | str]:
        conn = http.client.HTTPConnection("127.0.0.1", self.http_port, timeout=10)
        try:
            conn.request("GET", path)
            response = conn.getresponse()
            body = response.read().decode()
            is_json = response.headers.get("content-type", "").startswith("application/json")
            return response.status, json.loads(body) if is_json else body
        finally:
            conn.close()

    def post(self, path: str, body: bytes, headers: dict) -> tuple[int, dict]:
        conn = http.client.HTTPConnection("127.0.0.1", self.http_port, timeout=30)
        try:
            conn.request("POST", path, body=body, headers=headers)
            response = conn.getresponse()
            return response.status, json.loads(response.read())
        finally:
            conn.close()

    def metrics(self) -> dict[str, float]:
        status, text = self.get("/metrics")
        assert status == 200
        return parse(text)


def _wait_metric(server, name, predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while True:
        value = server.metrics()[name]
        if predicate(value) or time.monotonic() > deadline:
            return value
        time.sleep(0.02)


@pytest.fixture(scope="module")
def launched(tmp_path_factory, monkeypatch_module):
    monkeypatch_module.setenv("JAXLLM_API_KEY", KEY)  # the server reads it; _env() copies os.environ
    s = HttpServerProcess(tmp_path_factory.mktemp("http"), "--max-context", str(MAX_CONTEXT),
                          "--max-tokens-per-step", str(STEP_TOKENS), "--max-running", str(MAX_RUNNING),
                          "--max-queue", "128", "--max-logprobs", str(MAX_LOGPROBS))

    def poll_health():
        seen = []
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            status = s.get("/health")[0]
            if not seen or seen[-1] != status:
                seen.append(status)
            if status == 200:
                return seen
            time.sleep(0.05)
        raise AssertionError(f"/health not 200 after 180 s; stderr:\n{s.log()}")

    with concurrent.futures.ThreadPoolExecutor(1) as poller:
        s.health_seen = poller.submit(poll_health)  # from the first moment, to see the 503
        yield s
    s.close()


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


@pytest.fixture(scope="module")
def llm(launched):  # built while the server loads and warms up
    options = EngineOptions(max_tokens_per_step=STEP_TOKENS, max_seqs=MAX_RUNNING, max_logprobs=MAX_LOGPROBS)
    return LLM("tiny", max_context=MAX_CONTEXT, options=options, progress=False)


@pytest.fixture(scope="module")
def server(launched, llm):
    launched.health_seen = launched.health_seen.result(timeout=200)
    return launched


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key=KEY, max_retries=0, timeout=60)


# ----- readiness, discovery, metrics -----

def test_health_503_until_warm_then_models(server, client):
    assert server.health_seen[0] == 503 and server.health_seen[-1] == 200
    assert [m.id for m in client.models.list().data] == ["tiny"]
    m = server.metrics()  # the gRPC side's registry: engine series and HTTP series together
    assert m["jaxllm_ready"] == 1 and "jaxllm_kv_pool_usage_ratio" in m


# ----- the same tokens through HTTP, gRPC and LLM.generate -----

def test_greedy_completion_equals_grpc_and_generate(server, client, llm):
    prompt = "The quick brown fox"
    ref = llm.generate([prompt], max_new_tokens=24)[0]
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0)
    grpc_msgs = list(server.stub.Generate(pb.GenerateRequest(prompt=prompt, max_tokens=24), timeout=60,
                                          metadata=(("authorization", f"Bearer {KEY}"),)))  # --api-key: gRPC too
    assert [t for m in grpc_msgs for t in m.token_ids] == ref.token_ids
    assert out.choices[0].text == "".join(m.text for m in grpc_msgs) == ref.text
    assert out.choices[0].finish_reason == ref.finish_reason
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(llm.tokenizer.encode(prompt)),
                                                                      len(ref.token_ids))
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    # A token-id prompt (OpenAI's list of ints) is used as it is: the same ids give the same tokens.
    by_ids = client.completions.create(model="tiny", prompt=llm.tokenizer.encode(prompt), max_tokens=24,
                                       temperature=0)
    assert by_ids.choices[0].text == ref.text


@pytest.mark.parametrize("include_usage", [True, False])
def test_seeded_stream_equals_generate(client, llm, include_usage):
    prompt = "日本語 and émoji 🙂"
    ref = llm.generate([prompt], max_new_tokens=20, temperature=0.9, top_k=50, top_p=0.9, seed=1234)[0]
    chunks = list(client.completions.create(
        model="tiny", prompt=prompt, max_tokens=20, temperature=0.9, top_p=0.9, seed=1234, stream=True,
        extra_body={"top_k": 50}, stream_options={"include_usage": True} if include_usage else None))
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == ref.text
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == ref.finish_reason
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    if include_usage:  # a last chunk with no choices carries the counts
        assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == len(ref.token_ids)
        assert chunks[-1].usage.prompt_tokens == len(llm.tokenizer.encode(prompt))
    else:
        assert chunks[-1].choices and all(getattr(c, "usage", None) is None for c in chunks)


def test_continuous_usage_stats_counts_every_token(client, llm):
    """vLLM's stream_options.continuous_usage_stats: usage in every chunk, growing by the tokens each chunk
    brings, even when they decode to no text (what the HTTP load test times)."""
    ref = llm.generate(["a"], max_new_tokens=12, ignore_eos=True)[0]
    chunks = list(client.completions.create(
        model="tiny", prompt="a", max_tokens=12, temperature=0, stream=True, extra_body={"ignore_eos": True},
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    counts = [c.usage.completion_tokens for c in chunks if c.choices]
    assert counts == sorted(counts) and counts[0] >= 1 and counts[-1] == len(ref.token_ids) == 12
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == 12


def test_n_choices_prompt_list_and_seed(client, llm):
    prompts = ["first prompt", "second"]
    out = client.completions.create(model="tiny", prompt=prompts, n=2, max_tokens=10, temperature=1.0, seed=77)
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
    texts = {c.index: c.text for c in out.choices}
    # Choice j of a prompt samples with seed + j: each is reproducible alone, and they differ.
    refs = {p * 2 + j: llm.generate([prompt], max_new_tokens=10, temperature=1.0, seed=77 + j)[0]
            for p, prompt in enumerate(prompts) for j in range(2)}
    assert texts == {i: ref.text for i, ref in refs.items()}
    assert texts[0] != texts[1]
    assert out.usage.prompt_tokens == sum(len(llm.tokenizer.encode(p)) for p in prompts)  # once per prompt
    assert out.usage.completion_tokens == sum(len(ref.token_ids) for ref in refs.values())


def test_n_at_its_maximum_is_accepted(client):
    """n equal to the server's max_n (HttpConfig's default: the server sets no other) gives that many choices,
    for completions (one prompt and two), chat, and streams; one more is refused (ERRORS below)."""
    max_n = HttpConfig().max_n
    out = client.completions.create(model="tiny", prompt="a", n=max_n, max_tokens=2, temperature=1.0, seed=3)
    assert sorted(c.index for c in out.choices) == list(range(max_n))
    out = client.completions.create(model="tiny", prompt=["a", "b"], n=max_n, max_tokens=1, seed=3)
    assert sorted(c.index for c in out.choices) == list(range(2 * max_n))
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "a"}], n=max_n,
                                          max_tokens=2, seed=3)
    assert sorted(c.index for c in chat.choices) == list(range(max_n))
    chunks = list(client.completions.create(model="tiny", prompt="a", n=max_n, max_tokens=2, seed=3, stream=True))
    finished = [c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason is not None]
    assert sorted(finished) == list(range(max_n))


def test_a_prompt_of_exactly_the_allowance_is_served_one_more_refused(client, llm):
    """Property, for a random id prompt and a text prompt: a prompt of context_limit - 1 tokens (the engine's
    limit, as the same LLM in-process has it; /v1/models states it) completes, streamed or not, with the default
    max_tokens (the room: one token), the same token as LLM.generate; one token more is a 400 naming the limit."""
    limit = llm.context_limit
    rng = np.random.default_rng(14)
    prompts = [rng.integers(3, 259, size=limit - 1).tolist(), "x" * (limit - 2)]  # text: + BOS
    for prompt in prompts:
        ref = llm.generate([prompt], max_new_tokens=1)[0]
        out = client.completions.create(model="tiny", prompt=prompt, temperature=0)
        assert (out.choices[0].text, out.choices[0].finish_reason) == (ref.text, ref.finish_reason)
        assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (limit - 1, len(ref.token_ids))
        chunks = list(client.completions.create(model="tiny", prompt=prompt, temperature=0, stream=True))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text
        longer = prompt + [7] if isinstance(prompt, list) else prompt + "x"
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model="tiny", prompt=longer, temperature=0)
        assert f"has {limit} tokens, more than the context limit {limit} allows" in err.value.message
        assert err.value.body["param"] == "prompt"
    assert client.models.list().data[0].max_model_len == limit


def test_stop_and_echo(client, llm):
    base = llm.generate(["stop here"], max_new_tokens=16)[0]
    stop = base.text[3:5]
    assert stop
    ref = llm.generate(["stop here"], max_new_tokens=16, stop=[stop])[0]
    out = client.completions.create(model="tiny", prompt="stop here", max_tokens=16, temperature=0,
                                    stop=[stop, "never matches"])
    assert (out.choices[0].text, out.choices[0].finish_reason) == (ref.text, "stop")
    echoed = client.completions.create(model="tiny", prompt="stop here", max_tokens=16, temperature=0, stop=stop,
                                       echo=True)
    assert echoed.choices[0].text == "stop here" + ref.text


def test_chat_completion_and_stream(client, llm):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    ref = llm.chat(messages, max_new_tokens=12, temperature=0)  # the same template function as the server's
    out = client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=12, temperature=0)
    assert out.object == "chat.completion" and out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == ref.text and out.usage.completion_tokens == len(ref.token_ids)
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason == ref.finish_reason


# ----- log-probabilities -----

def _close(got: list[float], want: list[float]) -> bool:
    # The server's batch shapes may round the matmuls differently from the in-process engine's.
    return len(got) == len(want) and all(abs(g - w) < 1e-4 for g, w in zip(got, want))


def test_completion_logprobs_agree_with_the_engine(client, llm):
    prompt = "The quick brown fox"
    ref = llm.generate([prompt], max_new_tokens=8, logprobs=3, ignore_eos=True)[0]
    text = lambda t: llm.tokenizer.decode([t])  # noqa: E731
    kwargs = dict(model="tiny", prompt=prompt, max_tokens=8, temperature=0, logprobs=3, extra_body={"ignore_eos": True})
    lp = client.completions.create(**kwargs).choices[0].logprobs
    assert lp.tokens == [text(t) for t in ref.token_ids]
    assert _close(lp.token_logprobs, [v for v, _ in ref.logprobs])
    for got, (_, top) in zip(lp.top_logprobs, ref.logprobs):
        want = top_by_text(top, text)  # the legacy dict keeps one entry per distinct text
        assert list(got) == list(want) and _close(list(got.values()), list(want.values()))
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    chunks = list(client.completions.create(**kwargs, stream=True))
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert [t for s in streamed for t in s.tokens] == lp.tokens
    assert _close([v for s in streamed for v in s.token_logprobs], lp.token_logprobs)
    assert [o for s in streamed for o in s.text_offset] == lp.text_offset
    assert [list(d) for s in streamed for d in s.top_logprobs] == [list(d) for d in lp.top_logprobs]
    plain = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None


def test_echo_with_logprobs_scores_the_prompt_as_the_engine_does(client, llm):
    """lm-eval's loglikelihood request: a token-id prompt, echo, logprobs 1, max_tokens 1 (and 0): the prompt's
    tokens lead the choice's logprobs, the first with null logprob and top_logprobs, the rest as the engine's
    prompt_logprobs give them (= the teacher-forced logits); streamed, the same entries; vLLM's prompt_logprobs
    extra gives them per token id."""
    ids = llm.tokenizer.encode("The quick brown fox jumps")
    ref = llm.generate([ids], max_new_tokens=1, prompt_logprobs=1, logprobs=1)[0]
    text = lambda t: llm.tokenizer.decode([t])  # noqa: E731
    want = [None] + [v for v, _ in ref.prompt_logprobs[1:]]
    for max_tokens in (1, 0):
        kwargs = dict(model="tiny", prompt=ids, max_tokens=max_tokens, temperature=0, echo=True, logprobs=1)
        choice = client.completions.create(**kwargs).choices[0]
        lp = choice.logprobs
        n = len(ids)
        assert choice.text.startswith(llm.tokenizer.decode(ids))
        assert lp.tokens[:n] == [text(t) for t in ids] and len(lp.tokens) == n + max_tokens
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert _close(lp.token_logprobs[1:n], want[1:])
        assert [list(d) for d in lp.top_logprobs[1:n]] == [[text(top[0][0])] for _, top in ref.prompt_logprobs[1:]]
        assert lp.text_offset[:n] == [sum(len(text(t)) for t in ids[:i]) for i in range(n)]
        if max_tokens:
            assert lp.tokens[n:] == [text(t) for t in ref.token_ids] and _close(lp.token_logprobs[n:], [ref.logprobs[0][0]])
        chunks = list(client.completions.create(**kwargs, stream=True))
        streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
        assert [t for s in streamed for t in s.tokens] == lp.tokens
        values = [v for s in streamed for v in s.token_logprobs]
        assert values[0] is None and _close(values[1:], lp.token_logprobs[1:])
    extra = client.completions.create(model="tiny", prompt=ids, max_tokens=1, temperature=0,
                                      extra_body={"prompt_logprobs": 2}).choices[0]
    scored = extra.model_extra["prompt_logprobs"]
    assert scored[0] is None and len(scored) == len(ids)
    for token, entry, (logprob, top) in zip(ids[1:], scored[1:], ref.prompt_logprobs[1:]):
        assert abs(entry[str(token)]["logprob"] - logprob) < 1e-4 and entry[str(token)]["decoded_token"] == text(token)
        assert {int(t) for t in entry} >= {top[0][0], token}
        assert entry[str(top[0][0])]["rank"] == 1  # vLLM's ranks count from 1
        assert sorted(v["rank"] for v in entry.values() if v["rank"] is not None) == [1, 2]  # the 2 most likely


def test_chat_logprobs_agree_with_the_engine(client, llm):
    messages = [{"role": "user", "content": "Hello there"}]
    ref = llm.chat(messages, max_new_tokens=6, temperature=0, logprobs=2, ignore_eos=True)
    text = lambda t: llm.tokenizer.decode([t])  # noqa: E731
    kwargs = dict(model="tiny", messages=messages, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2,
                  extra_body={"ignore_eos": True})
    content = client.chat.completions.create(**kwargs).choices[0].logprobs.content
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    streamed = [item for c in chunks if c.choices and c.choices[0].logprobs for item in c.choices[0].logprobs.content]
    for items in (content, streamed):
        assert [i.token for i in items] == [text(t) for t in ref.token_ids]
        assert _close([i.logprob for i in items], [v for v, _ in ref.logprobs])
        for item, (_, top) in zip(items, ref.logprobs):
            assert item.bytes == list(item.token.encode())
            assert [t.token for t in item.top_logprobs] == [text(i) for i, _ in top]
            assert _close([t.logprob for t in item.top_logprobs], [v for _, v in top])
    # logprobs without top_logprobs: each token's own logprob, no alternatives.
    bare = client.chat.completions.create(**{**kwargs, "top_logprobs": None}).choices[0].logprobs.content
    assert [i.top_logprobs for i in bare] == [[]] * len(ref.token_ids)
    assert _close([i.logprob for i in bare], [v for v, _ in ref.logprobs])


# ----- errors, as the client raises them and on the wire -----

ERRORS = [
    (dict(prompt="a", top_p=1.5), openai.BadRequestError, "top_p must be in (0, 1], got 1.5", "top_p"),
    (dict(prompt="a", max_tokens=MAX_CONTEXT - 1), openai.BadRequestError,
     f"max_tokens {MAX_CONTEXT - 1} is over the limit {MAX_CONTEXT - 2}", "max_tokens"),
    (dict(prompt="x" * (MAX_CONTEXT + 76)), openai.BadRequestError,
     f"prompt has {MAX_CONTEXT + 77} tokens, more than the context limit {MAX_CONTEXT} allows", "prompt"),
    (dict(prompt="a", stop=["s"] * 17), openai.BadRequestError, "stop has 17 strings, over the limit 16", "stop"),
    (dict(prompt="a", seed=2**31), openai.BadRequestError, "seed must be in [0, 2**31)", "seed"),
    (dict(prompt="a", temperature=-1), openai.BadRequestError, "temperature must be a finite number >= 0",
     "temperature"),
    (dict(prompt="a", n=17), openai.BadRequestError, "n must be in [1, 16], got 17", "n"),
    (dict(prompt="a", logprobs=MAX_LOGPROBS + 1), openai.BadRequestError,
     f"logprobs {MAX_LOGPROBS + 1} is over the limit {MAX_LOGPROBS}", "logprobs"),
    (dict(prompt="a", logprobs=1, echo=True, extra_body={"prompt_logprobs": MAX_LOGPROBS + 1}),
     openai.BadRequestError, f"prompt_logprobs {MAX_LOGPROBS + 1} is over the limit {MAX_LOGPROBS}", "prompt_logprobs"),
    (dict(prompt="a", model="gpt-4"), openai.NotFoundError, "the model 'gpt-4' does not exist", "model"),
]


@pytest.mark.parametrize("fields, error, message, param", ERRORS, ids=[e[2][:20] for e in ERRORS])
def test_errors_as_the_client_raises_them(client, fields, error, message, param):
    with pytest.raises(error) as err:
        client.completions.create(**{"model": "tiny", **fields})
    assert message in err.value.message and err.value.body["param"] == param


def test_chat_errors_and_auth(server, client):
    with pytest.raises(openai.BadRequestError, match="user and assistant turns alternating"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "a"},
                                                               {"role": "user", "content": "b"}])
    with pytest.raises(openai.BadRequestError, match=f"top_logprobs {MAX_LOGPROBS + 1} is over the limit "
                                                     f"{MAX_LOGPROBS}") as err:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "a"}], logprobs=True,
                                       top_logprobs=MAX_LOGPROBS + 1)
    assert err.value.body["param"] == "top_logprobs"
    with pytest.raises(openai.BadRequestError, match="top_logprobs needs logprobs: true"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "a"}], top_logprobs=1)
    wrong = openai.OpenAI(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError, match="incorrect API key"):
        wrong.completions.create(model="tiny", prompt="a", max_tokens=1)


def test_raw_http_errors(server):
    auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    good = json.dumps({"model": "tiny", "prompt": "a", "max_tokens": 1}).encode()
    cases = [
        (b'{"model": "tiny", "prompt": ', auth, 400, "not valid JSON"),
        (b'[1, 2]', auth, 400, "must be a JSON object"),
        (json.dumps({"model": "tiny", "prompt": "a", "temperature": "hot"}).encode(), auth, 400,
         "temperature: input should be a valid number"),
        (good, {**auth, "Content-Type": "text/plain"}, 415, "Content-Type must be application/json"),
        (json.dumps({"model": "tiny", "prompt": "x" * (5 << 20)}).encode(), auth, 413, "over the limit of 4194304"),
        (good, {"Content-Type": "application/json"}, 401, "missing API key"),
    ]
    for body, headers, status, message in cases:
        got, answer = server.post("/v1/completions", body, headers)
        assert got == status and message in answer["error"]["message"], (status, answer)
        assert set(answer["error"]) == {"message", "type", "param", "code"}
    assert server.post("/v1/completions", good, auth)[0] == 200  # none of it hurt the server
    assert server.get("/v1/nothing")[0] == 404


# ----- load and cancellation -----

def test_64_concurrent_streams_all_complete(server, llm):
    prompts = [f"request {i}: " + "abcdefghijk"[:i % 11] * (1 + i % 3) for i in range(64)]
    client = openai.AsyncOpenAI(base_url=server.url, api_key=KEY, max_retries=0, timeout=120)

    async def one(prompt):
        stream = await client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0.8,
                                                 top_p=0.95, seed=7, stream=True)
        pieces, finish = [], None
        async for chunk in stream:
            pieces.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
        return "".join(pieces), finish

    async def all_of_them():
        try:
            return await asyncio.gather(*(one(p) for p in prompts))
        finally:
            await client.close()

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        results = pool.submit(asyncio.run, all_of_them())
        refs = llm.generate(prompts, max_new_tokens=12, temperature=0.8, top_p=0.95, seed=7)  # meanwhile
        results = results.result(timeout=180)
    for i, ((text, finish), ref) in enumerate(zip(results, refs)):
        assert (text, finish) == (ref.text, ref.finish_reason), f"stream {i} differs from LLM.generate"


LONG = MAX_CONTEXT - 32  # tokens of a request that runs for seconds: cancelled well before its end


def test_closed_streams_return_the_pool_to_zero(server, client):
    before = server.metrics()
    streams = [client.completions.create(model="tiny", prompt=f"cancel me {i}", max_tokens=LONG, temperature=0.5,
                                         seed=i, stream=True, extra_body={"ignore_eos": True}) for i in range(4)]
    for s in streams:
        assert next(iter(s)).choices  # running, holding rBlocks
    assert server.metrics()["jaxllm_kv_pool_usage_ratio"] > 0
    # A non-streamed request whose client goes away is cancelled too (the server polls for it).
    gone = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=30)
    gone.request("POST", "/v1/completions", headers={"Authorization": f"Bearer {KEY}",
                                                     "Content-Type": "application/json"},
                 body=json.dumps({"model": "tiny", "prompt": "never read", "max_tokens": LONG, "ignore_eos": True}))
    assert _wait_metric(server, "jaxllm_http_active_requests", lambda v: v == 5) == 5
    gone.close()
    for s in streams:
        s.close()  # the connection goes; the server cancels the request
    # Each cancellation lands when the engine thread next runs: the request the server polls for may still be
    # queued (holding no rBlock) when the streams' are done, so the pool can read 0 before the fifth is counted.
    cancelled = "jaxllm_engine_requests_cancelled_total"
    assert _wait_metric(server, cancelled, lambda v: v - before[cancelled] >= 5) - before[cancelled] == 5
    assert _wait_metric(server, "jaxllm_kv_pool_usage_ratio", lambda v: v == 0) == 0
    assert _wait_metric(server, "jaxllm_http_active_requests", lambda v: v == 0) == 0
    closed = 'jaxllm_http_requests_total{code="499"}'
    assert server.metrics()[closed] - before.get(closed, 0) == 5


def test_load_script_reports(server, tmp_path):
    out = tmp_path / "load.json"
    run = subprocess.run([sys.executable, "-m", "scripts.load_test_http", "--url", server.url, "--api-key", KEY,
                          "--requests", "8", "--concurrency", "4", "--prompt-tokens", "20", "--max-tokens", "8",
                          "--json", str(out), "--metrics-url", f"http://127.0.0.1:{server.http_port}/metrics"],
                         cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads(out.read_text())
    assert report["ok"] == 8 and report["requests_per_s"] > 0 and report["compiles_during_run"] == 0
    assert 0 < report["ttft_s"]["p50"] <= report["ttft_s"]["p99"] and report["tpot_s"]["p90"] > 0
    assert "TTFT" in run.stdout and "req/s" in run.stdout
