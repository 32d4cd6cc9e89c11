"""The OpenAI-compatible routes: /v1/completions, /v1/chat/completions, /v1/models, vLLM's /tokenize and
/detokenize, /health, /metrics.

    state = ApiState(config, registry, pool)   # adapter None: 503 until the model is warm
    app = build_app(state)                     # served by uvicorn (serve/http/server.py)
    state.adapter = EngineAdapter(engine, "tiny")

A generation request becomes one engine request per (prompt, choice); they are checked all
together before any is queued (a bad one costs no queue slot), then queued together, all or none
(a full queue answers 429 with none of them queued; a request of more engine requests than the queue
can ever hold answers 400 before any is checked). Streams are server-sent events in OpenAI's
chunk format ending `data: [DONE]`; a client that goes away has its engine requests cancelled.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import re
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from serve.auth import MISSING, bearer_problem
from serve.http import protocol
from serve.http.bridge import StreamGroup
from serve.http.engine_adapter import SEED_LIMIT, EngineAdapter, EngineStopped, QueueFull, Sampling, random_seed
from serve.http.logprobs import chat_logprobs, completion_logprobs, prompt_logprobs
from serve.http.protocol import APIError
from serve.http.tokenize import detokenize, tokenize
from serve.metrics import CONTENT_TYPE, Registry

_FIELD = re.compile(r"[a-z_]+")
_MAX_JSON_DEPTH = 1000  # roughly where json.loads runs out of recursion (sys.getrecursionlimit)
_DISCONNECT_POLL_S = 0.5  # how soon a non-streaming request notices its client has gone


@dataclasses.dataclass(frozen=True)
class ApiConfig:
    """What the API layer enforces itself (the engine's limits come through the adapter)."""

    api_key: str | None = None  # None: no authentication
    max_body_bytes: int = 4 << 20
    max_n: int = 16  # choices per prompt

    def __post_init__(self):
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must be non-empty when set")
        for name in ("max_body_bytes", "max_n"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")


class HttpMetrics:
    """HTTP-side series, beside the gRPC servicer's in the same registry."""

    def __init__(self, registry: Registry):
        r = registry
        self.requests = r.counter("jaxllm_http_requests_total", "OpenAI API generation requests, by HTTP status "
                                  "(499: the client went away)", ["code"])
        self.streams = r.gauge("jaxllm_http_active_requests", "OpenAI API generation requests in progress")
        self.ttft = r.histogram("jaxllm_http_time_to_first_token_seconds", "HTTP request arrival to its first token")
        self.duration = r.histogram("jaxllm_http_request_duration_seconds", "HTTP generation request, arrival to end")
        self.tokenizer_requests = r.counter("jaxllm_http_tokenizer_requests_total",
                                            "POST /tokenize and /detokenize requests, by route and HTTP status",
                                            ["route", "code"])


@dataclasses.dataclass(eq=False)
class ApiState:
    """What the routes share; the server sets `adapter` once warm and `draining` on shutdown."""

    config: ApiConfig
    registry: Registry
    pool: concurrent.futures.ThreadPoolExecutor
    metrics: HttpMetrics = None
    adapter: EngineAdapter | None = None
    draining: bool = False

    def __post_init__(self):
        if self.metrics is None:
            self.metrics = HttpMetrics(self.registry)


def _ready(state: ApiState) -> EngineAdapter:
    if state.draining:
        raise APIError(503, "the server is shutting down; retry on another instance", code="shutting_down")
    if state.adapter is None:
        raise APIError(503, "the model is still loading; GET /health turns 200 when it is ready",
                       code="model_loading")
    return state.adapter


def _authorize(state: ApiState, request: Request) -> None:
    problem = bearer_problem(request.headers.get("authorization"), state.config.api_key)
    if problem == MISSING:
        raise APIError(401, "missing API key: send the header 'Authorization: Bearer <key>'", code="invalid_api_key")
    if problem is not None:
        raise APIError(401, "incorrect API key", code="invalid_api_key")


async def _read_json(request: Request, limit: int) -> object:
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media != "application/json":
        raise APIError(415, f"Content-Type must be application/json, got {media or 'none'!r}")
    declared = request.headers.get("content-length")
    too_big = APIError(413, f"the request body is over the limit of {limit} bytes", code="request_too_large")
    if declared and declared.isdigit() and int(declared) > 4 * limit:
        raise too_big  # not worth reading to answer politely
    size, chunks = 0, []
    async for chunk in request.stream():
        size += len(chunk)
        if size <= limit:
            chunks.append(chunk)
        elif size > 4 * limit:
            raise too_big
    if size > limit:  # read to the end, so the client is not cut off before it reads the answer
        raise too_big
    try:
        return json.loads(b"".join(chunks))
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    except RecursionError:  # Python's decoder recurses once per level: some 1,000 levels exhaust it
        raise APIError(400, "the request body is not valid JSON for this server: its arrays or objects are nested "
                            f"more deeply than the decoder's limit (about {_MAX_JSON_DEPTH} levels)") from None


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


@dataclasses.dataclass
class _Job:
    """One HTTP generation request, checked: what to queue and how to answer."""

    chat: bool
    model: str
    stream: bool
    include_usage: bool
    continuous_usage: bool  # stream_options.continuous_usage_stats (vLLM's extension)
    prompts: list[tuple[int, list[int], object]]  # (choice index, prompt ids, SamplingParams)
    echo: list[str]  # per choice: text to put before the completion ("" unless echo)
    prompt_tokens: int  # counted once per prompt, not per choice
    logprobs: int | None = None  # top tokens per generated token; None: choices carry "logprobs": null
    text_of: object = None  # token id -> its text (EngineAdapter.token_text), for logprob entries
    echo_logprobs: bool = False  # completions' echo with logprobs: the prompt's tokens lead each choice's logprobs
    prompt_logprobs: bool = False  # vLLM's extra: each choice carries "prompt_logprobs"

    def choice_logprobs(self, token_ids, entries, offset: int = 0) -> tuple[dict | None, int]:
        """A choice's "logprobs" for these tokens (None unless asked), and the text offset after them."""
        if self.logprobs is None:
            return None, offset
        if self.chat:
            return chat_logprobs(token_ids, entries, self.text_of), offset
        return completion_logprobs(token_ids, entries, self.text_of, offset)

    def prompt_ids(self, index: int) -> list[int]:
        return next(ids for i, ids, _ in self.prompts if i == index)

    def prompt_extras(self, index: int, entries) -> tuple[dict | None, dict]:
        """The echoed prompt's share of a choice (its logprobs when echo asks for them, else None) and the
        choice's extra fields (vLLM's prompt_logprobs), from the prompt's entries."""
        ids = self.prompt_ids(index)
        echoed = completion_logprobs(ids, entries, self.text_of, 0)[0] if self.echo_logprobs else None
        extra = {"prompt_logprobs": prompt_logprobs(ids, entries, self.text_of)} if self.prompt_logprobs else {}
        return echoed, extra


def _check(state: ApiState, adapter: EngineAdapter, body: object, chat: bool) -> _Job:
    req = protocol.parse(protocol.ChatCompletionRequest if chat else protocol.CompletionRequest, body)
    if req.model != adapter.model_name:
        raise APIError(404, f"the model {req.model!r} does not exist; this server serves {adapter.model_name!r}",
                       param="model", code="model_not_found")
    req.unsupported()
    logprobs, logprobs_name = req.logprobs_wanted()
    scored = req.prompt_logprobs_wanted()  # top tokens per prompt token, for echo with logprobs or the extra
    if not chat and req.echo and req.output_limit() == 0 and scored is None:
        scored = 0  # echo with max_tokens 0: the prompt is only read (the engine scores it; nothing is shown)
    if not 1 <= req.n <= state.config.max_n:
        raise APIError(400, f"n must be in [1, {state.config.max_n}], got {req.n}", param="n")
    if chat:
        try:
            prompts = [adapter.chat_prompt([{"role": m.role, "content": m.text()} for m in req.messages])]
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from None
    else:
        prompts = req.prompts()
        if not prompts:
            raise APIError(400, "prompt is empty: send a string, a list of strings or a list of token ids",
                           param="prompt")
    # Queued all or none: more engine requests than the queue holds could never be queued, whatever the load.
    needed, room = len(prompts) * req.n, adapter.max_waiting
    if needed > room:
        raise APIError(400, f"this request needs {needed} engine requests ({len(prompts)} prompt"
                            f"{'s' if len(prompts) > 1 else ''} x n={req.n}), over the limit {room} the server "
                            f"can queue at once (--max-queue): send at most {room} prompts x choices per request",
                       param="n" if req.n > 1 else "prompt")
    # Without a seed, a fresh random one (gRPC's rule too); choice j then samples with seed + j.
    base = req.seed if req.seed is not None else random_seed()
    temperature = 1.0 if req.temperature is None else req.temperature  # OpenAI's default
    penalties = req.penalties()
    checked, echo, prompt_tokens = [], [], 0
    for p, prompt in enumerate(prompts):
        for j in range(req.n):
            seed = base if j == 0 else (base + j) % SEED_LIMIT  # choice 0 carries the seed as sent (checked)
            sampling = Sampling(max_tokens=req.output_limit(), temperature=temperature, top_p=req.top_p,
                                top_k=req.top_k, seed=seed, stop=req.stops(), ignore_eos=req.ignore_eos,
                                logprobs=logprobs, logprobs_name=logprobs_name, prompt_logprobs=scored,
                                num_speculative_tokens=req.num_speculative_tokens, **penalties)
            try:
                ids, params = adapter.check(prompt, sampling)
            except ValueError as e:
                message = str(e)
                if len(prompts) > 1 and message.startswith("prompt"):
                    message = f"prompt {p}: {message}"
                field = _FIELD.match(message)
                param = field.group(0) if field else None
                if chat and param == "prompt":
                    param, message = "messages", f"messages: the rendered {message}"
                raise APIError(400, message, param=param) from None
            checked.append((p * req.n + j, ids, params))
            echo.append((prompt if isinstance(prompt, str) else adapter.decode(prompt))
                        if not chat and req.echo else "")
        prompt_tokens += len(checked[-1][1])
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    continuous_usage = bool(req.stream_options and req.stream_options.continuous_usage_stats)
    return _Job(chat, req.model, req.stream, include_usage, continuous_usage, checked, echo, prompt_tokens,
                logprobs, adapter.token_text, echo_logprobs=not chat and req.echo and logprobs is not None,
                prompt_logprobs=req.prompt_logprobs is not None)


def _submit(state: ApiState, adapter: EngineAdapter, job: _Job) -> StreamGroup:
    """Queue every engine request of the job, all or none: a refusal leaves nothing queued or running."""
    group = StreamGroup(state.pool)
    try:
        streams = adapter.submit([(ids, params) for _, ids, params in job.prompts])
    except QueueFull as e:
        raise APIError(429, f"server busy: {e}; retry later", code="queue_full") from None
    except EngineStopped as e:
        raise APIError(503, f"{e}; retry on another instance", code="shutting_down") from None
    try:
        for (index, _, _), stream in zip(job.prompts, streams):
            group.add(index, stream)
    except BaseException:  # e.g. the pool shut down: no request may run on with nobody reading it
        for stream in streams:
            stream.cancel()
        raise
    return group


def _chunk(job: _Job, rid: str, created: int, index: int, text: str | None, finish: str | None,
           first: bool = False, logprobs: dict | None = None, extra: dict | None = None) -> dict:
    if job.chat:
        delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish, **(extra or {})}
        kind = "chat.completion.chunk"
    else:
        choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish, **(extra or {})}
        kind = "text_completion"
    out = {"id": rid, "object": kind, "created": created, "model": job.model, "choices": [choice]}
    if job.include_usage:
        out["usage"] = None
    return out


