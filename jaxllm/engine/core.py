"""EngineCore: the one step loop. `add(request) / cancel(request_id) / step() -> outputs`.

It owns the scheduler (a StepScheduler: jaxllm.engine.scheduling), the executor that runs the steps (a
StepRunner: jaxllm.engine.step_runner) and the output processing of every request; the synchronous
`LLM` and the threaded server `Engine` are thin front ends over it. Not thread-safe: one thread
drives it (the threaded Engine's own thread does).

The pipeline. At most one step is in flight: dispatched, its tokens not yet recorded by
`scheduler.update`. scheduler.plan() runs only when none is (it may preempt, and a preempted
sequence must have no step outstanding); while one is, the only step queued behind it is its
continuation (Scheduler.plan_continuation), which takes its input tokens from the device, so
host dispatch overlaps device work. A step dropped unrecorded (an exception, an abandoned
stream: `drop_in_flight`) is harmless: the scheduler never moved past it, and plan() recomputes.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Sequence as Seq

import numpy as np

from jaxllm.contract import CoreStats, EngineStats, SamplingParams, StepPlan
from jaxllm.contract.stats import counters
from jaxllm.engine.output import RequestClock, RequestTimings, TextStream
from jaxllm.engine.requests import RequestLimits, check_params, check_token_ids
from jaxllm.engine.scheduling import StepScheduler
from jaxllm.engine.sequence import Sequence, Status
from jaxllm.engine.step_runner import DispatchedStep, StepRunner


@dataclasses.dataclass(frozen=True)
class Request:
    """One generation request: prompt token ids (already encoded) and how to sample.

    arrival: time.monotonic() when the request reached the front end (TTFT counts from it);
    None means when `add` is called. checked: the RequestLimits its front end already checked it against
    (jaxllm.engine.requests); the core checks it again only against other limits than its own, so a request
    is checked once on its way in.
    """

    prompt_ids: tuple[int, ...]
    params: SamplingParams
    arrival: float | None = None
    checked: RequestLimits | None = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self):
        ids = self.prompt_ids
        if not (type(ids) is tuple and all(type(t) is int for t in ids)):  # a long prompt's ids: no copy
            object.__setattr__(self, "prompt_ids", tuple(int(t) for t in ids))
        if not isinstance(self.params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(self.params).__name__}")


@dataclasses.dataclass(frozen=True)
class RequestOutput:
    """What one step produced for one request: new text and token ids; `finish_reason` set on the last.

    The one output type from the core to every front end (the threaded Engine's streams yield it too).
    finish_reason: "stop" (EOS, stop token or stop string), "length" (max_tokens or the context
    limit), "cancelled", or "error" (set by the threaded Engine when a step failed, with `error` its
    message). timings are set on the last output. logprobs: None unless the request asked
    (SamplingParams.logprobs = k); then one entry per new token id, `(its logprob, ((id, logprob), ...))`
    with the k most likely tokens first. prompt_logprobs: None unless the request asked
    (SamplingParams.prompt_logprobs = k); then, on the first output after its prompt was read, one entry per
    prompt token: None for the first, then `(its logprob, ((id, logprob), ...))` given the tokens before it.
    """

    request_id: int
    text: str
    token_ids: tuple[int, ...]
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str | None = None
    timings: RequestTimings | None = None
    logprobs: tuple[tuple[float, tuple[tuple[int, float], ...]], ...] | None = None
    error: str | None = None  # finish_reason "error": what failed
    prompt_logprobs: tuple[tuple[float, tuple[tuple[int, float], ...]] | None, ...] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass(frozen=True)
class EngineInfo:
    """What a loaded engine is (for ModelInfo endpoints and logs); never changes while it runs."""

    model: str
    architecture: str
    dtype: str
    kv_dtype: str
    context_limit: int
    vocab_size: int
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    block_size: int  # tokens per rBlock
    num_blocks: int  # rBlocks per layer
    max_seqs: int
    max_tokens_per_step: int
    max_queue: int | None = None  # the threaded Engine's waiting limit (None: unbounded)
    # The mesh: the model split tensor_parallel ways, `instances` of it, over `devices` devices of
    # `processes` JAX processes (hosts). One device: 1, 1, 1, 1.
    tensor_parallel: int = 1
    instances: int = 1
    processes: int = 1
    devices: int = 1
    max_logprobs: int = 0  # top tokens a request may ask log-probabilities of (0: none)


@dataclasses.dataclass(eq=False)
class _Live:
    """A request the core holds: its sequence, its text, its clock."""

    seq: Sequence
    text: TextStream
    clock: RequestClock
    sent: int = 0  # output token ids already handed out
    prompt_scored: bool = False  # its prompt log-probabilities were handed out (when it asked for them)

    def take_prompt_logprobs(self):
        """The prompt's log-probabilities, once, when every prompt token has its entry; else None."""
        entries = self.seq.prompt_logprobs
        if self.prompt_scored or self.seq.params.prompt_logprobs is None or len(entries) < len(self.seq.prompt_ids):
            return None
        self.prompt_scored = True
        return tuple(entries)


class EngineCore:
    """The step loop over a scheduler and an executor; see the module docstring.

    Args:
      scheduler: one instance's Scheduler, or the InstanceSchedulers of several (one StepScheduler contract).
      executor: runs the steps on the devices (a StepRunner: jaxllm.executor.model_runner.ModelRunner).
      tokenizer: encodes nothing here; decodes tokens and names EOS.
      limits: the request limits every `add` is checked against.
      pipeline: queue the next decode step before reading this one's tokens (same tokens either way).
    """

    def __init__(self, scheduler: StepScheduler, executor: StepRunner, tokenizer, limits: RequestLimits, *,
                 pipeline: bool = True):
        self.scheduler = scheduler
        self.executor = executor
        self.tokenizer = tokenizer
        self.limits = limits
        self.pipeline = pipeline
        self._inflight: DispatchedStep | None = None
        self._last_plan: StepPlan | None = None
        self._live: dict[int, _Live] = {}  # request id -> state, until its final output
        self._by_seq: dict[int, int] = {}  # seq_id -> request id
        self._ids = itertools.count()
        self._counts = counters(CoreStats)  # its snapshot's counters, at zero

    # ----- requests -----

    def add(self, request: Request) -> int:
        """Queue a request (checked against the limits unless its front end did: ValueError if it breaks one);
        returns its id."""
        if request.checked is self.limits:
            ids, params = list(request.prompt_ids), request.params
        else:
            ids = check_token_ids(request.prompt_ids, self.limits)
            params = check_params(request.params, len(ids), self.limits)
        request_id = next(self._ids)
        seq = self.scheduler.add(ids, params, max_len=self.limits.context_limit)
        arrival = time.monotonic() if request.arrival is None else request.arrival
        self._live[request_id] = _Live(seq, TextStream(self.tokenizer, params.stop), RequestClock(arrival))
        self._by_seq[seq.seq_id] = request_id
        self._counts["requests_total"] += 1
        self._counts["prompt_tokens_total"] += len(ids)
        return request_id

    def cancel(self, request_id: int) -> RequestOutput | None:
        """End a request now and free its rBlocks; returns its final output ("cancelled"), None if it
        already ended (or never was). A step in flight that holds it still runs; its result is dropped."""
        live = self._live.get(request_id)
        if live is None:
            return None
        self.scheduler.cancel(live.seq)
        return self._final(request_id, live, "cancelled")

    def has_work(self) -> bool:
        """Whether step() has anything to do: requests to run, or a step in flight to record."""
        return self.scheduler.has_work() or self._inflight is not None

    def has_step_in_flight(self) -> bool:
        return self._inflight is not None

    @property
    def num_requests(self) -> int:
        """Requests added and not yet finished."""
        return len(self._live)

    @property
    def last_plan(self) -> StepPlan | None:
        """The plan of the step the last step() recorded (None before any): what a caller timing steps by kind reads."""
        return self._last_plan

    # ----- the loop -----

    def step(self, run_ahead: bool = True) -> list[RequestOutput]:
        """Record one step's tokens (dispatching it first if none is in flight); the outputs of every
        request that got text, tokens or its end. With run_ahead (and pipeline), the next decode step
        is dispatched before this one's tokens are read. Idle (no work): []."""
        inflight, self._inflight = self._inflight, None
        if inflight is None:
            plan = self.scheduler.plan()
            if plan is None:
                if self.scheduler.has_work():
                    raise RuntimeError("the scheduler has waiting work but could plan no step (KV pool too small?)")
                return []
            inflight = self.executor.dispatch(plan)
        following = None
        if run_ahead and self.pipeline:
            continuation = self.scheduler.plan_continuation(inflight.plan)
            if continuation is not None:
                following = self.executor.dispatch(continuation, token_source=inflight)
        # Every sequence of the step is running now (plan() admitted it), so the ones that may have
        # advanced or finished are among these.
        candidates = list(self.scheduler.running)
        self.scheduler.update(inflight.plan, inflight.tokens(), self.tokenizer.eos_ids, inflight.logprobs(),
                              inflight.prompt_logprobs())
        self._last_plan = inflight.plan
        self._inflight = following
        self._counts["steps_total"] += 1
        return self._collect(candidates, time.monotonic())

    def drain(self) -> list[RequestOutput]:
        """Record the step in flight, if any, queueing nothing after it (returns with none in flight)."""
        return self.step(run_ahead=False) if self._inflight is not None else []

    def drop_in_flight(self) -> None:
        """Forget the step in flight unrecorded (after an error, or when its caller left): harmless,
        see the module docstring."""
        self._inflight = None

    def _collect(self, candidates: list[Sequence], now: float) -> list[RequestOutput]:
        outputs = []
        for seq in candidates:
            request_id = self._by_seq.get(seq.seq_id)
            if request_id is None:
                continue  # not a request of this core (logits())
            live = self._live[request_id]
            new_ids = seq.output_ids[live.sent:]
            for j, token in enumerate(new_ids):
                live.text.push(token)
                if live.text.stopped:
                    if j + 1 < len(new_ids):  # a verify step kept tokens past the stop string: not generated
                        seq.truncate_output(live.sent + j + 1)
                        new_ids = new_ids[:j + 1]
                    break
            live.clock.tokens_at(now, len(new_ids))
            self._counts["generated_tokens_total"] += len(new_ids)
            if live.text.stopped and seq.status is not Status.FINISHED:
                # A continuation already queued for it is dropped by update (it skips finished sequences).
                self.scheduler.finish(seq, "stop")
            if seq.status is Status.FINISHED:
                outputs.append(self._final(request_id, live, seq.finish_reason))
            elif new_ids:
                logprobs = self._logprobs(seq, live.sent)
                live.sent = len(seq.output_ids)
                outputs.append(RequestOutput(request_id, live.text.take(), tuple(new_ids), len(seq.prompt_ids),
                                             len(seq.output_ids), logprobs=logprobs,
                                             prompt_logprobs=live.take_prompt_logprobs()))
        return outputs

    def _final(self, request_id: int, live: _Live, reason: str) -> RequestOutput:
        del self._live[request_id]
        self._by_seq.pop(live.seq.seq_id, None)
        seq = live.seq
        new_ids = tuple(seq.output_ids[live.sent:])
        logprobs = self._logprobs(seq, live.sent)
        live.sent = len(seq.output_ids)
        live.text.finish()
        timings = live.clock.timings()
        counts = self._counts
        counts["requests_cancelled" if reason == "cancelled" else "requests_finished"] += 1
        if timings.ttft_s is not None:
            counts["ttft_count"] += 1
            counts["ttft_sum_s"] += timings.ttft_s
        if timings.tpot_s is not None:
            counts["tpot_count"] += 1
            counts["tpot_sum_s"] += timings.tpot_s
        return RequestOutput(request_id, live.text.take(final=True), new_ids, len(seq.prompt_ids),
                             len(seq.output_ids), reason, timings, logprobs,
                             prompt_logprobs=live.take_prompt_logprobs())

    @staticmethod
    def _logprobs(seq: Sequence, start: int):
        """The log-probabilities of seq's output tokens from `start` on (one per token), None if not asked."""
        if seq.params.logprobs is None:
            return None
        return tuple(seq.output_logprobs[start:])

    # ----- teacher forcing -----

    def logits(self, token_ids: Seq[int]) -> np.ndarray:
        """Teacher-forced logits [len(token_ids), vocab] (float32), prefilled in chunks."""
        ids = check_token_ids(token_ids, self.limits, "token_ids", max_tokens=self.limits.context_limit)
        if self.has_work():
            raise RuntimeError("logits() cannot run while generation is in progress")
        # One sequence, prefilled chunk by chunk; max_new_tokens=1 so the scheduler never samples past it.
        # Every position's logits are wanted: nothing may come from the prefix cache.
        seq = self.scheduler.add(ids, SamplingParams(max_new_tokens=1), max_len=len(ids) + 1, reuse_prefix=False)
        chunks = []
        try:
            while seq.num_computed < len(ids):
                plan = self.scheduler.plan()
                chunks.append(self.executor.logits(plan))
                self.scheduler.record_computed(plan)
        finally:
            self.scheduler.cancel(seq)
        return np.concatenate(chunks, axis=0)

    # ----- snapshots -----

    def stats(self) -> EngineStats:
        """Counters and current load: each part's own snapshot, composed (safe to call from another thread: it
        only reads)."""
        return EngineStats(core=CoreStats(**self._counts), scheduler=self.scheduler.stats(),
                           executor=self.executor.stats())
