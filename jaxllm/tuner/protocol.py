"""The interface between the executor and a tuner: which `Kernels` a step of a bucket may run, and which it runs.

The executor compiles every variant of every bucket at warm-up (in `variants` order) and, per step,
asks `choose` for an index into them: the choice is host-side, so a step never waits on the device
for it, and the index (a small int) is what a multi-process run sends its followers.
`FixedTuner` (jaxllm/tuner/fixed.py) is today's behaviour; a learned tuner implements the same methods.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from jaxllm.contract import StepKind, StepPlan
from pallas_kernels.dispatch import Kernels


@runtime_checkable
class StepTuner(Protocol):
    """Chooses each step's Kernels among a few compiled variants per bucket."""

    def variants(self, kind: StepKind, padded_size: int) -> tuple[Kernels, ...]:
        """Every Kernels a step of this bucket may run (padded_size: sequences for decode, tokens for
        prefill: StepKind.size_unit); warm-up compiles each, in this order; variants(...)[0] is the fallback."""
        ...

    def choose(self, plan: StepPlan, kind: StepKind, padded_size: int) -> int:
        """Index into variants(kind, padded_size) for this step (host-side, no device work)."""
        ...

    def stats(self) -> dict[str, int]:
        """Counters for metrics, e.g. predictions, cache_hits (names without prefix)."""
        ...