def _sse(data) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


class _Tally:
    """Per-request bookkeeping shared by the streaming and the collecting paths."""

    def __init__(self, state: ApiState, start: float):
        self.state, self.start = state, start
        self.first_token_at = None
        self.completion_tokens: dict[int, int] = {}

    def see(self, index: int, event) -> None:
        if event.token_ids and self.first_token_at is None:
            self.first_token_at = time.monotonic()
            self.state.metrics.ttft.observe(self.first_token_at - self.start)
        self.completion_tokens[index] = event.completion_tokens

    def done(self, code: int) -> None:
        self.state.metrics.requests.inc(code=str(code))
        self.state.metrics.duration.observe(time.monotonic() - self.start)
        self.state.metrics.streams.inc(-1)


class _EventStream(StreamingResponse):
    """An SSE response that runs `on_close` however it ends, even if the client left before its first byte
    (then the body generator never starts, and no `finally` inside it would run)."""

    def __init__(self, content, on_close):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def _stream(job: _Job, group: StreamGroup, tally: _Tally) -> StreamingResponse:
    rid = f"{'chatcmpl' if job.chat else 'cmpl'}-{uuid.uuid4().hex}"
    created = int(time.time())
    outcome = {"code": 499}  # unless the stream reaches its end: the client went away (or the server stopped)
    offsets = {index: len(echo) for (index, _, _), echo in zip(job.prompts, job.echo)}  # text_offset so far

    # The echoed prompt goes out first, unless its log-probabilities (or vLLM's prompt_logprobs) are asked for:
    # then it waits for the engine's first output, which carries them.
    waits_for_prompt = job.echo_logprobs or job.prompt_logprobs
    echo_of = {index: echo for (index, _, _), echo in zip(job.prompts, job.echo)}

    async def events():
        for (index, _, _), echo in zip(job.prompts, job.echo):
            if job.chat:
                yield _sse(_chunk(job, rid, created, index, None, None, first=True))
            elif echo and not waits_for_prompt:
                yield _sse(_chunk(job, rid, created, index, echo, None))
        async for index, event in group.events():
            tally.see(index, event)
            if event.error is not None:
                group.cancel()
                outcome["code"] = 500
                yield _sse(APIError(500, f"generation failed: {event.error}").body())
                break
            if waits_for_prompt and event.prompt_logprobs is not None:
                echoed, extra = job.prompt_extras(index, event.prompt_logprobs)
                yield _sse(_chunk(job, rid, created, index, echo_of[index] if not job.chat else None, None,
                                  logprobs=echoed, extra=extra))
            # With logprobs, every token's entry goes out with the step that made it, even before its text.
            logprobs, offsets[index] = job.choice_logprobs(event.token_ids, event.logprobs or (), offsets[index])
            if job.continuous_usage:
                chunk = _chunk(job, rid, created, index, event.text, event.finish_reason, logprobs=logprobs)
                chunk["usage"] = _usage(job.prompt_tokens, sum(tally.completion_tokens.values()))
                yield _sse(chunk)
            elif event.text or event.finish_reason is not None or (logprobs is not None and event.token_ids):
                yield _sse(_chunk(job, rid, created, index, event.text, event.finish_reason, logprobs=logprobs))
        else:
            outcome["code"] = 200
        if job.include_usage:
            kind = "chat.completion.chunk" if job.chat else "text_completion"
            yield _sse({"id": rid, "object": kind, "created": created, "model": job.model, "choices": [],
                        "usage": _usage(job.prompt_tokens, sum(tally.completion_tokens.values()))})
        yield "data: [DONE]\n\n"

    def on_close():
        group.cancel()  # the client is gone, or everything has finished (a no-op then)
        tally.done(outcome["code"])

    return _EventStream(events(), on_close)


