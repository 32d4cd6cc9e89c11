"""rBlock allocator: pure Python over integer ids, no device code.

Each sequence gets a list of rBlock ids. The allocator keeps a sequence's rBlocks
consecutive where it can (BladeLLM's contiguous layout: the kernel then reads one long run)
and falls back to any free rBlock when it cannot: a fragmented table costs a little speed,
never a failure.
"""

from __future__ import annotations

import bisect


class OutOfBlocks(RuntimeError):
    """Not enough free rBlocks for a request; the scheduler preempts or waits."""


class BlockAllocator:
    def __init__(self, num_blocks: int):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks))  # sorted ascending
        self._owned: dict[int, list[int]] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks(self, seq_id: int) -> list[int]:
        return self._owned.get(seq_id, [])

    def owners(self) -> dict[int, list[int]]:
        return {k: list(v) for k, v in self._owned.items()}

    def grow(self, seq_id: int, num_blocks_total: int) -> list[int]:
        """Make `seq_id` own `num_blocks_total` rBlocks, adding new ones; returns its full list."""
        owned = self._owned.setdefault(seq_id, [])
        need = num_blocks_total - len(owned)
        if need <= 0:
            return owned
        if need > len(self._free):
            if not owned:
                del self._owned[seq_id]
            raise OutOfBlocks(f"need {need} free rBlocks, have {len(self._free)}")
        owned.extend(self._take(need, after=owned[-1] if owned else None))
        return owned

    def free(self, seq_id: int) -> None:
        for block in self._owned.pop(seq_id, []):
            bisect.insort(self._free, block)

    def fragmentation(self) -> float:
        """Fraction of owned rBlocks that do not follow their predecessor in their sequence's table."""
        breaks = total = 0
        for blocks in self._owned.values():
            total += max(len(blocks) - 1, 0)
            breaks += sum(1 for a, b in zip(blocks, blocks[1:]) if b != a + 1)
        return breaks / total if total else 0.0

    def _take(self, count: int, after: int | None) -> list[int]:
        free = self._free
        # 1) continue right after the sequence's last rBlock if those are free
        if after is not None:
            i = bisect.bisect_left(free, after + 1)
            if i + count <= len(free) and free[i] == after + 1 and free[i + count - 1] == after + count:
                return self._pop_range(i, count)
        # 2) the first free run long enough (stop as soon as it is: a mostly free pool is one long run)
        run_start = 0
        for j in range(len(free)):
            if j and free[j] != free[j - 1] + 1:
                run_start = j
            if j + 1 - run_start >= count:
                return self._pop_range(run_start, count)
        # 3) any free rBlocks, lowest first
        return self._pop_range(0, count)

    def _pop_range(self, i: int, count: int) -> list[int]:
        taken = self._free[i:i + count]
        del self._free[i:i + count]
        return taken
