"""A thread-safe front of an `LLM`: one background thread runs steps while callers submit and cancel.

The server (and any multi-threaded caller) talks to this; `LLM.generate/stream` drive the same
scheduler and runner synchronously. Requests are validated on submit, so a bad one is refused
before it is queued; an accepted request always ends with exactly one final event (finished,
cancelled, or failed with the engine's error), never silently.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import queue
import threading
import time
from typing import Iterator

from jaxllm.llm import LLM, _TextTracker
from jaxllm.engine.runner import InFlight
from jaxllm.engine.sampling import SamplingParams
from jaxllm.engine.scheduler import Sequence, Status


class QueueFull(RuntimeError):
    """The engine already holds its maximum of waiting requests."""


class EngineStopped(RuntimeError):
    """The engine is shutting down and accepts no new requests."""


@dataclasses.dataclass(frozen=True)
class Event:
    """One streamed update of a request: new text and token ids; `finish_reason` set on the last."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None


@dataclasses.dataclass
class EngineStats:
    requests_total: int = 0
    requests_finished: int = 0
    requests_cancelled: int = 0
    requests_rejected: int = 0
    prompt_tokens_total: int = 0
    generated_tokens_total: int = 0
    steps_total: int = 0
    # Recent samples only (for percentiles and histograms), so a long-running server stays bounded.
    time_to_first_token_s: collections.deque = dataclasses.field(default_factory=lambda: collections.deque(maxlen=10000))
    time_per_output_token_s: collections.deque = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=10000))


class RequestStream:
    """Iterate for events; `cancel()` (or leaving the iteration) frees the request's rBlocks."""

    def __init__(self, engine: "Engine", request_id: int, prompt_tokens: int):
        self._engine = engine
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self._events: queue.Queue[Event] = queue.Queue()
        self.finished = threading.Event()

    def __iter__(self) -> Iterator[Event]:
        try:
            while True:
                event = self._events.get()
                yield event
                if event.finish_reason is not None:
                    return
        finally:
            if not self.finished.is_set():
                self.cancel()

    def cancel(self) -> None:
        self._engine.cancel(self.request_id)


@dataclasses.dataclass(eq=False)
class _Request:
    stream: RequestStream
    prompt_ids: list[int]
    params: SamplingParams
    submitted_at: float
    seq: Sequence | None = None
    tracker: _TextTracker | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    sent_tokens: int = 0


