"""Prometheus text-format metrics with only the standard library: counters, gauges, histograms.

    registry = Registry()
    requests = registry.counter("jaxllm_requests_total", "Generate calls by final status", ["code"])
    requests.inc(code="OK")
    registry.gauge("jaxllm_queue_depth", "requests waiting", fn=engine.queue_depth)
    serve_metrics(registry, "127.0.0.1", 9464)  # GET /metrics in a daemon thread

Values read from elsewhere (the engine's counters, pool use) are gauges or counters with `fn`,
evaluated at scrape time, so nothing has to push them. `register_engine_metrics` registers the engine's: every
metric its stats tree (jaxllm.contract.stats) declares, found by walking the tree, and the mesh's.
"""

from __future__ import annotations

import bisect
import http.server
import math
import threading
from typing import Callable, Iterable

from jaxllm.contract import EngineStats, stats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Seconds; spans a fast GPU decode step (ms) to a long CPU prefill or a queued request (tens of s).
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def _format_value(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if math.isnan(value):
        return "NaN"
    return repr(float(value)) if not float(value).is_integer() else str(int(value))


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(names: Iterable[str], values: Iterable[str], extra: str = "") -> str:
    parts = [f'{n}="{_escape(str(v))}"' for n, v in zip(names, values)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


class _Metric:
    kind = ""

    def __init__(self, name: str, help_text: str, labels: Iterable[str] = ()):
        self.name = name
        self.help = help_text
        self.label_names = tuple(labels)
        self._lock = threading.Lock()

    def _key(self, labels: dict) -> tuple:
        if set(labels) != set(self.label_names):
            raise ValueError(f"{self.name} takes labels {self.label_names}, got {tuple(labels)}")
        return tuple(str(labels[n]) for n in self.label_names)

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]


class Counter(_Metric):
    """A value that only goes up; `fn` reads it from elsewhere at scrape time: a number, or with labels a
    {label values tuple: number} dict (one sample each)."""

    kind = "counter"

    def __init__(self, name, help_text, labels=(), fn: Callable[[], float] | None = None):
        super().__init__(name, help_text, labels)
        self._values: dict[tuple, float] = {}
        self._fn = fn

    def inc(self, amount: float = 1.0, **labels) -> None:
        if amount < 0:
            raise ValueError(f"a counter only goes up; got inc({amount})")
        key = self._key(labels)
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount

    def render(self) -> list[str]:
        if self._fn is not None and self.label_names:
            values = self._fn() or {}
            return self.header() + [f"{self.name}{_labels(self.label_names, k)} {_format_value(v)}"
                                    for k, v in sorted(values.items())]
        if self._fn is not None:
            return self.header() + [f"{self.name} {_format_value(self._fn())}"]
        with self._lock:
            items = sorted(self._values.items())
        return self.header() + [f"{self.name}{_labels(self.label_names, k)} {_format_value(v)}" for k, v in items]


class Gauge(Counter):
    """A value that goes up and down."""

    kind = "gauge"

    def set(self, value: float, **labels) -> None:
        key = self._key(labels)
        with self._lock:
            self._values[key] = float(value)

    def inc(self, amount: float = 1.0, **labels) -> None:
        key = self._key(labels)
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount


class Histogram(_Metric):
    """Cumulative buckets, sum and count of observations (seconds, tokens, ...)."""

    kind = "histogram"

    def __init__(self, name, help_text, buckets: Iterable[float] = LATENCY_BUCKETS):
        super().__init__(name, help_text)
        self.buckets = tuple(sorted(buckets))
        self._counts = [0] * (len(self.buckets) + 1)  # last slot: above every bound
        self._sum = 0.0
        self._count = 0

    def observe(self, value: float) -> None:
        with self._lock:
            self._counts[bisect.bisect_left(self.buckets, value)] += 1
            self._sum += value
            self._count += 1

    def render(self) -> list[str]:
        with self._lock:
            counts, total, n = list(self._counts), self._sum, self._count
        lines = self.header()
        running = 0
        for bound, c in zip(self.buckets + (math.inf,), counts):
            running += c
            lines.append(f'{self.name}_bucket{{le="{_format_value(bound)}"}} {running}')
        lines += [f"{self.name}_sum {_format_value(total)}", f"{self.name}_count {n}"]
        return lines


class Registry:
    def __init__(self):
        self._metrics: dict[str, _Metric] = {}
        self._lock = threading.Lock()

    def _add(self, metric: _Metric):
        with self._lock:
            if metric.name in self._metrics:
                raise ValueError(f"metric {metric.name} is already registered")
            self._metrics[metric.name] = metric
        return metric

    def counter(self, name, help_text, labels=(), fn=None) -> Counter:
        return self._add(Counter(name, help_text, labels, fn))

    def gauge(self, name, help_text, labels=(), fn=None) -> Gauge:
        return self._add(Gauge(name, help_text, labels, fn))

    def histogram(self, name, help_text, buckets=LATENCY_BUCKETS) -> Histogram:
        return self._add(Histogram(name, help_text, buckets))

    def render(self) -> str:
        """The whole exposition, Prometheus text format 0.0.4."""
        with self._lock:
            metrics = list(self._metrics.values())
        lines = []
        for metric in metrics:
            lines += metric.render()
        return "\n".join(lines) + "\n"


def parse(text: str) -> dict[str, float]:
    """Sample lines of an exposition -> {'name{labels}': value} (for tests and the load script)."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        out[name] = float(value)
    return out


class _Handler(http.server.BaseHTTPRequestHandler):
    registry: Registry  # set on the subclass made by serve_metrics

    def do_GET(self):  # noqa: N802 (http.server's naming)
        if self.path.split("?")[0] not in ("/metrics", "/"):
            self.send_error(404, "metrics are at /metrics")
            return
        body = self.registry.render().encode()
        self.send_response(200)
        self.send_header("Content-Type", CONTENT_TYPE)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format, *args):  # scrapes every few seconds would flood the server's log
        pass


def serve_metrics(registry: Registry, host: str, port: int) -> http.server.ThreadingHTTPServer:
    """Serve GET /metrics on (host, port) from a daemon thread; port 0 picks a free one (see .server_address)."""
    handler = type("MetricsHandler", (_Handler,), {"registry": registry})
    httpd = http.server.ThreadingHTTPServer((host, port), handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, name="jaxllm-metrics", daemon=True).start()
    return httpd


def register_engine_metrics(registry: Registry, engine) -> None:
    """The engine's counters and gauges, read from its stats() / info() snapshots at scrape time: one set
    for the gRPC and the HTTP server alike. `engine()` returns the Engine, or None until it is loaded
    (every reading is 0 until then).

    The stats series are the tree's (jaxllm.contract.stats): every metric its leaves' metadata declare, derived
    ones (pool usage, used rBlocks and bytes per tier, borrowed rBlocks) computed by the tree's properties; none
    is listed here."""

    def read(fn):
        return lambda: fn(engine()) if engine() is not None else 0

    for export in stats.exports(EngineStats):
        m = export.metric
        register = registry.counter if m.kind == "counter" else registry.gauge
        register(m.name, m.help, m.labels, fn=read(lambda e, export=export: _samples(e.stats(), export)))
    for field, what in (("tensor_parallel", "devices one model is split over"),
                        ("instances", "serving instances on the mesh's instance axis"),
                        ("processes", "JAX processes (hosts) running the program"),
                        ("devices", "devices the mesh spans")):
        registry.gauge(f"jaxllm_mesh_{field}", f"the mesh: {what}",
                       fn=read(lambda e, field=field: getattr(e.info(), field)))
    registry.gauge("jaxllm_ready", "1 once the model is loaded and warm", fn=lambda: float(engine() is not None))


def _samples(tree: EngineStats, export: stats.Export):
    """One metric's reading in a stats tree: a number, or {label values: number} for a labelled metric (a leaf of
    rows gives one sample a row: its label values, then its value)."""
    if not export.metric.labels:
        ((path, _),) = export.sources
        return stats.read(tree, path)
    values = {}
    for path, series in export.sources:
        value = stats.read(tree, path)
        if series.label_values:
            values[series.label_values] = value
        else:
            values.update({tuple(row[:-1]): row[-1] for row in value})
    return values
