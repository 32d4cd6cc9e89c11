"""Copies between the device KV pool and the host tier that one step needs first (plain NumPy, no jax).

A scheduler with a host tier (jaxllm.engine.host_tier) puts them on its StepPlan; the executor
(jaxllm.executor.host_store) runs them before the step, in this order: `dropped` host slots are forgotten, the
`out_*` rBlocks are copied to the host (read from the pool as the previous step left it), then the plan's
block_copies (DistKV recalls) run, then the `in_*` host slots are copied into the pool (a slot written by this
plan's out copies is read after that copy lands), then the `released` slots are forgotten (read for the last
time: a swapped sequence's; a host prefix-cache hit keeps its slot, so its rBlocks need no copy out when the
device evicts them again). Device
work runs in dispatch order, so an rBlock copied out may be handed to another sequence in the same plan, and
the step reads every copied-in rBlock after it landed.
"""

from __future__ import annotations

import dataclasses

import numpy as np

__all__ = ["HostCopies"]


@dataclasses.dataclass(frozen=True, eq=False)
class HostCopies:
    """out_blocks, out_slots [N] int32: rBlock out_blocks[i] goes to host slot out_slots[i]; in_slots, in_blocks
    [M] int32: host slot in_slots[i] comes back into rBlock in_blocks[i]; dropped [K] int32: host slots whose
    content nobody will read (evicted from the host's prefix cache, or a swapped sequence ended), forgotten
    first; released [R] int32: slots forgotten after the copies in (a swapped sequence's, read back now)."""

    out_blocks: np.ndarray
    out_slots: np.ndarray
    in_slots: np.ndarray
    in_blocks: np.ndarray
    dropped: np.ndarray
    released: np.ndarray

    def __post_init__(self):
        if len(self.out_blocks) != len(self.out_slots) or len(self.in_slots) != len(self.in_blocks):
            raise ValueError(f"HostCopies: {len(self.out_blocks)} out rBlocks for {len(self.out_slots)} slots, "
                             f"{len(self.in_slots)} in slots for {len(self.in_blocks)} rBlocks: they must pair up")

    @property
    def num_out(self) -> int:
        return len(self.out_blocks)

    @property
    def num_in(self) -> int:
        return len(self.in_blocks)

    def __len__(self) -> int:
        return self.num_out + self.num_in + len(self.dropped) + len(self.released)

    @staticmethod
    def join(parts: list[HostCopies | None]) -> HostCopies | None:
        """Several schedulers' copies as one (their slots are disjoint); None when there are none."""
        parts = [p for p in parts if p is not None and len(p)]
        if not parts:
            return None
        if len(parts) == 1:
            return parts[0]
        return HostCopies(**{f.name: np.concatenate([getattr(p, f.name) for p in parts]).astype(np.int32)
                             for f in dataclasses.fields(HostCopies)})
