"""The OpenAI-compatible HTTP API (FastAPI on uvicorn) over the same engine as the gRPC service."""

from serve.http.server import HttpConfig, HttpServer

__all__ = ["HttpConfig", "HttpServer"]
