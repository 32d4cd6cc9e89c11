"""The scheduling contract: what the engine core asks of a scheduler, written down (vLLM's SchedulerInterface).

Two classes implement it: `scheduler.Scheduler` (one instance, one rBlock pool) and
`instances.InstanceSchedulers` (several instances that lend each other rBlocks: DistKV-LLM). The core
talks to either through `StepScheduler` alone, so neither carries methods only the other needs. Pure
Python: a scheduler plans steps as plain values (jaxllm.contract.StepPlan) and never touches a device.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Protocol

import numpy as np

from jaxllm.contract import SamplingParams, SchedulerStats, StepPlan
from jaxllm.engine.sequence import Sequence

__all__ = ["StepScheduler"]


class StepScheduler(Protocol):
    """What the engine core asks of a scheduler (see the module docstring)."""

    block_size: int
    max_seqs: int
    max_tokens_per_step: int

    def add(self, prompt_ids: list[int], params: SamplingParams, max_len: int, *, reuse_prefix: bool = True
            ) -> Sequence:
        """Queue a sequence (checked by the caller); returns it, waiting."""
        ...

    def sequence(self, seq_id: int) -> Sequence | None:
        """The waiting or running sequence with this id (a plan's seq_ids), None once it ended."""
        ...

    def cancel(self, seq: Sequence) -> None:
        """End a sequence now ("cancelled"), freeing its rBlocks; no record of it stays."""
        ...

    def finish(self, seq: Sequence, reason: str) -> None:
        """End a sequence early (a stop string matched, its client left); no record of it stays."""
        ...

    def has_work(self) -> bool:
        """Some sequence waits or runs."""
        ...

    @property
    def running(self) -> list[Sequence]:
        """The running sequences, oldest first (a step's tokens can only have gone to these)."""
        ...

    def plan(self) -> StepPlan | None:
        """The next step (rBlock copies it needs first included), or None when nothing can run. Only
        called with no step in flight."""
        ...

    def plan_continuation(self, prev: StepPlan) -> StepPlan | None:
        """The decode step that follows `prev` while prev's tokens are still on the device, or None
        (changing nothing a dropped step could leave inconsistent)."""
        ...

    def update(self, plan: StepPlan, sampled: np.ndarray, eos_id: int | Collection[int],
               logprobs: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
               prompt_logprobs: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None) -> list[Sequence]:
        """Record a step's sampled tokens (and log-probabilities: of the sampled tokens [S], of the prompt
        tokens the step's tokens precede [T]); returns the sequences that received one."""
        ...

    def record_computed(self, plan: StepPlan) -> None:
        """Record a step whose KV was computed but whose tokens were not sampled (teacher-forced logits):
        every row's sequence has its KV up to its kv_len."""
        ...

    def stats(self) -> SchedulerStats:
        """A snapshot of the queue and the pool, with the lending ledger's and the host tier's (all 0 where there is
        none), safe to read from another thread."""
        ...
