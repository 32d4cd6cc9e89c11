"""A thread-safe front of an EngineCore: one background thread runs steps while callers submit and cancel.

The servers (gRPC, HTTP, any multi-threaded caller) talk to this; `LLM.generate/stream` drive the
same EngineCore synchronously. It is built from the core, the tokenizer and the engine's EngineInfo
(`Engine(llm.core, llm.tokenizer, llm.info())` where an `LLM` is loaded), and front ends read what
they need from it (`tokenizer`, `limits`, `info()`, `stats()`). Requests are checked on submit
against the core's one RequestLimits, so a bad one is refused before it is queued; an accepted
request always ends with exactly one final output (finished, cancelled, or "error" with the engine's
message), never silently. Streams yield the core's own RequestOutputs, under this engine's request ids.
"""

from __future__ import annotations

import dataclasses
import itertools
import queue
import threading
import time
from typing import Callable, Iterator, Sequence

from jaxllm.contract import EngineStats, SamplingParams
from jaxllm.engine.core import EngineCore, EngineInfo, Request, RequestOutput
from jaxllm.engine.requests import RequestLimits, check_params, prompt_token_ids


class QueueFull(RuntimeError):
    """The engine already holds its maximum of waiting requests."""


class EngineStopped(RuntimeError):
    """The engine is shutting down and accepts no new requests."""


class RequestStream:
    """Iterate for the request's outputs; `cancel()` (or leaving the iteration) frees its rBlocks."""

    def __init__(self, engine: "Engine", request_id: int, prompt_tokens: int):
        self._engine = engine
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self._outputs: queue.Queue[RequestOutput] = queue.Queue()
        self.finished = threading.Event()

    def put(self, output: RequestOutput) -> None:
        """Deliver an output (the engine's thread does); the last one marks the stream finished."""
        self._outputs.put(output)
        if output.finished:
            self.finished.set()

    def __iter__(self) -> Iterator[RequestOutput]:
        try:
            while True:
                output = self._outputs.get()
                yield output
                if output.finished:
                    return
        finally:
            if not self.finished.is_set():
                self.cancel()

    def cancel(self) -> None:
        self._engine.cancel(self.request_id)


@dataclasses.dataclass(eq=False)
class _Pending:
    """A request accepted by submit, not yet handed to the core."""

    stream: RequestStream
    request: Request


