"""The gRPC service over an `Engine`: servicer, health, reflection, metrics, graceful shutdown.

    server = Server(ServerConfig(port=0))   # binds and starts at once; health says NOT_SERVING
    llm = LLM(...); engine = Engine(llm.core, llm.tokenizer, llm.info(), max_waiting=...)   # load, warm up
    server.attach(engine, model_name)       # health flips to SERVING
    ...
    server.shutdown()                       # stop accepting, drain within the grace period, stop

Each Generate call holds one thread of the server's pool for as long as it streams; the pool and
gRPC's concurrent-RPC limit are sized to the engine's running + waiting capacity, so a request
over it gets RESOURCE_EXHAUSTED at once rather than waiting unseen for a thread.

With `ServerConfig.api_key` every LLMService call needs the metadata `authorization: Bearer <key>`
(UNAUTHENTICATED otherwise; health and reflection stay open, as HTTP's /health does). A request that
does not parse is INVALID_ARGUMENT naming the field where it can (serve/decoding.py), not gRPC's own
INTERNAL. Both are answered by the servicer, so `jaxllm_requests_total` counts them.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
import time

import grpc
import jax
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2

import jaxllm
from jaxllm.engine.core import Request
from jaxllm.engine.requests import check_length
from jaxllm.engine.threaded import Engine, EngineStopped, QueueFull
from serve import jaxllm_pb2 as pb
from serve import jaxllm_pb2_grpc as pb_grpc
from serve.auth import MISSING, bearer_problem
from serve.client import grpc_target
from serve.decoding import Malformed, tolerant
from serve.metrics import Registry, register_engine_metrics, serve_metrics
from serve.validation import to_engine_request, token_logprobs

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["LLMService"].full_name  # "jaxllm.v1.LLMService"
_FINISH = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH, "cancelled": pb.FINISH_REASON_CANCELLED}
# grpcio-reflection (to 1.85 at least) ships only v1alpha; v1 is the same protocol under another
# package name (identical messages, field for field), and current grpcurl asks for v1 first.
REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"
_SPARE_THREADS = 16  # health checks, ModelInfo, Tokenize, streams writing their last message


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 50051  # 0: pick a free port (Server.port says which)
    metrics_port: int | None = None  # None: no metrics endpoint; 0: pick a free port
    max_running: int = 256  # the engine's max_seqs (for sizing the thread pool)
    max_queue: int = 256  # waiting requests before RESOURCE_EXHAUSTED
    max_message_bytes: int = 4 << 20  # request limits beyond this are the engine's (EngineOptions)
    grace_period_s: float = 10.0
    api_key: str | None = None  # None: no authentication; else LLMService calls need "authorization: Bearer KEY"

    def __post_init__(self):
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must be non-empty when set")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in [0, 65535], got {self.metrics_port}")
        for name in ("max_running", "max_queue", "max_message_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.grace_period_s < 0:
            raise ValueError(f"grace_period_s must be >= 0, got {self.grace_period_s}")


_TRANSPORT_SLACK = 4  # the transport's receive limit, in multiples of ServerConfig.max_message_bytes


class _Metrics:
    """What /metrics shows for gRPC: its own request series, and the engine's (read at scrape time)."""

    def __init__(self, registry: Registry, servicer: "LLMServicer"):
        r = registry
        self.requests = r.counter("jaxllm_requests_total", "Generate calls, by final gRPC status code", ["code"])
        self.ttft = r.histogram("jaxllm_time_to_first_token_seconds", "request arrival to its first token")
        self.tpot = r.histogram("jaxllm_time_per_output_token_seconds",
                                "a request's mean time per output token after the first")
        self.duration = r.histogram("jaxllm_request_duration_seconds", "Generate call, arrival to last message")
        self.streams = r.gauge("jaxllm_active_streams", "Generate calls in progress")
        register_engine_metrics(r, lambda: servicer.engine)


