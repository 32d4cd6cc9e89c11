"""`FixedTuner`: one variant for every bucket, the Kernels it was given (the engine's behaviour before tuning)."""

from __future__ import annotations

import dataclasses

from jaxllm.contract import StepKind, StepPlan
from pallas_kernels.dispatch import Kernels


@dataclasses.dataclass(frozen=True)
class FixedTuner:
    """A StepTuner (jaxllm.tuner.protocol) whose every bucket has one variant: `kernels`.

    kernels: already wrapped for the mesh when there is one (the runner does it). Choosing is free and
    predicts nothing, so stats() reports zeros under the same names a learned tuner fills. reason: why the
    defaults where a learned tuner was asked for (`load_tuner` fills it; the engine shows it), else empty.
    """

    kernels: Kernels
    reason: str = ""

    def __post_init__(self):
        if not isinstance(self.kernels, Kernels):
            raise ValueError(f"FixedTuner needs a pallas_kernels.dispatch.Kernels, got {type(self.kernels).__name__}")

    def variants(self, kind: StepKind, padded_size: int) -> tuple[Kernels, ...]:
        """(kernels,) for every bucket."""
        del kind, padded_size
        return (self.kernels,)

    def choose(self, plan: StepPlan, kind: StepKind, padded_size: int) -> int:
        """Always 0: the one variant."""
        del plan, kind, padded_size
        return 0

    def stats(self) -> dict[str, int]:
        """Nothing is predicted: zero predictions, zero cache hits."""
        return {"predictions": 0, "cache_hits": 0}
