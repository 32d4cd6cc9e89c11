"""The OpenAI-compatible HTTP server: uvicorn on a background thread, beside (or instead of) gRPC.

    http = HttpServer(HttpConfig(port=8000), registry)   # binds at once; 503 until attach
    http.attach(engine, "tiny")                          # /health turns 200
    ...
    http.stop_accepting()   # new requests: 503; streams in flight run on while the engine drains
    engine.shutdown(grace)  # (the gRPC Server's shutdown does this when both run)
    http.shutdown()         # close the listener once every stream has its last event

The socket is bound here, not by uvicorn, so a port in use fails at once and `port` says which
port 0 picked.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import socket
import threading

import uvicorn

from serve.http.app import ApiConfig, ApiState, build_app
from serve.http.engine_adapter import EngineAdapter
from serve.metrics import Registry, register_engine_metrics

_SPARE_THREADS = 16


@dataclasses.dataclass(frozen=True)
class HttpConfig:
    host: str = "127.0.0.1"
    port: int = 8000  # 0: pick a free port (HttpServer.port says which)
    api_key: str | None = None  # None: no authentication
    max_body_bytes: int = 4 << 20
    max_n: int = 16
    max_running: int = 256  # the engine's max_seqs and waiting limit: the bridge's thread pool covers both
    max_queue: int = 256

    def __post_init__(self):
        if not 0 <= self.port <= 65535:
            raise ValueError(f"http port must be in [0, 65535], got {self.port}")
        for name in ("max_running", "max_queue"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        ApiConfig(self.api_key, self.max_body_bytes, self.max_n)  # its own checks


def _listen(host: str, port: int) -> socket.socket:
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as e:
        raise OSError(f"cannot listen on {host}:{port}: {e}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # restarts; a live listener still refuses
        sock.bind(address)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {e}") from None
    return sock


class HttpServer:
    """A started OpenAI API server; 503 until `attach`.

    `registry`: the metrics registry to share (the gRPC server's); `engine_metrics`: also register
    the engine's gauges and counters there (an HTTP-only server, where no gRPC servicer does).
    """

    def __init__(self, config: HttpConfig, registry: Registry | None = None, *, engine_metrics: bool = False):
        self.config = config
        self.registry = registry if registry is not None else Registry()
        capacity = config.max_running + config.max_queue + _SPARE_THREADS
        self._pool = concurrent.futures.ThreadPoolExecutor(capacity, thread_name_prefix="jaxllm-http")
        self.state = ApiState(ApiConfig(config.api_key, config.max_body_bytes, config.max_n), self.registry,
                              self._pool)
        if engine_metrics:
            register_engine_metrics(self.registry, lambda: self.state.adapter.engine if self.state.adapter else None)
        self._socket = _listen(config.host, config.port)
        self.port = self._socket.getsockname()[1]
        uv_config = uvicorn.Config(build_app(self.state), log_level="warning", access_log=False, lifespan="off",
                                   timeout_graceful_shutdown=5, timeout_keep_alive=30)
        self._uvicorn = uvicorn.Server(uv_config)
        self._thread = threading.Thread(target=self._uvicorn.run, kwargs={"sockets": [self._socket]},
                                        name="jaxllm-http", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        """The API's base URL (what an OpenAI client takes as base_url)."""
        host = f"[{self.config.host}]" if ":" in self.config.host else self.config.host
        return f"http://{host}:{self.port}/v1"

    def attach(self, engine, model_name: str) -> None:
        """Start answering with `engine` (loaded and warm) under `model_name`; /health turns 200."""
        self.state.adapter = EngineAdapter(engine, model_name)

    def stop_accepting(self) -> None:
        """New requests get 503 and /health 503; streams in flight go on until the engine ends them."""
        self.state.draining = True

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop serving: close the listener, let open responses send what they have, stop the thread."""
        self.stop_accepting()
        self._uvicorn.should_exit = True
        self._thread.join(timeout=timeout_s)
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._socket.close()