class LLMServicer(pb_grpc.LLMServiceServicer):
    def __init__(self, config: ServerConfig, registry: Registry):
        self.config = config
        self.engine: Engine | None = None
        self.model_name = ""
        self.metrics = _Metrics(registry, self)

    def attach(self, engine: Engine, model_name: str) -> None:
        self.model_name = model_name
        self.engine = engine

    def _admit(self, request, context) -> None:
        """Abort a call without the API key (UNAUTHENTICATED) or whose request did not parse (INVALID_ARGUMENT)."""
        header = dict(context.invocation_metadata()).get("authorization")
        problem = bearer_problem(header, self.config.api_key)
        if problem == MISSING:
            context.abort(grpc.StatusCode.UNAUTHENTICATED,
                          "missing API key: send the metadata 'authorization: Bearer <key>'")
        if problem is not None:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "incorrect API key")
        if isinstance(request, Malformed):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.details())

    def _ready_engine(self, context) -> Engine:
        engine = self.engine
        if engine is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, "the model is still loading; watch grpc.health.v1 for SERVING")
        return engine

    def Generate(self, request, context):  # noqa: N802 (gRPC's naming)
        start = time.monotonic()
        code = grpc.StatusCode.OK
        self.metrics.streams.inc()
        try:
            yield from self._generate(request, context)
        except Exception:
            code = context.code() or grpc.StatusCode.UNKNOWN  # abort() set it; anything else is a bug
            raise
        finally:
            if code is grpc.StatusCode.OK and not context.is_active():
                remaining = context.time_remaining()  # None: the call had no deadline
                expired = remaining is not None and remaining <= 0
                code = grpc.StatusCode.DEADLINE_EXCEEDED if expired else grpc.StatusCode.CANCELLED
            self.metrics.requests.inc(code=code.name)
            self.metrics.duration.observe(time.monotonic() - start)
            self.metrics.streams.inc(-1)

    def _generate(self, request, context):
        self._admit(request, context)
        size = request.ByteSize()
        if size > self.config.max_message_bytes:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"request is {size} bytes, over the limit {self.config.max_message_bytes}")
        engine = self._ready_engine(context)
        try:
            ids, params = to_engine_request(request, engine.tokenizer, engine.limits)  # the one check
            stream = engine.submit_checked([Request(ids, params, checked=engine.limits)])[0]
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except QueueFull as e:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"server busy: {e}; retry later")
        except EngineStopped as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        # Client cancel, a passed deadline or a dropped connection runs this at once: the engine frees
        # the request's rBlocks before its next step.
        if not context.add_callback(stream.cancel):
            stream.cancel()
            return
        for event in stream:
            if event.error is not None:
                context.abort(grpc.StatusCode.INTERNAL, f"generation failed: {event.error}")
            if event.timings is not None:  # the last event: the engine measured them (once)
                if event.timings.ttft_s is not None:
                    self.metrics.ttft.observe(event.timings.ttft_s)
                if event.timings.tpot_s is not None:
                    self.metrics.tpot.observe(event.timings.tpot_s)
            response = pb.GenerateResponse(
                text=event.text, token_ids=event.token_ids,
                usage=pb.Usage(prompt_tokens=event.prompt_tokens, completion_tokens=event.completion_tokens))
            if event.logprobs is not None:
                response.logprobs.extend(pb.TokenLogprob(**fields)
                                         for fields in token_logprobs(zip(event.token_ids, event.logprobs)))
            if event.prompt_logprobs is not None:
                response.prompt_logprobs.extend(pb.TokenLogprob(**fields)
                                                for fields in token_logprobs(zip(ids, event.prompt_logprobs)))
            if event.finish_reason is not None:
                response.finish_reason = _FINISH.get(event.finish_reason, pb.FINISH_REASON_CANCELLED)
            yield response

    def Tokenize(self, request, context):  # noqa: N802
        self._admit(request, context)
        engine = self._ready_engine(context)  # UNAVAILABLE until the model is loaded
        try:  # no more ids than one sequence holds (HTTP's /tokenize has the same cap)
            ids = check_length(engine.tokenizer.encode(request.text), engine.limits, "text",
                               max_tokens=engine.limits.context_limit)
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return pb.TokenizeResponse(token_ids=ids)

    def ModelInfo(self, request, context):  # noqa: N802
        self._admit(request, context)
        engine = self._ready_engine(context)
        info, limits = engine.info(), engine.limits
        return pb.ModelInfoResponse(
            model=self.model_name, architecture=info.architecture, dtype=info.dtype,
            vocab_size=info.vocab_size, num_layers=info.num_layers, hidden_size=info.hidden_size,
            num_heads=info.num_heads, num_kv_heads=info.num_kv_heads, max_context=info.context_limit,
            kv_block_size=info.block_size, kv_num_blocks=info.num_blocks, kv_dtype=info.kv_dtype,
            max_running=info.max_seqs, max_queue=info.max_queue or 0, tensor_parallel=info.tensor_parallel,
            instances=info.instances, processes=info.processes, devices=info.devices,
            default_max_tokens=limits.default_max_tokens, max_stop_strings=limits.max_stop_strings,
            max_stop_length=limits.max_stop_length, backend=jax.default_backend(), version=jaxllm.__version__)


