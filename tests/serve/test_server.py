"""The real server in a subprocess, called through a real gRPC client.

One server (tiny model, max_context 512, 128-token steps: few shapes to compile) serves the module;
the SIGTERM test starts its own.
Outputs are compared with an in-process `LLM` on the same backend: the engine makes a request's
tokens independent of what else is in its batch, so crowded server batches must match exactly.
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import grpc
import jax
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from google.protobuf.descriptor_pool import DescriptorPool

from jaxllm import LLM, EngineOptions
from serve import jaxllm_pb2 as pb
from serve import jaxllm_pb2_grpc as pb_grpc
from serve.metrics import parse

# One module server is the expensive part: keep this module on one xdist worker (with --dist loadgroup).
pytestmark = pytest.mark.xdist_group("serve")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MAX_CONTEXT = 512  # prompts up to the limit are prefilled in 4 chunks
STEP_TOKENS = 128  # prompts over this are prefilled in chunks
MAX_RUNNING = 16  # few batch buckets to warm up; the 64 concurrent streams then queue, as under real load
SERVICE = "jaxllm.v1.LLMService"
INVALID, EXHAUSTED, UNAVAILABLE = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
                                   grpc.StatusCode.UNAVAILABLE)


def _env() -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               PYTHONIOENCODING="utf-8", XLA_PYTHON_CLIENT_PREALLOCATE="false")
    env["JAX_PLATFORMS"] = jax.default_backend()  # the reference LLM below runs on the same backend
    return env


class ServerProcess:
    """`python -m jaxllm.serve --port 0 ...` with its stdout lines in a queue and stderr in a file."""

    def __init__(self, tmp_path, *args: str):
        self.stderr_path = tmp_path / "server.stderr"
        self._stderr = open(self.stderr_path, "w")
        # No logprob step variants unless a test asks (args come after, and argparse keeps the last):
        # warm-up then compiles half as many functions.
        self.proc = subprocess.Popen([sys.executable, "-m", "jaxllm.serve", "--port", "0", "--max-logprobs", "0",
                                      *args], cwd=ROOT,
                                     env=_env(), stdout=subprocess.PIPE, stderr=self._stderr, text=True)
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        first = self.wait_line(r"listening on ", 60)
        self.port = int(re.search(r"127\.0\.0\.1:(\d+)", first).group(1))
        m = re.search(r"http://127\.0\.0\.1:(\d+)/metrics", first)
        self.metrics_url = f"http://127.0.0.1:{m.group(1)}/metrics" if m else None
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        self.stub = pb_grpc.LLMServiceStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    def _read(self):
        for line in self.proc.stdout:
            self.lines.put(line)

    def wait_line(self, pattern: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.1)
            except queue.Empty:
                if self.proc.poll() is not None:
                    break
                continue
            if re.search(pattern, line):
                return line
        raise AssertionError(f"server printed no line matching {pattern!r}; stderr:\n{self.log()}")

    def health_status(self, service: str = SERVICE):
        return self.health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status

    def wait_serving(self, timeout: float = 120) -> list:
        """Poll health until SERVING; returns the distinct statuses seen, in order."""
        seen = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            status = self.health_status()
            if not seen or seen[-1] != status:
                seen.append(status)
            if status == health_pb2.HealthCheckResponse.SERVING:
                return seen
            assert self.proc.poll() is None, self.log()
            time.sleep(0.05)
        raise AssertionError(f"not SERVING after {timeout} s; stderr:\n{self.log()}")

    def metrics(self) -> dict[str, float]:
        with urllib.request.urlopen(self.metrics_url, timeout=10) as response:
            assert response.headers["Content-Type"].startswith("text/plain")
            return parse(response.read().decode())

    def log(self) -> str:
        self._stderr.flush()
        return self.stderr_path.read_text()[-4000:]

    def close(self):
        self.channel.close()
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._stderr.close()


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    s = ServerProcess(tmp_path_factory.mktemp("server"), "--max-context", str(MAX_CONTEXT), "--max-tokens-per-step",
                      str(STEP_TOKENS), "--max-running", str(MAX_RUNNING), "--max-queue", "128",
                      "--grace-period", "5")
    with concurrent.futures.ThreadPoolExecutor(1) as poller:
        s.serving = poller.submit(s.wait_serving)  # from the first moment, to see NOT_SERVING
        yield s
    s.close()


@pytest.fixture(scope="module")
def llm(launched):  # built while the server loads and warms up
    options = EngineOptions(max_tokens_per_step=STEP_TOKENS)
    return LLM("tiny", max_context=MAX_CONTEXT, options=options, progress=False)


@pytest.fixture(scope="module")
def server(launched, llm):
    launched.statuses = launched.serving.result(timeout=180)
    launched.wait_line(rf"jaxllm serving tiny on 127\.0\.0\.1:{launched.port}", 30)
    return launched


def _request(prompt="", **kw) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt=prompt, **kw)


def _stream(stub, request, timeout=60):
    messages = list(stub.Generate(request, timeout=timeout))
    assert messages, "a stream always ends with a message carrying the finish reason"
    assert all(m.finish_reason == pb.FINISH_REASON_UNSPECIFIED for m in messages[:-1])
    assert messages[-1].finish_reason != pb.FINISH_REASON_UNSPECIFIED
    text = "".join(m.text for m in messages)
    ids = [t for m in messages for t in m.token_ids]
    return text, ids, messages[-1]


def _reason(completion) -> int:
    return {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH}[completion.finish_reason]


def _wait_metric(server, name, predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while True:
        value = server.metrics()[name]
        if predicate(value) or time.monotonic() > deadline:
            return value
        time.sleep(0.02)


# ----- readiness, discovery -----

def test_health_goes_not_serving_then_serving(server):
    assert server.statuses[0] == health_pb2.HealthCheckResponse.NOT_SERVING
    assert server.statuses[-1] == health_pb2.HealthCheckResponse.SERVING
    assert server.health_status("") == health_pb2.HealthCheckResponse.SERVING


def test_reflection_describes_the_service(server):
    db = ProtoReflectionDescriptorDatabase(server.channel)
    services = set(db.get_services())
    assert {SERVICE, "grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection"} <= services
    # v1 (what current grpcurl asks first) answers too, in the same wire format as v1alpha.
    from grpc_reflection.v1alpha import reflection_pb2 as rpb
    v1 = server.channel.stream_stream("/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
                                      request_serializer=rpb.ServerReflectionRequest.SerializeToString,
                                      response_deserializer=rpb.ServerReflectionResponse.FromString)
    reply = next(iter(v1(iter([rpb.ServerReflectionRequest(list_services="")]), timeout=10)))
    assert SERVICE in {s.name for s in reply.list_services_response.service}
    method = DescriptorPool(db).FindServiceByName(SERVICE).methods_by_name["Generate"]
    assert method.server_streaming and method.output_type.full_name == "jaxllm.v1.GenerateResponse"


def test_model_info_and_tokenize(server, llm):
    info = server.stub.ModelInfo(pb.ModelInfoRequest(), timeout=10)
    assert (info.model, info.architecture, info.vocab_size, info.max_context) == ("tiny", "tiny", 259, MAX_CONTEXT)
    assert info.num_layers == llm.config.num_layers and info.kv_num_blocks > 0 and info.backend
    assert (info.dtype, info.kv_dtype) == ("float32", "float32")
    text = "Tokenize me: ünïcode ✓"
    tokenized = server.stub.Tokenize(pb.TokenizeRequest(text=text), timeout=10)
    assert list(tokenized.token_ids) == llm.tokenizer.encode(text)


# ----- correctness -----

@pytest.mark.parametrize("prompt, kwargs", [
    ("The quick brown fox", dict(max_new_tokens=24)),
    ("日本語 and émoji 🙂", dict(max_new_tokens=20, temperature=0.9, top_k=50, top_p=0.9, seed=1234)),
    ("x" * 300, dict(max_new_tokens=20, temperature=0.7, seed=5)),  # prefilled in three chunks
], ids=["greedy", "seeded", "long-prompt"])
def test_stream_equals_generate(server, llm, prompt, kwargs):
    request = _request(prompt, max_tokens=kwargs["max_new_tokens"], temperature=kwargs.get("temperature", 0.0),
                       top_k=kwargs.get("top_k", 0), seed=kwargs.get("seed", 0))
    if "top_p" in kwargs:
        request.top_p = kwargs["top_p"]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        streamed = pool.submit(_stream, server.stub, request)
        ref = llm.generate([prompt], **kwargs)[0]  # meanwhile
        text, ids, last = streamed.result()
    assert ids == ref.token_ids and text == ref.text and last.finish_reason == _reason(ref)
    assert last.usage.prompt_tokens == len(llm.tokenizer.encode(prompt))
    assert last.usage.completion_tokens == len(ref.token_ids)
    # The same request as token ids streams the same tokens.
    request.prompt, request.prompt_token_ids[:] = "", llm.tokenizer.encode(prompt)
    assert _stream(server.stub, request)[1] == ref.token_ids


def test_stop_string_matches_generate(server, llm):
    base = llm.generate(["stop here"], max_new_tokens=16)[0]
    stop = base.text[3:5]
    assert stop, "the model's output is too short to pick a stop string from"
    ref = llm.generate(["stop here"], max_new_tokens=16, stop=[stop])[0]
    text, ids, last = _stream(server.stub, _request("stop here", max_tokens=16, stop=[stop, "never matches"]))
    assert (text, ids, last.finish_reason) == (ref.text, ref.token_ids, pb.FINISH_REASON_STOP)
    assert stop not in text


def test_a_prompt_of_exactly_the_allowance_is_served_one_more_refused(server, llm):
    """Property, for a random id prompt and a text prompt: a prompt of context_limit - 1 tokens (the engine's
    limit, as the same LLM in-process has it; ModelInfo states it) streams to a final message with the default
    max_tokens (the room: one token), the same token as LLM.generate; one token more is INVALID_ARGUMENT naming
    the limit."""
    limit = llm.context_limit
    rng = np.random.default_rng(13)
    prompts = [rng.integers(3, 259, size=limit - 1).tolist(), "x" * (limit - 2)]  # text: + BOS
    for prompt in prompts:
        by_ids = not isinstance(prompt, str)
        request = pb.GenerateRequest(prompt_token_ids=prompt) if by_ids else _request(prompt)
        text, ids, last = _stream(server.stub, request)
        ref = llm.generate([prompt], max_new_tokens=1)[0]
        assert (ids, last.usage.prompt_tokens, last.finish_reason) == (ref.token_ids, limit - 1, _reason(ref))
        longer = pb.GenerateRequest(prompt_token_ids=prompt + [7]) if by_ids else _request(prompt + "x")
        with pytest.raises(grpc.RpcError) as err:
            list(server.stub.Generate(longer, timeout=10))
        assert err.value.code() == INVALID, err.value.details()
        assert f"has {limit} tokens, more than the context limit {limit} allows" in err.value.details()
    assert server.stub.ModelInfo(pb.ModelInfoRequest(), timeout=10).max_context == limit


def test_64_concurrent_streams_are_correct_and_independent(server, llm):
    prompts = [f"request {i}: " + "abcdefghijk"[:i % 11] * (1 + i % 3) for i in range(64)]
    kwargs = dict(max_new_tokens=12, temperature=0.8, top_p=0.95, seed=7)
    start = threading.Barrier(64)

    def call(prompt):
        start.wait(timeout=60)
        return _stream(server.stub, _request(prompt, max_tokens=12, temperature=0.8, top_p=0.95, seed=7), timeout=120)

    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        futures = [pool.submit(call, p) for p in prompts]
        refs = llm.generate(prompts, **kwargs)  # meanwhile, all 64 in one batched call
        results = [f.result() for f in futures]
    for i, ((text, ids, last), ref) in enumerate(zip(results, refs)):
        assert ids == ref.token_ids, f"stream {i} differs from LLM.generate"
        assert text == ref.text and last.finish_reason == _reason(ref)
    assert len({tuple(ids) for _, ids, _ in results}) > 48  # different prompts, different outputs


# ----- cancellation frees memory -----

def test_cancel_and_deadline_free_the_pool_at_once(server):
    before = server.metrics()
    long = dict(max_tokens=MAX_CONTEXT - 32, ignore_eos=True)  # seconds of decoding: cancelled well before the end
    calls = [server.stub.Generate(_request(f"cancel me {i}", temperature=0.5, seed=i, **long), timeout=60)
             for i in range(4)]
    for call in calls:
        assert next(call).token_ids  # running, holding rBlocks
    assert server.metrics()["jaxllm_kv_pool_usage_ratio"] > 0
    for call in calls:
        call.cancel()
    expired = server.stub.Generate(_request("deadline", **long), timeout=0.5)
    with pytest.raises(grpc.RpcError) as err:
        for _ in expired:
            pass
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert _wait_metric(server, "jaxllm_kv_pool_usage_ratio", lambda v: v == 0) == 0
    after = server.metrics()
    # All five were cancelled, not run to their end (480 tokens each): the engine counted them. A
    # cancel takes effect at the next step boundary, so the pool empties as soon as the step in
    # progress (possibly a compile) is done.
    assert after["jaxllm_engine_requests_cancelled_total"] - before["jaxllm_engine_requests_cancelled_total"] == 5
    assert _wait_metric(server, "jaxllm_active_streams", lambda v: v == 0) == 0
    after = server.metrics()  # the servicer records a call's status when its handler ends
    keys = {code: f'jaxllm_requests_total{{code="{code}"}}' for code in ("CANCELLED", "DEADLINE_EXCEEDED")}
    ended = {code: after.get(key, 0) - before.get(key, 0) for code, key in keys.items()}
    # The client may give up at its deadline and reset the stream a moment before the server's own
    # copy of the deadline (set on arrival) passes; the server then sees a cancel.
    assert ended["CANCELLED"] + ended["DEADLINE_EXCEEDED"] == 5 and ended["DEADLINE_EXCEEDED"] <= 1


# ----- bad input -----

BAD = [
    (dict(prompt=""), "prompt is empty"),
    (dict(prompt="x" * (MAX_CONTEXT + 76)), f"prompt has {MAX_CONTEXT + 77} tokens, more than the context limit "
                                            f"{MAX_CONTEXT} allows"),
    (dict(prompt="x" * (MAX_CONTEXT - 1)), f"at most {MAX_CONTEXT - 1}"),  # the limit's tokens with BOS: no room
    (dict(prompt="a", prompt_token_ids=[1, 70]), "both set"),
    (dict(prompt_token_ids=[1, 259]), "prompt_token_ids[1]: token id 259 is outside the vocabulary [0, 259)"),
    (dict(prompt="a", max_tokens=0), "max_tokens must be >= 1, got 0"),
    (dict(prompt="a", max_tokens=-3), "max_tokens must be >= 1, got -3"),
    (dict(prompt="a", max_tokens=MAX_CONTEXT - 1), f"max_tokens {MAX_CONTEXT - 1} is over the limit {MAX_CONTEXT - 2}"),
    (dict(prompt="a", temperature=-0.5), "temperature must be a finite number >= 0"),
    (dict(prompt="a", temperature=math.inf), "temperature must be a finite number >= 0"),
    (dict(prompt="a", temperature=math.nan), "temperature must be a finite number >= 0"),
    (dict(prompt="a", top_p=0.0), "top_p must be in (0, 1], got 0.0"),
    (dict(prompt="a", top_p=1.5), "top_p must be in (0, 1], got 1.5"),
    (dict(prompt="a", top_k=-1), "top_k must be >= 0"),
    (dict(prompt="a", seed=-1), "seed must be in [0, 2**31)"),
    (dict(prompt="a", seed=2**31), "seed must be in [0, 2**31)"),
    (dict(prompt="a", stop=["ok", ""]), "stop[1] is empty"),
    (dict(prompt="a", stop=["s"] * 17), "stop has 17 strings, over the limit 16"),
    (dict(prompt="a", stop=["y" * 257]), "stop[0] has 257 characters, over the limit 256"),
]


@pytest.mark.parametrize("fields, message", BAD, ids=[m[:24] for _, m in BAD])
def test_bad_input_is_invalid_argument(server, fields, message):
    with pytest.raises(grpc.RpcError) as err:
        list(server.stub.Generate(pb.GenerateRequest(**fields), timeout=10))
    assert err.value.code() == INVALID, err.value.details()
    assert message in err.value.details()


def test_oversize_or_malformed_message_gets_a_status_not_a_crash(server):
    before = server.metrics().get('jaxllm_requests_total{code="RESOURCE_EXHAUSTED"}', 0)
    with pytest.raises(grpc.RpcError) as err:
        list(server.stub.Generate(_request("x" * (5 << 20)), timeout=30))
    assert err.value.code() == EXHAUSTED and "over the limit 4194304" in err.value.details()
    assert server.metrics()['jaxllm_requests_total{code="RESOURCE_EXHAUSTED"}'] == before + 1  # counted
    # Field 1 (prompt) holding bytes that are not UTF-8, which no conforming client can send.
    before = server.metrics().get('jaxllm_requests_total{code="INVALID_ARGUMENT"}', 0)
    raw = server.channel.unary_stream(f"/{SERVICE}/Generate")
    with pytest.raises(grpc.RpcError) as err:
        list(raw(b"\x0a\x02\xff\xfe", timeout=10))
    assert err.value.code() == INVALID and "prompt is not valid text" in err.value.details()
    assert server.metrics()['jaxllm_requests_total{code="INVALID_ARGUMENT"}'] == before + 1  # counted
    assert server.health_status() == health_pb2.HealthCheckResponse.SERVING
    assert _stream(server.stub, _request("still alive", max_tokens=3))[1]


# ----- metrics, client, load script -----

def test_metrics_count_a_request(server):
    before = server.metrics()
    _, ids, _ = _stream(server.stub, _request("count me", max_tokens=9, ignore_eos=True))
    after = server.metrics()
    delta = {k: after[k] - before.get(k, 0) for k in after}
    assert len(ids) == 9
    assert delta['jaxllm_requests_total{code="OK"}'] == 1
    assert delta["jaxllm_generation_tokens_total"] == 9 and delta["jaxllm_prompt_tokens_total"] == 9
    assert delta["jaxllm_time_to_first_token_seconds_count"] == 1
    assert delta["jaxllm_time_per_output_token_seconds_count"] >= 1
    assert after['jaxllm_time_to_first_token_seconds_bucket{le="+Inf"}'] == after[
        "jaxllm_time_to_first_token_seconds_count"]
    assert after["jaxllm_compiles_total"] >= 2 and after["jaxllm_ready"] == 1
    # The engine's bucket counters move with its steps (prefill and decode buckets both).
    bucket_steps = {k: v for k, v in delta.items() if k.startswith("jaxllm_bucket_steps_total{")}
    assert sum(bucket_steps.values()) >= 9 and any('kind="decode"' in k and v for k, v in bucket_steps.items())
    assert after["jaxllm_xla_compiles_total"] + after["jaxllm_persistent_cache_hits_total"] >= 2
    assert after["jaxllm_queue_depth"] == 0 and after["jaxllm_kv_pool_usage_ratio"] == 0


def test_metrics_count_prefix_cache_hits(server):
    prompt = "A system prompt long enough to fill several rBlocks of sixteen tokens each, twice over. "
    _stream(server.stub, _request(prompt + "First question?", max_tokens=2))
    before = server.metrics()
    _stream(server.stub, _request(prompt + "Second question?", max_tokens=2))
    after = server.metrics()
    # The second request shares the first's full rBlocks of the common prefix (at least 4 of 16 tokens).
    assert after["jaxllm_prefix_cache_hit_tokens_total"] - before["jaxllm_prefix_cache_hit_tokens_total"] >= 64
    assert after["jaxllm_prefix_cache_blocks"] >= 4


def test_client_cli_streams_the_completion(server, llm):
    ref = llm.generate(["The quick brown fox"], max_new_tokens=24)[0]
    out = subprocess.run([sys.executable, "-m", "serve.client", "The quick brown fox", "--port", str(server.port),
                          "--max-tokens", "24", "--usage"], cwd=ROOT, env=_env(), capture_output=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.decode("utf-8") == ref.text + "\n"
    assert "completion_tokens=24" in out.stderr.decode() or "FINISH_REASON_STOP" in out.stderr.decode()
    bad = subprocess.run([sys.executable, "-m", "serve.client", "x", "--port", str(server.port), "--top-p", "2"],
                         cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "INVALID_ARGUMENT: top_p must be in (0, 1]" in bad.stderr


def test_load_script_reports(server, tmp_path):
    out = tmp_path / "load.json"
    run = subprocess.run([sys.executable, "-m", "scripts.load_test", "--port", str(server.port), "--requests", "12",
                          "--concurrency", "6", "--prompt-tokens", "20", "--max-tokens", "8", "--json", str(out),
                          "--metrics-url", server.metrics_url], cwd=ROOT, env=_env(), capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads(out.read_text())
    assert report["ok"] == 12 and report["requests_per_s"] > 0
    assert 0 < report["ttft_s"]["p50"] <= report["ttft_s"]["p99"] and report["tpot_s"]["p90"] > 0
    assert "TTFT" in run.stdout and "req/s" in run.stdout


# ----- queue limit and shutdown (a server of their own) -----

def _collect(call, into: list, first: threading.Event, done: threading.Event):
    try:
        for m in call:
            into.append(m)
            first.set()
    except grpc.RpcError as e:
        into.append(e)
    finally:
        first.set()
        done.set()


def test_queue_full_then_sigterm_drains(tmp_path):
    grace = 4.0
    s = ServerProcess(tmp_path, "--max-context", "8192", "--allow-long-context", "--max-running", "2", "--max-queue",
                      "1", "--no-warm-up", "--grace-period", str(grace))
    try:
        s.wait_serving()
        streams = {}

        def start(name, max_tokens):
            msgs, first, done = [], threading.Event(), threading.Event()
            call = s.stub.Generate(_request(f"{name} stream", max_tokens=max_tokens, ignore_eos=True), timeout=60)
            threading.Thread(target=_collect, args=(call, msgs, first, done), daemon=True).start()
            streams[name] = (msgs, done, max_tokens, call)
            return first

        assert start("long", 8000).wait(60)  # far more than the tiny model makes in the grace period
        assert start("other", 8000).wait(60)  # both running: --max-running 2
        start("abandoned", 60)  # waits: both running slots are taken
        assert _wait_metric(s, "jaxllm_queue_depth", lambda v: v == 1) == 1
        with pytest.raises(grpc.RpcError) as err:  # the queue (1) is full: refused at once, not held
            list(s.stub.Generate(_request("one too many", max_tokens=5), timeout=10))
        assert err.value.code() == EXHAUSTED and "limit 1" in err.value.details()

        # A waiting request has no tokens to stream, so only the cancel callback can remove it.
        streams["abandoned"][3].cancel()
        assert _wait_metric(s, "jaxllm_queue_depth", lambda v: v == 0, timeout=5) == 0
        assert not streams["abandoned"][0] or isinstance(streams["abandoned"][0][-1], grpc.RpcError)
        queued_first = start("queued", 24)  # finishes within the grace period, also on a loaded 2-core machine
        assert _wait_metric(s, "jaxllm_queue_depth", lambda v: v == 1) == 1
        assert not queued_first.is_set()

        # Free a slot: the queued request starts; SIGTERM while it and "long" are in flight.
        streams["other"][3].cancel()
        assert queued_first.wait(60)
        t0 = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        while s.health_status() != health_pb2.HealthCheckResponse.NOT_SERVING:
            time.sleep(0.01)
        with pytest.raises(grpc.RpcError) as err:
            list(s.stub.Generate(_request("too late", max_tokens=5), timeout=10))
        assert err.value.code() == UNAVAILABLE
        assert s.proc.wait(timeout=grace + 15) == 0, s.log()
        elapsed = time.monotonic() - t0
        assert elapsed < grace + 3.0, f"exit took {elapsed:.1f} s with a {grace} s grace period"
        for name in ("long", "queued"):
            msgs, done, max_tokens, _ = streams[name]
            assert done.wait(5)
            assert msgs and not isinstance(msgs[-1], Exception), f"{name}: {msgs[-1:]}"
            n = sum(len(m.token_ids) for m in msgs)
            if name == "queued":  # short enough to finish within the grace period
                assert (msgs[-1].finish_reason, n) == (pb.FINISH_REASON_LENGTH, max_tokens)
            else:  # still running when the grace period ran out: cancelled, cleanly
                assert msgs[-1].finish_reason == pb.FINISH_REASON_CANCELLED and n < max_tokens
        assert "jaxllm: stopped" in s.log()
    finally:
        s.close()