async def _collect(job: _Job, group: StreamGroup, tally: _Tally, request: Request) -> JSONResponse:
    texts = {index: [echo] for (index, _, _), echo in zip(job.prompts, job.echo)}
    tokens: dict[int, list] = {index: [] for index in texts}
    entries: dict[int, list] = {index: [] for index in texts}
    scored: dict[int, tuple] = {}
    finish: dict[int, str] = {}
    errors = []

    async def run():
        async for index, event in group.events():
            tally.see(index, event)
            texts[index].append(event.text)
            tokens[index].extend(event.token_ids)
            entries[index].extend(event.logprobs or ())
            if event.prompt_logprobs is not None:
                scored[index] = event.prompt_logprobs
            if event.finish_reason is not None:
                finish[index] = event.finish_reason
            if event.error is not None:
                errors.append(event.error)

    code = 499
    try:
        task = asyncio.ensure_future(run())
        gone = False
        while not (await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S))[0]:
            if not gone and await request.is_disconnected():
                gone = True
                group.cancel()  # the answer has nowhere to go: free the rBlocks now
        task.result()
        if gone:
            return Response(status_code=499)  # nobody reads it; 499 in the metrics, as for a closed stream
        if errors:
            code = 500
            raise APIError(500, f"generation failed: {errors[0]}")
        if "cancelled" in finish.values():
            code = 503
            raise APIError(503, "the request was cancelled: the server is shutting down", code="shutting_down")
        choices = []
        for index in sorted(texts):
            text = "".join(texts[index])
            logprobs, _ = job.choice_logprobs(tokens[index], entries[index], len(texts[index][0]))  # after echo
            echoed, extra = job.prompt_extras(index, scored[index]) if index in scored else (None, {})
            if echoed is not None:  # the prompt's tokens first, then the completion's
                logprobs = {key: echoed[key] + logprobs[key] for key in echoed}
            if job.chat:
                choices.append({"index": index, "message": {"role": "assistant", "content": text},
                                "logprobs": logprobs, "finish_reason": finish[index], **extra})
            else:
                choices.append({"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish[index],
                                **extra})
        body = {"id": f"{'chatcmpl' if job.chat else 'cmpl'}-{uuid.uuid4().hex}",
                "object": "chat.completion" if job.chat else "text_completion", "created": int(time.time()),
                "model": job.model, "choices": choices,
                "usage": _usage(job.prompt_tokens, sum(tally.completion_tokens.values()))}
        code = 200
        return JSONResponse(body)
    finally:
        group.cancel()
        tally.done(code)


