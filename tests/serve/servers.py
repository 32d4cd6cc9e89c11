"""Both front ends over one threaded Engine in this process, as `python -m jaxllm.serve --http-port` runs them (for
the tests that compare gRPC, HTTP and the Python API on one engine)."""

from __future__ import annotations

import contextlib
import time

import grpc

from jaxllm.engine.threaded import Engine
from serve import jaxllm_pb2_grpc as pb_grpc
from serve.http import HttpConfig, HttpServer
from serve.server import Server, ServerConfig


@contextlib.contextmanager
def grpc_and_http(llm, **engine_options):
    """(threaded Engine over llm's core, gRPC stub, HttpServer), both servers on free ports; shut down after."""
    engine = Engine(llm.core, llm.tokenizer, llm.info(), **engine_options)
    grpc_server = Server(ServerConfig(port=0))
    http = HttpServer(HttpConfig(port=0), grpc_server.registry)
    grpc_server.attach(engine, "tiny")
    http.attach(engine, "tiny")
    channel = grpc.insecure_channel(f"127.0.0.1:{grpc_server.port}")
    try:
        yield engine, pb_grpc.LLMServiceStub(channel), http
    finally:
        channel.close()
        http.stop_accepting()
        grpc_server.shutdown(1.0)  # drains the engine
        http.shutdown(5.0)


def wait_idle(engine, timeout_s: float = 60) -> None:
    """Wait until the engine thread has nothing to do (LLM calls drive the same core from the test's thread)."""
    deadline = time.monotonic() + timeout_s
    while not engine.idle():
        assert time.monotonic() < deadline, "the engine did not go idle"
        time.sleep(0.01)