class Engine:
    def __init__(self, llm: LLM, *, max_waiting: int = 1024):
        self.llm = llm
        self.max_waiting = max_waiting
        self.stats = EngineStats()
        self._lock = threading.Condition()
        self._incoming: list[_Request] = []
        self._cancels: set[int] = set()
        self._requests: dict[int, _Request] = {}  # accepted, not yet final
        self._ids = itertools.count()
        self._accepting = True
        self._stop = False
        self._by_seq: dict[int, _Request] = {}  # engine thread only: admitted requests by sequence id
        self._thread = threading.Thread(target=self._loop, name="jaxllm-engine", daemon=True)
        self._thread.start()

    # ----- callers' side -----

    def submit(self, prompt: str | list[int], params: SamplingParams) -> RequestStream:
        """Queue a request; raises ValueError for bad input, QueueFull, EngineStopped."""
        if isinstance(prompt, str):
            ids = self.llm._encode(prompt, 0)
        else:
            ids = list(prompt)
            self.llm._check_ids(ids, "prompt")
        with self._lock:
            if not self._accepting:
                raise EngineStopped("the server is shutting down")
            waiting = len(self._incoming) + len(self.llm.scheduler.waiting)
            if waiting >= self.max_waiting:
                self.stats.requests_rejected += 1
                raise QueueFull(f"{waiting} requests are already waiting (limit {self.max_waiting})")
            request_id = next(self._ids)
            stream = RequestStream(self, request_id, len(ids))
            request = _Request(stream, ids, params, time.monotonic())
            self._requests[request_id] = request
            self._incoming.append(request)
            self.stats.requests_total += 1
            self.stats.prompt_tokens_total += len(ids)
            self._lock.notify_all()
        return stream

    def cancel(self, request_id: int) -> None:
        with self._lock:
            if request_id in self._requests:
                self._cancels.add(request_id)
                self._lock.notify_all()

    def queue_depth(self) -> int:
        with self._lock:
            return len(self._incoming) + len(self.llm.scheduler.waiting)

    def num_running(self) -> int:
        return len(self.llm.scheduler.running)

    def pool_usage(self) -> float:
        allocator = self.llm.allocator
        return 1.0 - allocator.num_free / allocator.num_blocks

    def stop_accepting(self) -> None:
        with self._lock:
            self._accepting = False

    def shutdown(self, grace_s: float = 10.0) -> None:
        """Stop accepting; let running requests finish for up to grace_s, then cancel the rest."""
        self.stop_accepting()
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            with self._lock:
                if not self._requests:
                    break
            time.sleep(0.01)
        with self._lock:
            self._cancels.update(self._requests)
            self._stop = True
            self._lock.notify_all()
        self._thread.join(timeout=max(grace_s, 1.0) + 5.0)

    # ----- the engine thread -----

    def _loop(self) -> None:
        scheduler = self.llm.scheduler
        while True:
            with self._lock:
                while not (self._stop or self._incoming or self._cancels or scheduler.has_work()
                           or self.llm._inflight is not None):
                    self._lock.wait()
                incoming, self._incoming = self._incoming, []
                cancels, self._cancels = self._cancels, set()
                stop = self._stop
            for request in incoming:
                request.seq = self.llm._submit(request.prompt_ids, request.params)
                request.tracker = _TextTracker(self.llm.tokenizer, request.params.stop)
                self._by_seq[request.seq.seq_id] = request
            for request_id in cancels:
                request = self._requests.get(request_id)
                if request is not None and request.seq is not None:
                    # A step in flight that holds it still runs; update drops its result.
                    scheduler.cancel(request.seq)
                    self._finish(request, "cancelled")
            if stop and not scheduler.has_work():
                self.llm._inflight = None  # only finished sequences' steps can be left: nothing to record
                return
            if not (scheduler.has_work() or self.llm._inflight is not None):
                continue
            try:
                self._step()
            except Exception as e:  # a failed step fails its requests, not the server
                self.llm._inflight = None  # dropped unrecorded: harmless (LLM._advance says why)
                for request in list(self._by_seq.values()):
                    if request.seq is not None:
                        scheduler.cancel(request.seq)
                        self._finish(request, "error", error=f"{type(e).__name__}: {e}")

    @property
    def _inflight(self) -> InFlight | None:
        """The step dispatched and not yet recorded (the LLM's: one pipeline for both front ends)."""
        return self.llm._inflight

    def _step(self) -> None:
        """Record one step's tokens with LLM._advance (the next decode step queued before they are read),
        then stream them to their requests."""
        llm = self.llm
        # Requests or cancels that arrived meanwhile are taken in before the next step instead: a
        # continuation would delay admission by a step, or run a step for a sequence about to go.
        # (An unlocked peek: a stale answer costs at most one step of latency, never correctness.)
        plan = llm._advance(run_ahead=not (self._incoming or self._cancels), idle_ok=True)
        if plan is None:
            return
        self.stats.steps_total += 1
        now = time.monotonic()
        for seq_id in plan.seq_ids:
            request = self._by_seq.get(int(seq_id))
            if request is None:
                continue
            seq = request.seq
            new_ids = seq.output_ids[request.sent_tokens:]
            for token in new_ids:
                request.tracker.push(token)
            if new_ids:
                if request.first_token_at is None:
                    request.first_token_at = now
                    self.stats.time_to_first_token_s.append(now - request.submitted_at)
                elif request.last_token_at is not None:
                    self.stats.time_per_output_token_s.append((now - request.last_token_at) / len(new_ids))
                request.last_token_at = now
                self.stats.generated_tokens_total += len(new_ids)
            if request.tracker.stopped and seq.status is not Status.FINISHED:
                llm.scheduler.finish(seq, "stop")
            if seq.status is Status.FINISHED:
                request.tracker.finish()
                self._emit(request, new_ids, final=True)
                self._finish(request, seq.finish_reason, emitted=True)
            elif new_ids:
                self._emit(request, new_ids, final=False)

    def _emit(self, request: _Request, new_ids: list[int], final: bool) -> None:
        request.sent_tokens += len(new_ids)
        text = request.tracker.take(final=final)
        if text or new_ids or final:
            request.stream._events.put(Event(
                text, list(new_ids), request.seq.finish_reason if final else None,
                prompt_tokens=len(request.prompt_ids), completion_tokens=len(request.seq.output_ids)))

    def _finish(self, request: _Request, reason: str, *, emitted: bool = False, error: str | None = None) -> None:
        with self._lock:
            if self._requests.pop(request.stream.request_id, None) is None:
                return
        if request.seq is not None:
            self._by_seq.pop(request.seq.seq_id, None)
        if reason == "cancelled":
            self.stats.requests_cancelled += 1
        else:
            self.stats.requests_finished += 1
        if not emitted:
            completion = len(request.seq.output_ids) if request.seq else 0
            request.stream._events.put(Event("", [], reason, prompt_tokens=len(request.prompt_ids),
                                             completion_tokens=completion, error=error))
        request.stream.finished.set()
