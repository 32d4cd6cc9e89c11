"""How big an engine's KV pool and host tier are: `MemoryPlan` and the rules that size them (the builder's memory
planning, jaxllm.builder).

A GPU's pool is planned, not guessed: after the weights load, the largest programs a step can run are compiled over
an abstract pool (the executor's `step_memory`: nothing allocated) and XLA's memory analysis says what each needs
while it runs; the pool takes the free memory less the largest of those and a margin, so an admitted step never runs
out of memory. A CPU host has no allocator limit: the pool is a few full-length sequences, capped.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Callable

import jax
import numpy as np

from jaxllm.executor.host_store import MAX_COPY_BYTES as HOST_COPY_BYTES
from pallas_kernels import compat

__all__ = ["HOST_COPY_BYTES", "MemoryPlan", "host_tier_blocks", "plan_memory", "pool_blocks"]

_CPU_KV_BYTES = 1 << 30  # pool cap on a CPU host, where memory is shared with everything else
# Kept free beside the pool and the largest step's needs (a planned pool, GPU): the allocator's fragmentation, the
# step inputs, the penalty state (allocated after the plan: 41 MB a device for a 32K vocabulary), recall copies, the
# compiled programs' code.
_MEMORY_MARGIN_FRACTION = 0.03
_MEMORY_MARGIN_MIN = 1 << 30


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """How a planned pool was sized (one device's bytes): the free memory after the weights, what each of the
    largest step programs needs while it runs (the executor's step_memory), the margin kept, and the pool's
    budget."""

    free_bytes: int
    step_bytes: dict[str, int]
    margin_bytes: int
    pool_bytes: int

    def describe(self) -> str:
        largest = max(self.step_bytes, key=self.step_bytes.get)
        return (f"{self.free_bytes / 2**30:.2f} GiB free a device; the largest step ({largest}) needs "
                f"{self.step_bytes[largest] / 2**30:.2f} GiB, margin {self.margin_bytes / 2**30:.2f} GiB: "
                f"{self.pool_bytes / 2**30:.2f} GiB for the KV pool")


def plan_memory(free: int, step_bytes: dict[str, int], *, host_tier: bool = False) -> MemoryPlan:
    """The pool's share of `free` bytes (a device's, after the weights) beside the largest of the step programs'
    needs (`step_bytes`) and the margin: _MEMORY_MARGIN_FRACTION of free, at least _MEMORY_MARGIN_MIN, plus the
    host tier's runs in flight (each way) where it is on."""
    margin = max(_MEMORY_MARGIN_MIN, int(free * _MEMORY_MARGIN_FRACTION)) + (2 * HOST_COPY_BYTES if host_tier else 0)
    largest = max(step_bytes.values(), default=0)
    return MemoryPlan(free_bytes=free, step_bytes=dict(step_bytes), margin_bytes=margin,
                      pool_bytes=max(free - largest - margin, 0))


def blocks_in(budget: int, per_block: int) -> int:
    """rBlocks of per_block bytes in budget bytes (MemoryError below one)."""
    if budget < per_block:
        raise MemoryError(f"no room for a KV pool: one rBlock needs {per_block} bytes a device, {max(budget, 0)} are "
                          f"left for it")
    return budget // per_block


def pool_blocks(*, per_block: int, free: int | None, max_context: int, block_size: int,
                kv_memory_fraction: float | None, step_memory: Callable[[int], dict[str, int]], host_tier: bool,
                progress: bool) -> tuple[int, MemoryPlan | None]:
    """(rBlocks of each instance's pool, the MemoryPlan where one was made) when EngineOptions.num_blocks is not
    set. per_block: one rBlock's bytes on one device; free: the device's free bytes after the weights (None: a CPU
    host). GPU: kv_memory_fraction of the free memory if set; else planned (plan_memory) from step_memory(blocks),
    the largest programs' needs over an abstract pool of that many rBlocks."""
    if free is None:  # a CPU host: no allocator limit to plan against
        # Enough for a few full-length sequences, within a modest share of host memory.
        return blocks_in(min(_CPU_KV_BYTES, 4 * max_context * per_block // block_size), per_block), None
    plan = None
    if kv_memory_fraction is not None:
        budget = int(free * kv_memory_fraction)
    else:
        # The largest pool the free memory could hold sizes the probe: its tables are the widest the planned pool
        # can have, so the programs' needs measured are an upper bound of the planned pool's.
        started = time.perf_counter()
        plan = plan_memory(free, step_memory(blocks_in(free, per_block)), host_tier=host_tier)
        budget = plan.pool_bytes
        if progress:
            print(f"[jaxllm] memory: {plan.describe()} (planned in {time.perf_counter() - started:.1f} s)",
                  file=sys.stderr, flush=True)
    if jax.process_count() > 1:  # every process must build the same pool: process 0's figure
        from jax.experimental import multihost_utils

        budget = int(multihost_utils.broadcast_one_to_all(np.float32(budget)))
    return blocks_in(budget, per_block), plan


def host_tier_blocks(wanted: int, per_block: int, instances: int) -> int:
    """rBlocks each instance's host tier holds (0: no tier): `wanted` bytes (EngineOptions.host_kv_bytes) over one
    rBlock's bytes; ValueError where the run or the backend cannot hold it."""
    processes = jax.process_count()
    if wanted and processes > 1:
        raise ValueError(f"host_kv_bytes {wanted}: a host tier serves the instances of one process; this run has "
                         f"{processes} processes (set host_kv_bytes=0 / --host-kv-gib 0)")
    if wanted and wanted < per_block:
        raise ValueError(f"host_kv_bytes {wanted} is less than one rBlock ({per_block} bytes): use 0 to turn "
                         f"the host tier off, or at least {per_block}")
    limit = compat.pinned_host_limit_bytes(jax.devices()[0]) if wanted else None
    needed = instances * wanted + HOST_COPY_BYTES  # every instance's tier + the copies in flight
    if limit is not None and needed > limit:
        raise ValueError(f"host_kv_bytes {wanted} x {instances} instance(s) + {HOST_COPY_BYTES >> 20} MiB of copies "
                         f"in flight exceeds the backend's pinned host memory, {limit >> 30} GiB: lower "
                         f"--host-kv-gib, or raise the cap with {compat.PINNED_HOST_LIMIT_VAR}=<GiB> in the "
                         f"environment before the process starts")
    return wanted // per_block
