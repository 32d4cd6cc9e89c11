"""What the engine core asks of the executor that runs its steps (jaxllm.executor.model_runner.ModelRunner implements
it).

Written down here so the engine (pure Python: schedulers, the core, the front ends' checks) imports nothing
that runs jax: the front (jaxllm.llm) builds an executor and hands it to the core.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from jaxllm.contract import ExecutorStats, StepPlan

__all__ = ["DispatchedStep", "StepRunner"]


class DispatchedStep(Protocol):
    """A step queued on the devices."""

    plan: StepPlan

    def tokens(self) -> np.ndarray:
        """The sampled token of every sequence in the plan ([S] int32); waits for the devices."""
        ...

    def logprobs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """(token logprob [S], top ids [S, K], top logprobs [S, K]) when the step computed them, else None."""
        ...

    def prompt_logprobs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """The same per token of the plan [T] (for the prompt token each one precedes: StepPlan.targets), else
        None."""
        ...


class StepRunner(Protocol):
    """Runs planned steps on the devices, and counts what it compiled and ran."""

    def dispatch(self, plan: StepPlan, *, token_source: DispatchedStep | None = None) -> DispatchedStep:
        """Queue one step (its block copies first) and return without waiting; token_source: the decode step
        this one continues (its tokens, still on the devices, are this step's inputs)."""
        ...

    def logits(self, plan: StepPlan) -> np.ndarray:
        """Teacher-forced logits [T, vocab] float32 of every token of a prefill plan; waits."""
        ...

    def stats(self) -> ExecutorStats:
        """What it compiled and ran, the tuner's counters and the host store's (jaxllm.contract.stats), a snapshot
        (safe to call beside the engine thread: it only reads)."""
        ...
