"""JAX's persistent compilation cache, on by option, and the count of XLA compiles it saves.

With a cache directory every compiled step (and every small helper jit) is written to disk, so a
restarted engine with the same model, shapes and JAX loads its executables instead of compiling
them: warm-up then costs tracing and a file read per bucket. The thresholds cache everything: JAX's
defaults skip programs that compiled in under a second, or (min entry size 0) take a backend
default size floor, which would leave the small buckets to compile on every restart.

The compiles are observed through jax.monitoring (the same event names in jax 0.10.2 and 0.11.2):
'/jax/core/compile/backend_compile_duration' fires for every executable XLA is asked for, a
persistent-cache hit included; '/jax/compilation_cache/cache_hits' for each one read from disk.
An XLA compile is the first without the second.
"""

from __future__ import annotations

import dataclasses
import os
import threading

import jax
from jax import monitoring

ENV_VAR = "JAXLLM_COMPILE_CACHE"
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
CACHE_WRITE_EVENT = "/jax/compilation_cache/cache_misses"  # fired when a compiled entry is written


def resolve_cache_dir(option: str | None) -> str | None:
    """The cache directory to use: the option if set, else $JAXLLM_COMPILE_CACHE, else None (off)."""
    return option or os.environ.get(ENV_VAR) or None


def enable_persistent_cache(directory: str) -> str:
    """Turn JAX's persistent compilation cache on for `directory` (created if missing), caching every
    program however small or fast to compile; returns its absolute path. Call it before the engine
    compiles; programs compiled earlier in the process are simply not on disk."""
    if not isinstance(directory, str) or not directory:
        raise ValueError(f"compile cache directory must be a non-empty path, got {directory!r}")
    path = os.path.abspath(os.path.expanduser(directory))
    os.makedirs(path, exist_ok=True)
    previous = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)  # 0 would mean "the backend's floor"
    if previous and os.path.abspath(previous) != path:
        # JAX opens its cache once, at the first compile after a directory is set: a different
        # directory opened earlier in this process must be closed for this one to take effect.
        from jax.experimental.compilation_cache import compilation_cache

        compilation_cache.reset_cache()
    return path


@dataclasses.dataclass(frozen=True)
class CompileEvents:
    """Process-wide counts since the listeners were installed: executables XLA was asked for
    (backend_requests), read from the persistent cache (cache_hits), written to it (cache_writes)."""

    backend_requests: int = 0
    cache_hits: int = 0
    cache_writes: int = 0

    @property
    def xla_compiles(self) -> int:
        """Executables XLA actually compiled (not read from disk)."""
        return self.backend_requests - self.cache_hits

    def __sub__(self, other: CompileEvents) -> CompileEvents:
        return CompileEvents(*(getattr(self, f.name) - getattr(other, f.name) for f in dataclasses.fields(self)))


class _Listener:
    """The one set of jax.monitoring listeners of this process (listeners cannot be removed)."""

    def __init__(self):
        self.counts = {BACKEND_COMPILE_EVENT: 0, CACHE_HIT_EVENT: 0, CACHE_WRITE_EVENT: 0}
        self.lock = threading.Lock()
        monitoring.register_event_listener(self._event)
        monitoring.register_event_duration_secs_listener(self._duration)

    def _event(self, event: str, **_) -> None:
        if event in self.counts:
            with self.lock:
                self.counts[event] += 1

    def _duration(self, event: str, duration: float, **_) -> None:
        del duration
        self._event(event)

    def snapshot(self) -> CompileEvents:
        with self.lock:
            c = dict(self.counts)
        return CompileEvents(c[BACKEND_COMPILE_EVENT], c[CACHE_HIT_EVENT], c[CACHE_WRITE_EVENT])


_listener: _Listener | None = None
_listener_lock = threading.Lock()


def compile_events() -> CompileEvents:
    """The process's compile events so far (the listeners are installed on the first call: take a
    snapshot before the work to count, and subtract)."""
    global _listener
    with _listener_lock:
        if _listener is None:
            _listener = _Listener()
    return _listener.snapshot()
