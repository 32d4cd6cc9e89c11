"""rBlock allocator: pure Python over integer ids, no device code.

Each sequence gets a list of rBlock ids. The allocator keeps a sequence's rBlocks
consecutive where it can (BladeLLM's contiguous layout: the kernel then reads one long run)
and falls back to any free rBlock when it cannot: a fragmented table costs a little speed,
never a failure.

Prefix cache: a full rBlock whose KV is computed can be registered under a key naming its
content (the scheduler's chain of token hashes, so a key names the whole prefix up to the
block's end). A later sequence whose prompt starts with the same tokens shares those rBlocks
(reference-counted) instead of recomputing them. Shared rBlocks are full and never written
again: a sequence writes only past its shared prefix. When no sequence holds a registered
rBlock it stays cached (evictable) until a request needs the room; the least recently
released go first. Evictable rBlocks count as free.

Lending (DistKV, jaxllm.engine.distkv): an instance's pool is a BlockAllocator too. `lend` takes free
rBlocks out for another instance's request (evicting cached ones if it must), `take_back` returns them,
and `adopt` makes a lent rBlock one of this pool's own sequences' (a recall or a swap moved it there).

`BlockPool` is the contract the scheduler relies on: BlockAllocator (one instance) and
lending.LendingAllocator (one instance of several, global ids) both implement it.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from typing import Callable, Protocol


class OutOfBlocks(RuntimeError):
    """Not enough free rBlocks for a request; the scheduler preempts or waits."""


class BlockPool(Protocol):
    """What a Scheduler asks of the rBlocks it plans over (ids as its step plans' tables hold them)."""

    @property
    def num_blocks(self) -> int:
        """rBlocks this pool owns."""
        ...

    @property
    def num_free(self) -> int:
        """rBlocks a grow can still take (evictable cached ones included)."""
        ...

    @property
    def num_cached(self) -> int:
        """rBlocks registered in the prefix cache (held or evictable)."""
        ...

    def blocks(self, seq_id: int) -> list[int]:
        """seq_id's table (empty before its first grow)."""
        ...

    def grow(self, seq_id: int, num_blocks_total: int) -> list[int]:
        """Make seq_id hold num_blocks_total rBlocks; OutOfBlocks, taking nothing, when they are not free."""
        ...

    def free(self, seq_id: int) -> None:
        """seq_id's rBlocks go back (registered ones stay cached); idempotent."""
        ...

    def shrink(self, seq_id: int, num_blocks_total: int) -> None:
        """Keep the first num_blocks_total rBlocks of seq_id's table; the rest go back (a verify step's rejected
        drafts: never registered, so none stays cached)."""
        ...

    def lookup(self, keys: list[bytes]) -> list[int]:
        """The cached rBlocks of the longest run of keys from the first."""
        ...

    def share(self, seq_id: int, blocks: list[int]) -> None:
        """Start seq_id's table with these cached rBlocks (lookup's result)."""
        ...

    def register(self, block: int, key: bytes) -> None:
        """Held rBlock `block` is full and holds the KV `key` names (a pool may decline to cache it)."""
        ...


class BlockAllocator:
    """The BlockPool of one instance's rBlocks (see the module docstring)."""

    def __init__(self, num_blocks: int, *, on_evict: Callable[[bytes, int], object] | None = None):
        """on_evict(key, block): told of every cached rBlock evicted, while it still holds its KV."""
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.on_evict = on_evict
        self._free = list(range(num_blocks))  # sorted ascending; neither owned nor cached
        self._owned: dict[int, list[int]] = {}
        self._holders: dict[int, int] = {}  # rBlock -> how many sequences hold it (> 1: a shared prefix)
        self._cached: dict[bytes, int] = {}  # content key -> registered rBlock
        self._key_of: dict[int, bytes] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # registered, held by nobody; oldest first
        self._lent: set[int] = set()  # taken out by lend(): another instance's request holds them

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        """Registered rBlocks (held or evictable)."""
        return len(self._cached)

    def blocks(self, seq_id: int) -> list[int]:
        return self._owned.get(seq_id, [])

    def free_ids(self) -> list[int]:
        """Every rBlock no sequence holds and none is lent: free ones, then evictable cached ones."""
        return self._free + list(self._evictable)

    def owners(self) -> dict[int, list[int]]:
        return {k: list(v) for k, v in self._owned.items()}

    def holders(self, block: int) -> int:
        """How many sequences hold `block`."""
        return self._holders.get(block, 0)

    def is_registered(self, block: int) -> bool:
        return block in self._key_of

    def grow(self, seq_id: int, num_blocks_total: int) -> list[int]:
        """Make `seq_id` own `num_blocks_total` rBlocks, adding new ones; returns its full list."""
        owned = self._owned.setdefault(seq_id, [])
        need = num_blocks_total - len(owned)
        if need <= 0:
            return owned
        if need > self.num_free:
            if not owned:
                del self._owned[seq_id]
            raise OutOfBlocks(f"need {need} free rBlocks, have {self.num_free}")
        if need > len(self._free):
            self._evict(need - len(self._free))
        new = self._take(need, after=owned[-1] if owned else None)
        for block in new:
            self._holders[block] = 1
        owned.extend(new)
        return owned

    def free(self, seq_id: int) -> None:
        # Last rBlock first: a table's cached tail then leaves the cache before its head, which other
        # prompts may share (a lookup stops at the first missing rBlock, so a chain is only as good as its start).
        for block in reversed(self._owned.pop(seq_id, [])):
            self._release(block)

    def shrink(self, seq_id: int, num_blocks_total: int) -> None:
        """Keep the first num_blocks_total rBlocks of seq_id's table; the rest go back (last first, as free's)."""
        owned = self._owned.get(seq_id, [])
        if len(owned) > num_blocks_total:
            self.release(seq_id, owned[num_blocks_total:])

    def release(self, seq_id: int, blocks: list[int]) -> None:
        """These rBlocks of seq_id's table (any of them, in any order) go back; the rest of its table stays."""
        owned = self._owned.get(seq_id, [])
        gone = set(blocks)
        if not gone <= set(owned):
            raise ValueError(f"sequence {seq_id} does not hold rBlocks {sorted(gone - set(owned))}")
        self._owned[seq_id] = [b for b in owned if b not in gone]
        for block in reversed(blocks):
            self._release(block)

    def _release(self, block: int) -> None:
        """One holder of `block` lets it go: the last one frees it (or leaves it cached, if registered)."""
        self._holders[block] -= 1
        if self._holders[block]:
            return
        del self._holders[block]
        if block in self._key_of:
            self._evictable[block] = None  # newest last
        else:
            bisect.insort(self._free, block)

    # ----- lending (DistKV) -----

    @property
    def num_lent(self) -> int:
        return len(self._lent)

    def lend(self, count: int) -> list[int]:
        """Take `count` free rBlocks out for another instance (evicting the least recently released cached
        ones if the free list is short); OutOfBlocks, taking nothing, when fewer are free."""
        if count > self.num_free:
            raise OutOfBlocks(f"cannot lend {count} rBlocks: {self.num_free} free")
        if count > len(self._free):
            self._evict(count - len(self._free))
        blocks = self._take(count, after=None)
        self._lent.update(blocks)
        return blocks

    def take_back(self, blocks) -> None:
        """Lent rBlocks come back free (their request ended, they were recalled, or a reservation was dropped)."""
        for block in blocks:
            if block not in self._lent:
                raise ValueError(f"rBlock {block} was not lent")
            self._lent.remove(block)
            bisect.insort(self._free, block)

    def adopt(self, seq_id: int, block: int) -> None:
        """A lent rBlock becomes the last of `seq_id`'s own (a recall or a swap moved its contents here)."""
        if block not in self._lent:
            raise ValueError(f"rBlock {block} was not lent")
        self._lent.remove(block)
        self._owned.setdefault(seq_id, []).append(block)
        self._holders[block] = 1

    # ----- prefix cache -----

    def lookup(self, keys: list[bytes]) -> list[int]:
        """The registered rBlocks of the longest run of `keys` from the first (stops at the first miss)."""
        found = []
        for key in keys:
            block = self._cached.get(key)
            if block is None:
                break
            found.append(block)
        return found

    def share(self, seq_id: int, blocks: list[int]) -> None:
        """Give `seq_id`, which holds nothing yet, these registered rBlocks as the start of its table."""
        if self._owned.get(seq_id):
            raise ValueError(f"sequence {seq_id} already holds rBlocks; a shared prefix must come first")
        for block in blocks:
            if block not in self._key_of:
                raise ValueError(f"rBlock {block} is not registered in the prefix cache")
            self._evictable.pop(block, None)
            self._holders[block] = self._holders.get(block, 0) + 1
        self._owned[seq_id] = list(blocks)

    def register(self, block: int, key: bytes) -> None:
        """Record that held rBlock `block` is full and holds the KV that `key` names. A key already
        cached (another rBlock computed the same prefix) keeps its rBlock; so does a registered one."""
        if block not in self._holders:
            raise ValueError(f"rBlock {block} is not held by any sequence")
        if key in self._cached or block in self._key_of:
            return
        self._cached[key] = block
        self._key_of[block] = key

    def _evict(self, count: int) -> None:
        """Turn the `count` least recently released cached rBlocks into free ones."""
        for _ in range(count):
            block, _ = self._evictable.popitem(last=False)
            key = self._key_of.pop(block)
            del self._cached[key]
            if self.on_evict is not None:
                self.on_evict(key, block)
            bisect.insort(self._free, block)

    # ----- layout -----

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
