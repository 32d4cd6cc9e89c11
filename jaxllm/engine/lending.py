"""One instance's rBlock allocator when instances lend each other rBlocks: the scheduler's view of an RManager.

An engine of several instances (the mesh's `instance` axis) gives each instance its own Scheduler, and each
Scheduler one `LendingAllocator` over that instance's `distkv.RManager`. The scheduler is the one-instance
scheduler, unchanged: it grows, frees and reads tables through the BlockAllocator interface, and sees
global rBlock ids, `instance * blocks_per_instance + local id`, so a table says where every rBlock lives and
slot arithmetic (block * block_size + row) keeps working. The runner turns them back into each instance's
local ids.

With lending on, `grow` takes local rBlocks first and borrows the rest through the GManager; it raises
OutOfBlocks (the scheduler then preempts, or keeps a request waiting) only when the whole mesh has fewer free
rBlocks than needed, and `num_free` is the mesh's. With lending off, an instance is on its own: the same
engine with every instance limited to its pool (the comparison `scripts/bench_mesh.py` draws).

Prefix caching is per pool, and a lent rBlock belongs to another pool: with several instances the prefix
cache is off (lookup finds nothing, register keeps nothing).
"""

from __future__ import annotations

from jaxllm.engine.allocator import OutOfBlocks
from jaxllm.engine.distkv import Placement, RManager

__all__ = ["LendingAllocator"]


class LendingAllocator:
    """The BlockAllocator interface of one instance's rBlocks, lent ones included (global ids)."""

    def __init__(self, rmanager: RManager, gmanager, *, lending: bool = True):
        self.rmanager = rmanager
        self.gmanager = gmanager
        self.lending = lending
        self.blocks_per_instance = rmanager.spec.num_blocks
        self.instance = rmanager.instance

    # ----- what the scheduler reads -----

    @property
    def num_blocks(self) -> int:
        """This instance's own pool."""
        return self.blocks_per_instance

    @property
    def num_free(self) -> int:
        """rBlocks a grow can still take: the mesh's free ones when lending, else this pool's."""
        return self.gmanager.total_free() if self.lending else self.rmanager.num_free

    @property
    def num_cached(self) -> int:
        return 0

    def global_id(self, placement: Placement) -> int:
        return placement.instance * self.blocks_per_instance + placement.block

    def blocks(self, seq_id: int) -> list[int]:
        """seq_id's table as global rBlock ids (empty before its first grow)."""
        if seq_id not in self.rmanager.requests():
            return []
        return [self.global_id(p) for p in self.rmanager.table(seq_id).table]

    # ----- what the scheduler changes -----

    def grow(self, seq_id: int, num_blocks_total: int) -> list[int]:
        """Make seq_id hold num_blocks_total rBlocks (local first, then borrowed); raises OutOfBlocks,
        taking nothing, when they are not free (in the mesh with lending, in this pool without)."""
        have = len(self.rmanager.table(seq_id).table) if seq_id in self.rmanager.requests() else 0
        need = num_blocks_total - have
        if not self.lending and need > self.rmanager.num_free:
            raise OutOfBlocks(f"instance {self.instance}: sequence {seq_id} needs {need} more rBlocks, its pool has "
                              f"{self.rmanager.num_free} free (lending is off)")
        if seq_id not in self.rmanager.requests():
            self.rmanager.allocate(seq_id, num_blocks_total)
        else:
            self.rmanager.grow(seq_id, num_blocks_total)
        return self.blocks(seq_id)

    def free(self, seq_id: int) -> None:
        """seq_id's rBlocks go back: local ones to this pool, lent ones to their creditors."""
        if seq_id in self.rmanager.requests():
            self.rmanager.finish(seq_id)

    # ----- the prefix cache: off across instances -----

    def lookup(self, keys: list[bytes]) -> list[int]:
        del keys
        return []

    def share(self, seq_id: int, blocks: list[int]) -> None:
        if blocks:
            raise ValueError(f"sequence {seq_id}: no prefix cache across instances")

    def register(self, block: int, key: bytes) -> None:
        del block, key
