"""One instance's rBlock pool when instances lend each other rBlocks: the BlockPool of an RManager.

An engine of several instances (the mesh's `instance` axis) gives each instance its own Scheduler, and each
Scheduler one `LendingAllocator` over that instance's `distkv.RManager`. The scheduler is the one-instance
scheduler, unchanged: it grows, frees and reads tables through the BlockPool contract
(jaxllm.engine.allocator), and sees global rBlock ids, `instance * blocks_per_instance + local id`, so a
table says where every rBlock lives and slot arithmetic (block * block_size + row) keeps working. The
executor turns them back into each instance's local ids.

With lending on, `grow` takes local rBlocks first and borrows the rest through the GManager; it raises
OutOfBlocks (the scheduler then preempts, or keeps a request waiting) only when the whole mesh has fewer free
rBlocks than needed, and `num_free` is the mesh's. With lending off, an instance is on its own: the same
engine with every instance limited to its pool (the comparison `scripts/bench_mesh.py` draws).

A sequence marked `stripe` (a long prompt the whole mesh prefills: jaxllm.engine.spread) grows striped instead:
its table's entry e on instance e % instances (distkv's striped requests), so each instance holds an equal share
of it and does an equal share of its attention, in prefill and in decode.

Prefix caching is the one-instance cache (allocator.BlockAllocator) of each instance's own pool: a sequence
shares the cached rBlocks of its home instance, and registers the full rBlocks it computes there. A borrowed
rBlock is not cached: when its sequence ends it goes back to its creditor, which may hand it to anyone at
once, so a cache entry for it would name memory the home instance no longer holds (keeping it would pin
another instance's pool outside that pool's own eviction order).
"""

from __future__ import annotations

from jaxllm.engine.allocator import OutOfBlocks
from jaxllm.engine.distkv import GManager, Placement, RManager

__all__ = ["LendingAllocator"]


class LendingAllocator:
    """The BlockPool (jaxllm.engine.allocator) of one instance's rBlocks, lent ones included (global ids)."""

    def __init__(self, rmanager: RManager, gmanager: GManager, *, lending: bool = True):
        self.rmanager = rmanager
        self.gmanager = gmanager
        self.lending = lending
        self.blocks_per_instance = rmanager.spec.num_blocks
        self.instance = rmanager.instance
        self._first = self.instance * self.blocks_per_instance  # this pool's first global id
        self._striped: set[int] = set()  # sequences whose tables grow striped across the instances

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
        """rBlocks of this pool in its prefix cache."""
        return self.rmanager.pool.num_cached

    def global_id(self, placement: Placement) -> int:
        return placement.instance * self.blocks_per_instance + placement.block

    def blocks(self, seq_id: int) -> list[int]:
        """seq_id's table as global rBlock ids (empty before its first grow)."""
        if seq_id not in self.rmanager.requests():
            return []
        nb = self.blocks_per_instance
        return [p.instance * nb + p.block for p in self.rmanager.placements(seq_id)]

    # ----- what the scheduler changes -----

    def stripe(self, seq_id: int) -> None:
        """From now on seq_id's table grows striped across every instance (the module docstring); lending only."""
        if not self.lending:
            raise ValueError(f"sequence {seq_id}: a striped table borrows by design; lending is off")
        self._striped.add(seq_id)

    def grow(self, seq_id: int, num_blocks_total: int) -> list[int]:
        """Make seq_id hold num_blocks_total rBlocks (local first, then borrowed); raises OutOfBlocks,
        taking nothing, when they are not free (in the mesh with lending, in this pool without)."""
        have = len(self.rmanager.placements(seq_id)) if seq_id in self.rmanager.requests() else 0
        need = num_blocks_total - have
        if not self.lending and need > self.rmanager.num_free:
            raise OutOfBlocks(f"instance {self.instance}: sequence {seq_id} needs {need} more rBlocks, its pool has "
                              f"{self.rmanager.num_free} free (lending is off)")
        stripe = len(self.gmanager.instances()) if seq_id in self._striped else 1
        if seq_id not in self.rmanager.requests():
            self.rmanager.allocate(seq_id, num_blocks_total, stripe=stripe)
        else:
            self.rmanager.grow(seq_id, num_blocks_total, stripe=stripe)
        return self.blocks(seq_id)

    def free(self, seq_id: int) -> None:
        """seq_id's rBlocks go back: local ones to this pool (registered ones stay cached), lent ones to their
        creditors."""
        self._striped.discard(seq_id)
        if seq_id in self.rmanager.requests():
            self.rmanager.finish(seq_id)

    def shrink(self, seq_id: int, num_blocks_total: int) -> None:
        """Keep the first num_blocks_total rBlocks of seq_id's table; the rest go back (lent ones to their
        creditors)."""
        if seq_id in self.rmanager.requests():
            self.rmanager.shrink(seq_id, num_blocks_total)

    # ----- the prefix cache: this instance's own rBlocks -----

    def lookup(self, keys: list[bytes]) -> list[int]:
        """The cached rBlocks of this pool for the longest run of keys from the first (global ids)."""
        return [self._first + b for b in self.rmanager.pool.lookup(keys)]

    def share(self, seq_id: int, blocks: list[int]) -> None:
        """Start seq_id, which holds nothing yet, with these cached rBlocks (lookup's global ids)."""
        self.rmanager.start_shared(seq_id, [b - self._first for b in blocks])

    def register(self, block: int, key: bytes) -> None:
        """Cache a full rBlock of this pool; a borrowed one is not cached (the module docstring says why)."""
        local = block - self._first
        if 0 <= local < self.blocks_per_instance:
            self.rmanager.pool.register(local, key)