class Engine:
    """A thread-safe front of an EngineCore (see the module docstring).

    Args:
      core: the engine core; from now on only this engine's thread drives it.
      tokenizer: encodes text prompts (the core's own).
      info: what the core runs (`LLM.info()`); `info()` returns it with `max_queue` set.
      max_waiting: requests waiting to run before `submit` raises QueueFull.
      step_error: the error a failed step's requests end with, from its exception (default: the exception's
        type and text); a multi-process server names the process that died instead (jaxllm/serve.py).
    """

    def __init__(self, core: EngineCore, tokenizer, info: EngineInfo, *, max_waiting: int = 1024,
                 step_error: Callable[[Exception], str] | None = None):
        limits = core.limits
        if (info.context_limit, info.vocab_size) != (limits.context_limit, limits.vocab_size):
            raise ValueError(f"info describes another engine: context limit {info.context_limit} and vocabulary "
                             f"{info.vocab_size}, where the core's limits have {limits.context_limit} and "
                             f"{limits.vocab_size}")
        self.tokenizer = tokenizer
        self.max_waiting = max_waiting
        self._step_error = step_error or (lambda e: f"{type(e).__name__}: {e}")
        self._core = core
        self._info = dataclasses.replace(info, max_queue=max_waiting)
        self._lock = threading.Condition()
        self._incoming: list[_Pending] = []
        self._cancels: set[int] = set()
        self._streams: dict[int, RequestStream] = {}  # accepted, not yet final, by request id
        self._ids = itertools.count()
        self._accepting = True
        self._failure: str | None = None  # why the engine cannot run any more steps (fail)
        self._stop = False
        self._requests_rejected = 0
        self._core_ids: dict[int, int] = {}  # engine thread only: request id -> core request id
        self._by_core_id: dict[int, RequestStream] = {}  # engine thread only
        self._thread = threading.Thread(target=self._loop, name="jaxllm-engine", daemon=True)
        self._thread.start()

    @property
    def limits(self) -> RequestLimits:
        """What one request may ask for: the core's RequestLimits, the one object every check reads."""
        return self._core.limits

    # ----- callers' side -----

    def submit(self, prompt: str | Sequence[int], params: SamplingParams) -> RequestStream:
        """Check a request against `limits` and queue it; raises ValueError for bad input
        (jaxllm.engine.requests' rules), QueueFull, EngineStopped."""
        ids = prompt_token_ids(prompt, self.tokenizer, self.limits)
        check_params(params, len(ids), self.limits)
        return self.submit_checked([Request(ids, params, checked=self.limits)])[0]

    def submit_checked(self, requests: Sequence[Request]) -> list[RequestStream]:
        """Queue requests their caller has checked against `limits` (gRPC and HTTP do, once per request,
        with jaxllm.engine.requests, and say so in Request.checked: the core does not check them again), all of
        them or none: QueueFull if the queue has no room for every one, EngineStopped. A request not checked
        against these limits is checked by the core, and one it refuses ends with one "error" output."""
        now = time.monotonic()
        with self._lock:
            if not self._accepting:
                raise EngineStopped(self._failure or "the server is shutting down")
            waiting = len(self._incoming) + self._core.scheduler.stats().waiting
            if waiting + len(requests) > self.max_waiting:
                self._requests_rejected += len(requests)
                more = f": no room for {len(requests)} more" if len(requests) > 1 else ""
                raise QueueFull(f"{waiting} requests are already waiting (limit {self.max_waiting}){more}")
            streams = []
            for request in requests:
                if request.arrival is None:
                    request = dataclasses.replace(request, arrival=now)
                stream = RequestStream(self, next(self._ids), len(request.prompt_ids))
                self._streams[stream.request_id] = stream
                self._incoming.append(_Pending(stream, request))
                streams.append(stream)
            self._lock.notify_all()
        return streams

    def cancel(self, request_id: int) -> None:
        with self._lock:
            if request_id in self._streams:
                self._cancels.add(request_id)
                self._lock.notify_all()

    def info(self) -> EngineInfo:
        """What is loaded (model, dtypes, limits, pool) and this engine's queue limit; frozen."""
        return self._info

    def stats(self) -> EngineStats:
        """Counters and current load, a snapshot; requests queued here and not yet in the core count as
        waiting (and as accepted)."""
        with self._lock:
            incoming = [p.request for p in self._incoming]
            rejected = self._requests_rejected
        stats = self._core.stats()
        prompt_tokens = sum(len(r.prompt_ids) for r in incoming)
        core = dataclasses.replace(stats.core, requests_total=stats.core.requests_total + len(incoming),
                                   requests_rejected=rejected,
                                   prompt_tokens_total=stats.core.prompt_tokens_total + prompt_tokens)
        scheduler = dataclasses.replace(stats.scheduler, waiting=stats.scheduler.waiting + len(incoming))
        return dataclasses.replace(stats, core=core, scheduler=scheduler)

    def stop_accepting(self) -> None:
        with self._lock:
            self._accepting = False

    def shutdown(self, grace_s: float = 10.0) -> None:
        """Stop accepting; let running requests finish for up to grace_s, then cancel the rest."""
        self.stop_accepting()
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            with self._lock:
                if not self._streams:
                    break
            time.sleep(0.01)
        with self._lock:
            self._cancels.update(self._streams)
            self._stop = True
            self._lock.notify_all()
        self._thread.join(timeout=max(grace_s, 1.0) + 5.0)

    def fail(self, error: str) -> None:
        """The engine can run no more steps (a process of a multi-process run died): refuse new requests
        (EngineStopped naming `error`) and end every accepted request now with one "error" output naming
        it. Runs on the caller's thread and waits for nothing: the engine's thread may be blocked for good
        in a step whose collective lost a peer."""
        with self._lock:
            self._accepting = False
            self._failure = error
            self._stop = True
            self._cancels.update(self._streams)  # should the engine's thread come back, it frees them
            streams = list(self._streams.values())
            self._streams.clear()
            self._incoming.clear()
            self._lock.notify_all()
        for stream in streams:
            stream.put(RequestOutput(stream.request_id, "", (), stream.prompt_tokens, 0, "error", error=error))

    def idle(self) -> bool:
        """No request accepted and unfinished, and no step in flight."""
        with self._lock:
            return not (self._streams or self._incoming) and not self._core.has_work()

    # ----- the engine thread -----

    def _loop(self) -> None:
        core = self._core
        while True:
            with self._lock:
                while not (self._stop or self._incoming or self._cancels or core.has_work()):
                    self._lock.wait()
                incoming, self._incoming = self._incoming, []
                cancels, self._cancels = self._cancels, set()
                stop = self._stop
            for pending in incoming:
                stream = pending.stream
                try:
                    core_id = core.add(pending.request)
                except ValueError as e:  # its caller did not check it (submit_checked says what happens)
                    self._deliver(stream, RequestOutput(stream.request_id, "", (), stream.prompt_tokens, 0, "error",
                                                        error=f"{type(e).__name__}: {e}"))
                    continue
                self._core_ids[stream.request_id] = core_id
                self._by_core_id[core_id] = stream
            for request_id in cancels:
                core_id = self._core_ids.get(request_id)
                if core_id is not None:
                    # A step in flight that holds it still runs; the core drops its result.
                    self._emit(core.cancel(core_id))
            if stop and not core.scheduler.has_work():
                core.drop_in_flight()  # only finished sequences' steps can be left: nothing to record
                return
            if not core.has_work():
                continue
            try:
                # Requests or cancels that arrived meanwhile are taken in before the next step instead:
                # a continuation would delay admission by a step, or run a step for a sequence about to
                # go. (An unlocked peek: a stale answer costs at most one step of latency.)
                for output in core.step(run_ahead=not (self._incoming or self._cancels)):
                    self._emit(output)
            except Exception as e:  # a failed step fails its requests, not the server
                core.drop_in_flight()  # dropped unrecorded: harmless (EngineCore says why)
                error = self._step_error(e)
                for core_id in list(self._by_core_id):
                    self._emit(core.cancel(core_id), error=error)

    def _emit(self, output: RequestOutput | None, error: str | None = None) -> None:
        """Hand a core output to its stream, under the stream's request id; `error` makes it an "error"."""
        if output is None:
            return
        stream = self._by_core_id.get(output.request_id)
        if stream is None:
            return
        if output.finished:
            del self._by_core_id[output.request_id]
            self._core_ids.pop(stream.request_id, None)
        if error is not None:
            output = dataclasses.replace(output, finish_reason="error", error=error)
        self._deliver(stream, dataclasses.replace(output, request_id=stream.request_id))

    def _deliver(self, stream: RequestStream, output: RequestOutput) -> None:
        if stream.finished.is_set():  # fail() ended it already
            return
        if output.finished:
            with self._lock:
                self._streams.pop(stream.request_id, None)
        stream.put(output)