def build_app(state: ApiState) -> FastAPI:
    app = FastAPI(title="jaxllm", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception):  # a bug: still OpenAI's shape (and logged)
        return JSONResponse(APIError(500, f"internal error: {type(e).__name__}").body(), status_code=500)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):  # unknown path, wrong method
        return JSONResponse(APIError(e.status_code, f"{request.method} {request.url.path}: {e.detail}").body(),
                            status_code=e.status_code)

    @app.get("/health")
    async def health():
        _ready(state)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(state.registry.render(), headers={"Content-Type": CONTENT_TYPE})

    @app.get("/v1/models")
    async def models(request: Request):
        _authorize(state, request)
        adapter = _ready(state)
        return {"object": "list", "data": [{"id": adapter.model_name, "object": "model", "created": 0,
                                            "owned_by": "jaxllm", "max_model_len": adapter.context_limit,
                                            "vocab_size": adapter.vocab_size}]}

    async def generate(request: Request, chat: bool):
        start = time.monotonic()
        code = 200
        try:
            _authorize(state, request)
            adapter = _ready(state)
            job = _check(state, adapter, await _read_json(request, state.config.max_body_bytes), chat)
            group = _submit(state, adapter, job)
        except APIError as e:
            code = e.status
            raise
        except Exception:  # a bug: answered 500 by the handler below, and counted like every other answer
            code = 500
            raise
        finally:
            if code != 200:
                state.metrics.requests.inc(code=str(code))
        state.metrics.streams.inc()
        tally = _Tally(state, start)
        if job.stream:
            return _stream(job, group, tally)
        return await _collect(job, group, tally, request)

    async def tokenizer_route(request: Request, route: str, answer):
        code = 200
        try:
            _authorize(state, request)
            adapter = _ready(state)
            return answer(adapter, await _read_json(request, state.config.max_body_bytes))
        except APIError as e:
            code = e.status
            raise
        except Exception:
            code = 500
            raise
        finally:
            state.metrics.tokenizer_requests.inc(route=route, code=str(code))

    @app.post("/tokenize")
    async def tokenize_route(request: Request):
        return await tokenizer_route(request, "tokenize", tokenize)

    @app.post("/detokenize")
    async def detokenize_route(request: Request):
        return await tokenizer_route(request, "detokenize", detokenize)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, chat=True)

    return app
