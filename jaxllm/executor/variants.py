"""`KernelVariants`: the Kernels a step of each bucket may run, as its tuner lists them, wrapped for the mesh.

The tuner (jaxllm.tuner.protocol.StepTuner) lists each bucket's variants and picks one per step; the worker
compiles and runs them by index, and a multi-process run sends the index alone (jaxllm.executor.calls). Both
sides ask this table, so process 0 and its followers run the same Kernels for the same call.
"""

from __future__ import annotations

import dataclasses

from jaxllm.contract import StepKind
from jaxllm.tuner.protocol import StepTuner
from pallas_kernels.dispatch import Kernels
from sharding.dist_attention import DistAttention
from sharding.tensor_parallel import tensor_parallel_kernels

__all__ = ["KernelVariants"]


class KernelVariants:
    """The tuner's variants per bucket, wrapped for the mesh (sharding.tensor_parallel), asked once per bucket."""

    def __init__(self, tuner: StepTuner, mesh):
        self.tuner = tuner
        self.mesh = mesh
        self._listed: dict[tuple[StepKind, int], tuple[Kernels, ...]] = {}

    def use(self, tuner: StepTuner) -> None:
        """Take another tuner before any bucket's variants were asked for (before warm-up); ValueError after, since
        programs compiled for the old tuner's variants would no longer match the indices the new one picks."""
        if self._listed:
            raise ValueError(f"the tuner is replaced before warm-up; {len(self._listed)} buckets already listed the "
                             f"variants of {type(self.tuner).__name__}")
        self.tuner = tuner

    def variants(self, kind: StepKind, padded_size: int) -> tuple[Kernels, ...]:
        """The bucket's variants in the tuner's order (variants()[0] is the fallback); ValueError if it lists none."""
        key = (kind, padded_size)
        if key not in self._listed:
            listed = tuple(self.tuner.variants(kind, padded_size))
            if not listed:
                raise ValueError(f"the tuner lists no variant for the {kind.label} bucket {padded_size}: it must "
                                 f"list at least one (variants()[0] is the fallback)")
            self._listed[key] = tuple(tensor_parallel_kernels(k, self.mesh) for k in listed)
        return self._listed[key]

    def kernels_for(self, kind: StepKind, padded_size: int, variant: int = 0, *, borrowed: bool = False) -> Kernels:
        """The kernels a step of this bucket runs (`padded_size`: StepKind.size_unit): the bucket's variant number
        `variant` (0: the tuner's fallback); a borrowed step: variant 0 with DistAttention."""
        listed = self.variants(kind, padded_size)
        if not 0 <= variant < len(listed):
            raise ValueError(f"variant {variant} of the {kind.label} bucket {padded_size} does not exist: the tuner "
                             f"lists {len(listed)}")
        if borrowed:
            return dataclasses.replace(listed[0], distributed=DistAttention())
        return listed[variant]
