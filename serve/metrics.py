"""Prometheus text-format metrics with only the standard library: counters, gauges, histograms.

    registry = Registry()
    requests = registry.counter("jaxllm_requests_total", "Generate calls by final status", ["code"])
    requests.inc(code="OK")
    registry.gauge("jaxllm_queue_depth", "requests waiting", fn=engine.queue_depth)
    serve_metrics(registry, "127.0.0.1", 9464)  # GET /metrics in a daemon thread

Values read from elsewhere (the engine's counters, pool use) are gauges or counters with `fn`,
evaluated at scrape time, so nothing has to push them.
"""

from __future__ import annotations

import bisect
import http.server
import math
import threading
from typing import Callable, Iterable

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
    (every reading is 0 until then)."""

    def read(fn):
        return lambda: fn(engine()) if engine() is not None else 0

    r = registry
    r.counter("jaxllm_prompt_tokens_total", "prompt tokens accepted", fn=read(lambda e: e.stats().prompt_tokens_total))
    r.counter("jaxllm_generation_tokens_total", "tokens generated",
              fn=read(lambda e: e.stats().generated_tokens_total))
    r.counter("jaxllm_engine_requests_cancelled_total", "requests cancelled (client gone, deadline, shutdown)",
              fn=read(lambda e: e.stats().requests_cancelled))
    r.counter("jaxllm_engine_requests_rejected_total", "requests refused because the queue was full",
              fn=read(lambda e: e.stats().requests_rejected))
    r.counter("jaxllm_engine_steps_total", "engine steps run", fn=read(lambda e: e.stats().steps_total))
    r.counter("jaxllm_compiles_total", "step functions compiled (flat after warm-up when shapes are covered)",
              fn=read(lambda e: e.stats().compile_count))
    r.counter("jaxllm_xla_compiles_total", "executables XLA compiled for engine steps (not persistent-cache reads)",
              fn=read(lambda e: e.stats().xla_compiles))
    r.counter("jaxllm_persistent_cache_hits_total", "step executables read from the persistent compilation cache",
              fn=read(lambda e: e.stats().persistent_cache_hits))
    r.counter("jaxllm_bucket_steps_total", "steps served per shape bucket (kind decode|prefill, padded size)",
              ("kind", "size"), fn=read(lambda e: {(k, s): n for k, s, n in e.stats().bucket_steps}))
    r.counter("jaxllm_padding_tokens_total", "padding tokens run: padded minus real tokens, over served steps",
              fn=read(lambda e: e.stats().padding_tokens_total))
    r.counter("jaxllm_tuner_events_total", "the step tuner's counters (stat: predictions, cache_hits, ...)",
              ("stat",), fn=read(lambda e: {(name,): v for name, v in e.stats().tuner}))
    r.gauge("jaxllm_queue_depth", "requests waiting to run", fn=read(lambda e: e.stats().queue_depth))
    r.gauge("jaxllm_running_requests", "requests in the running batch", fn=read(lambda e: e.stats().running))
    r.gauge("jaxllm_kv_pool_usage_ratio", "fraction of KV rBlocks in use", fn=read(lambda e: e.stats().pool_usage))
    r.gauge("jaxllm_kv_pool_blocks", "KV rBlocks in the pool", fn=read(lambda e: e.stats().pool_blocks))
    r.counter("jaxllm_prefix_cache_hit_tokens_total", "tokens whose KV came from the prefix cache instead of a prefill",
              fn=read(lambda e: e.stats().prefix_cache_hit_tokens))
    r.gauge("jaxllm_prefix_cache_blocks", "full KV rBlocks registered in the prefix cache (held or evictable)",
            fn=read(lambda e: e.stats().prefix_cache_blocks))
    # Lending between instances (DistKV) and preemptions: (register, name, help, EngineStats field).
    for register, name, what, field in (
            (r.gauge, "jaxllm_kv_borrowed_blocks", "KV rBlocks instances hold on other instances now (DistKV lending)",
             "borrowed_blocks"),
            (r.gauge, "jaxllm_kv_lending_instances", "instances lending rBlocks to others now", "lending_instances"),
            (r.counter, "jaxllm_kv_loans_total", "rBlocks lent between instances", "loans_total"),
            (r.counter, "jaxllm_kv_recalled_blocks_total", "lent rBlocks copied home when their debtor had room again",
             "recalled_blocks_total"),
            (r.counter, "jaxllm_kv_swapped_pairs_total", "circular debts broken by swapping two rBlocks",
             "swapped_pairs_total"),
            (r.counter, "jaxllm_dist_attention_steps_total",
             "steps that ran DistAttention (some sequence had borrowed rBlocks)", "dist_steps_total"),
            (r.counter, "jaxllm_preemptions_total",
             "sequences preempted (rBlocks freed: swapped to the host tier, or recomputed later)",
             "preemptions_total")):
        register(name, what, fn=read(lambda e, field=field: getattr(e.stats(), field)))
    _register_tier_metrics(r, read)
    for field, what in (("tensor_parallel", "devices one model is split over"),
                        ("instances", "serving instances on the mesh's instance axis"),
                        ("processes", "JAX processes (hosts) running the program"),
                        ("devices", "devices the mesh spans")):
        r.gauge(f"jaxllm_mesh_{field}", f"the mesh: {what}", fn=read(lambda e, field=field: getattr(e.info(), field)))
    r.gauge("jaxllm_ready", "1 once the model is loaded and warm", fn=lambda: float(engine() is not None))


def _register_tier_metrics(r: Registry, read) -> None:
    """Where rBlocks live (device pool, host tier) and what moved between the tiers (all 0 without a host tier)."""
    def tiers(device, host):
        return read(lambda e: {("device",): device(e.stats()), ("host",): host(e.stats())})

    r.gauge("jaxllm_kv_tier_blocks", "KV rBlocks each tier has (tier: device = the pool, host = the host tier)",
            ("tier",), fn=tiers(lambda s: s.pool_blocks, lambda s: s.host_blocks))
    r.gauge("jaxllm_kv_tier_used_blocks", "KV rBlocks in use per tier (the host's: swapped sequences and its prefix "
            "cache)", ("tier",), fn=tiers(lambda s: s.pool_blocks - s.pool_blocks_free, lambda s: s.host_blocks_used))
    r.gauge("jaxllm_kv_tier_used_bytes", "bytes of KV in use per tier (the host's: what its copied runs hold)",
            ("tier",), fn=tiers(lambda s: (s.pool_blocks - s.pool_blocks_free) * s.kv_block_bytes,
                                lambda s: s.host_bytes))
    r.gauge("jaxllm_host_cache_blocks", "KV rBlocks the host tier's prefix cache holds",
            fn=read(lambda e: e.stats().host_cached_blocks))
    for name, what, field in (
            ("jaxllm_kv_swap_outs_total", "preempted sequences swapped to the host tier instead of recomputed",
             "swap_outs_total"),
            ("jaxllm_kv_swap_ins_total", "swapped sequences copied back from the host tier", "swap_ins_total"),
            ("jaxllm_kv_swap_fallbacks_total", "preempted sequences recomputed because the host tier was full",
             "swap_fallbacks_total"),
            ("jaxllm_host_cache_spilled_blocks_total", "prefix-cache rBlocks the device evicted and the host kept",
             "host_spilled_blocks_total"),
            ("jaxllm_host_cache_hit_blocks_total", "host prefix-cache rBlocks copied back instead of prefilled",
             "host_cache_hit_blocks_total"),
            ("jaxllm_kv_swap_cached_blocks_total", "swapped rBlocks the host prefix cache held already (not copied "
             "out again)", "swap_cached_blocks_total")):
        r.counter(name, what, fn=read(lambda e, field=field: getattr(e.stats(), field)))
    r.counter("jaxllm_kv_host_copied_blocks_total", "KV rBlocks copied between the tiers (direction: out = to the "
              "host, in = back)", ("direction",), fn=read(lambda e: {("out",): e.stats().host_blocks_out_total,
                                                                     ("in",): e.stats().host_blocks_in_total}))
    r.counter("jaxllm_kv_host_copy_seconds_total", "seconds each direction had a copy between the tiers in flight",
              ("direction",), fn=read(lambda e: {("out",): e.stats().host_copy_out_seconds,
                                                 ("in",): e.stats().host_copy_in_seconds}))
