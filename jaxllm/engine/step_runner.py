"""What the engine core asks of the executor that runs its steps (jaxllm.executor.model_runner.ModelRunner implements
it).

Written down here so the engine (pure Python: schedulers, the core, the front ends' checks) imports nothing
that runs jax: the front (jaxllm.llm) builds an executor and hands it to the core.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from jaxllm.contract import StepKind, StepPlan

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

    compile_count: int  # programs traced (each a compile)
    xla_compiles: int  # the XLA compiles behind them (a persistent-cache read is not one)
    persistent_cache_hits: int
    bucket_steps: dict[tuple[StepKind, int], int]  # (kind, padded size) -> served steps
    padding_tokens: int  # padded minus real tokens over those steps
    borrowed_steps: int  # steps that ran DistAttention (some sequence had rBlocks on another instance)
    block_bytes: int  # one rBlock's bytes, all layers (the pool's rBlocks are all alike)

    def host_tier_stats(self) -> dict[str, float]:
        """The host tier's store: bytes_used (host bytes its runs hold), copy_out_seconds / copy_in_seconds (from
        the start to the landing of every copy so far), reserved_seconds (warm-up's reservation of host memory);
        {} without a host tier."""
        ...

    def dispatch(self, plan: StepPlan, *, token_source: DispatchedStep | None = None) -> DispatchedStep:
        """Queue one step (its block copies first) and return without waiting; token_source: the decode step
        this one continues (its tokens, still on the devices, are this step's inputs)."""
        ...

    def logits(self, plan: StepPlan) -> np.ndarray:
        """Teacher-forced logits [T, vocab] float32 of every token of a prefill plan; waits."""
        ...

    def tuner_stats(self) -> dict[str, int]:
        """The tuner's counters (predictions, cache hits, ...)."""
        ...