def _add_servicer(servicer: LLMServicer, server) -> None:
    """pb_grpc.add_LLMServiceServicer_to_server, with deserializers that hand a malformed request to the
    servicer (as a Malformed) instead of letting gRPC answer INTERNAL unseen."""
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            servicer.Generate, request_deserializer=tolerant(pb.GenerateRequest),
            response_serializer=pb.GenerateResponse.SerializeToString),
        "Tokenize": grpc.unary_unary_rpc_method_handler(
            servicer.Tokenize, request_deserializer=tolerant(pb.TokenizeRequest),
            response_serializer=pb.TokenizeResponse.SerializeToString),
        "ModelInfo": grpc.unary_unary_rpc_method_handler(
            servicer.ModelInfo, request_deserializer=tolerant(pb.ModelInfoRequest),
            response_serializer=pb.ModelInfoResponse.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))


def _serve_reflection_v1(servicer, server) -> None:
    """Answer grpc.reflection.v1 with the v1alpha servicer: the wire format is the same."""
    handlers = {"ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo, request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString)}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(REFLECTION_V1, handlers),))


class Server:
    """A started gRPC server (plus the metrics endpoint); NOT_SERVING until `attach`."""

    def __init__(self, config: ServerConfig):
        self.config = config
        self.registry = Registry()
        self.servicer = LLMServicer(config, self.registry)
        self.health = health.HealthServicer()
        for service in ("", SERVICE_NAME):
            self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        capacity = config.max_running + config.max_queue + _SPARE_THREADS
        self._grpc = grpc.server(
            concurrent.futures.ThreadPoolExecutor(max_workers=capacity, thread_name_prefix="jaxllm-grpc"),
            maximum_concurrent_rpcs=capacity,
            # The transport takes up to _TRANSPORT_SLACK x the limit, so that Generate itself refuses (and
            # counts, in jaxllm_requests_total) a message over the limit; past that gRPC refuses it unseen.
            options=[("grpc.max_receive_message_length", _TRANSPORT_SLACK * config.max_message_bytes),
                     ("grpc.max_send_message_length", config.max_message_bytes),
                     ("grpc.so_reuseport", 0)])  # a second server on the same port must fail, not share it
        _add_servicer(self.servicer, self._grpc)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._grpc)
        names = (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME,
                 REFLECTION_V1)
        reflection.enable_server_reflection(names, self._grpc)
        _serve_reflection_v1(reflection.ReflectionServicer(names), self._grpc)
        address = grpc_target(config.host, config.port)
        try:
            self.port = self._grpc.add_insecure_port(address)
        except RuntimeError as e:  # grpcio >= 1.60 raises instead of returning 0
            raise OSError(f"cannot listen on {address}: {e}") from None
        if self.port == 0:
            raise OSError(f"cannot listen on {address} (in use, or not an address of this host?)")
        self._metrics_http = None
        self.metrics_port = None
        if config.metrics_port is not None:
            self._metrics_http = serve_metrics(self.registry, config.host, config.metrics_port)
            self.metrics_port = self._metrics_http.server_address[1]
        self._grpc.start()
        self._stopped = threading.Event()

    def attach(self, engine: Engine, model_name: str) -> None:
        """Start answering Generate with `engine` (loaded and warm); health turns SERVING."""
        self.servicer.attach(engine, model_name)
        for service in ("", SERVICE_NAME):
            self.health.set(service, health_pb2.HealthCheckResponse.SERVING)

    def stop_now(self, grace_s: float = 1.0) -> None:
        """Stop without draining: the engine failed for good (Engine.fail already ended every stream with
        its error). Health turns NOT_SERVING, streams get up to grace_s to send their last message, and
        nothing waits for the engine's thread."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        self.health.enter_graceful_shutdown()
        self._grpc.stop(grace=grace_s).wait()

    def shutdown(self, grace_s: float | None = None) -> None:
        """Stop accepting; let in-flight streams finish for up to grace_s, cancel the rest; stop serving.

        Health turns NOT_SERVING first (load balancers move away), new Generate calls get
        UNAVAILABLE, and every stream still open ends with a final message (finish reason
        CANCELLED if the grace period ran out) before the server stops.
        """
        if self._stopped.is_set():
            return
        self._stopped.set()
        grace_s = self.config.grace_period_s if grace_s is None else grace_s
        self.health.enter_graceful_shutdown()
        engine = self.servicer.engine
        if engine is not None:
            engine.shutdown(grace_s)
        # Streams have their final events by now; give their threads a moment to send them.
        self._grpc.stop(grace=1.0).wait()
        if self._metrics_http is not None:
            self._metrics_http.shutdown()
            self._metrics_http.server_close()
