"""The host tier's ledger: which host slots hold which rBlocks' KV. Pure Python over integer ids, no device code.

DistKV-LLM's point (docs/ARCHITECTURE.md, decision 12: rBlocks live in tiers): an instance short of KV memory
uses whatever memory is free, host memory included. The host tier is a number of slots of one rBlock each in
pinned host memory; the executor holds the data (jaxllm.executor.host_store), this ledger says what each slot
holds, and every copy between the tiers rides on the next StepPlan as its HostCopies (jaxllm.contract).

Two kinds of content:
  - swapped sequences: a preempted sequence's computed KV, all of its rBlocks, kept until it resumes (copied
    back in) or ends; never evicted. `swap_out` declines when the tier has no room (the scheduler then
    recomputes, as without a tier: nothing is lost either way). The rBlocks whose content key the host prefix
    cache holds already (a conversation's history restored from the host, then preempted) are not copied again:
    the sequence holds those cached slots as its own (pinned: neither evictable nor found by lookups) until it
    resumes or ends, when they rejoin the cache.
  - the host prefix cache: full rBlocks the device's prefix cache evicted (`spill`), under their content keys,
    least recently used evicted first when room is needed; a later prompt with that prefix copies them back
    (`lookup`, `claim`, then `restore`) instead of prefilling them. A hit keeps its slot (the cache is inclusive):
    when the device evicts those rBlocks again, their spill finds them on the host and copies nothing (a
    multi-turn conversation's history crosses the link once, not at every turn).

Copies in flight. A copy planned here runs on the device before the step of the plan it rides on, in dispatch
order, so the device rBlock a swap-out read may be handed to another sequence at once, and a slot written by a
plan's out copies may be read back by the same or a later plan (the executor waits for it to land). A slot
read by a plan's in copies is freed (a swap's) or rejoins the host cache (a hit's) only once that plan's copies
are taken (`take_copies`): until then the executor has not read it, and a new out copy must not land in it.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from jaxllm.contract import HostCopies, HostTierStats
from jaxllm.contract.stats import counters

__all__ = ["HostTier"]


class HostTier:
    """One scheduler's host slots (see the module docstring). Slot ids are global: first_slot + local, so the
    tiers of several instances share one id space in the executor's store."""

    def __init__(self, num_slots: int, *, first_slot: int = 0):
        if num_slots <= 0:
            raise ValueError(f"a host tier needs at least one slot (rBlock), got {num_slots}")
        self.num_slots = num_slots
        self.first_slot = first_slot
        self._free = list(range(first_slot + num_slots - 1, first_slot - 1, -1))  # a stack: lowest id on top
        self._swapped: dict[int, list[int]] = {}  # seq_id -> its slots, in table order
        self._cached: OrderedDict[bytes, int] = OrderedDict()  # content key -> slot, oldest spill first
        self._key_of: dict[int, bytes] = {}
        self._claimed: dict[int, bytes] = {}  # slot -> key: looked up for an admission, not evictable meanwhile
        self._pinned: dict[int, bytes] = {}  # slot -> key: a host-cached rBlock a swapped sequence holds as its own
        self._pinned_keys: set[bytes] = set()  # ... their keys
        self._releasing: list[int] = []  # slots read by the pending copies: free once they are taken
        self._rejoining: list[tuple[int, bytes]] = []  # host-cache hits read by the pending copies: cached again then
        self._out: list[tuple[int, int]] = []  # pending (rBlock, slot)
        self._in: list[tuple[int, int]] = []  # pending (slot, rBlock)
        self._dropped: list[int] = []
        self._released: list[int] = []  # slots the pending copies in read for the last time
        # rBlocks whose contents a copy planned with this plan moves before the host copies' step (DistKV recalls:
        # destination -> source): a swap-out reads a moved rBlock at its source (host copies out run first).
        self.moved: dict[int, int] = {}
        self._counts = counters(HostTierStats)  # its counters (the *_total fields of its stats)

    # ----- what it holds -----

    @property
    def num_free(self) -> int:
        """Slots a swap-out can take: free ones and those of the host prefix cache (evictable)."""
        return len(self._free) + len(self._cached)

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free) - len(self._releasing)

    def swapped(self, seq_id: int) -> list[int]:
        """seq_id's slots (its table's first rBlocks, in order) while it is swapped out; [] otherwise."""
        return self._swapped.get(seq_id, [])

    def stats(self) -> HostTierStats:
        return HostTierStats(blocks=self.num_slots, blocks_used=self.num_used, cached_blocks=len(self._cached),
                             swapped_sequences=len(self._swapped), **self._counts)

    # ----- swapped sequences -----

    def swap_out(self, seq_id: int, blocks: list[int], keys: list[bytes] = ()) -> bool:
        """Plan copying `blocks` (a preempted sequence's computed rBlocks, in table order) to the host; False,
        planning nothing, when the tier cannot hold them even after evicting its whole prefix cache. keys: the
        content keys of the first rBlocks (those the prefix cache could know): one the host cache holds is pinned
        for the sequence instead of copied (the module docstring)."""
        if seq_id in self._swapped:
            raise ValueError(f"sequence {seq_id} is already swapped out")
        hits = [i for i, key in enumerate(keys[:len(blocks)]) if key in self._cached]
        fresh = len(blocks) - len(hits)
        if not blocks or fresh > self.num_free - len(hits):  # pinning the hits takes them out of the evictable
            self._counts["swap_fallbacks_total"] += bool(blocks)
            return False
        slots: list[int | None] = [None] * len(blocks)
        for i in hits:  # before _take, which may evict cached slots
            slot = self._cached.pop(keys[i])
            del self._key_of[slot]
            self._pinned[slot] = keys[i]
            self._pinned_keys.add(keys[i])
            slots[i] = slot
        copied = [i for i, slot in enumerate(slots) if slot is None]
        for i, slot in zip(copied, self._take(fresh)):
            slots[i] = slot
        self._out.extend((self.moved.get(blocks[i], blocks[i]), slots[i]) for i in copied)
        self._swapped[seq_id] = slots
        self._counts["swap_outs_total"] += 1
        self._counts["blocks_out_total"] += fresh
        self._counts["swap_cached_blocks_total"] += len(hits)
        return True

    def swap_in(self, seq_id: int, blocks: list[int], *, skip: int = 0) -> None:
        """Plan copying seq_id's swapped KV back into `blocks`, skipping its first `skip` rBlocks (found in the
        device's prefix cache instead: their slots are let go); its slots are free once the copies are taken, its
        pinned ones back in the host cache."""
        slots = self._swapped.pop(seq_id)
        if len(blocks) != len(slots) - skip:
            raise ValueError(f"sequence {seq_id} has {len(slots)} rBlocks on the host, {skip} skipped; "
                             f"got {len(blocks)} to copy them into")
        for slot in slots[:skip]:
            self._let_go(slot)
        self._copy_in(slots[skip:], blocks)
        for slot in slots[skip:]:  # read by the copies: cached again (pinned) or freed once they are taken
            if slot in self._pinned:
                self._rejoining.append((slot, self._unpin(slot)))
            else:
                self._released.append(slot)
                self._releasing.append(slot)
        self._counts["swap_ins_total"] += 1

    def discard(self, seq_id: int) -> None:
        """A swapped sequence ended (finished or cancelled while waiting): its slots are dropped (a pinned one
        rejoins the host cache). Idempotent."""
        for slot in self._swapped.pop(seq_id, []):
            self._let_go(slot)

    def _let_go(self, slot: int) -> None:
        """A swapped sequence's slot no copy reads: a pinned one rejoins the host cache, another is dropped."""
        if slot in self._pinned:
            self._recache(slot, self._unpin(slot))
        else:
            self._dropped.append(slot)
            self._releasing.append(slot)

    def _unpin(self, slot: int) -> bytes:
        key = self._pinned.pop(slot)
        self._pinned_keys.remove(key)
        return key

    def _recache(self, slot: int, key: bytes, *, read: bool = False) -> None:
        """A slot holding `key`'s rBlock joins the host cache as the most recently used, unless the cache holds
        that key in another slot already (spilled again meanwhile): then this one goes, dropped, or released after
        the pending copies that read it (`read`)."""
        if key in self._cached:
            (self._released if read else self._dropped).append(slot)
            self._releasing.append(slot)
        else:
            self._cached[key] = slot
            self._key_of[slot] = key

    # ----- the host prefix cache -----

    def spill(self, key: bytes, block: int) -> bool:
        """Plan keeping the device prefix cache's evicted rBlock `block` (content `key`) on the host, evicting
        the oldest spilled rBlocks if the tier is full; False when it cannot (every slot holds swapped KV)."""
        if key in self._cached:
            self._cached.move_to_end(key)
            return True
        if key in self._pinned_keys:  # on the host already, held by a swapped sequence: rejoins the cache later
            return True
        if self.num_free == 0:
            return False
        slot = self._take(1)[0]
        self._cached[key] = slot
        self._key_of[slot] = key
        self._out.append((block, slot))
        self._counts["spilled_blocks_total"] += 1
        self._counts["blocks_out_total"] += 1
        return True

    def lookup(self, keys: list[bytes]) -> list[int]:
        """The slots of the longest run of `keys` from the first that the host prefix cache holds."""
        found = []
        for key in keys:
            slot = self._cached.get(key)
            if slot is None:
                break
            found.append(slot)
        return found

    def claim(self, slots: list[int]) -> None:
        """Hold lookup's slots for an admission: the rBlocks it grows may evict device-cached ones, whose spills
        must not evict these. Then `restore` them, or `unclaim` them if the admission failed."""
        for slot in slots:
            key = self._key_of.pop(slot)
            del self._cached[key]
            self._claimed[slot] = key

    def unclaim(self, slots: list[int]) -> None:
        """The admission failed: claimed slots go back to the host cache (as the most recently spilled)."""
        for slot in slots:
            self._recache(slot, self._claimed.pop(slot))  # the grow may have spilled the device's copy meanwhile

    def restore(self, slots: list[int], blocks: list[int]) -> None:
        """Plan copying claimed `slots` into `blocks`; they rejoin the host cache (as the most recently used) once
        the copies are taken, so a later spill of the same rBlocks copies nothing."""
        if len(slots) != len(blocks):
            raise ValueError(f"{len(slots)} host slots for {len(blocks)} rBlocks")
        self._rejoining.extend((slot, self._claimed.pop(slot)) for slot in slots)
        self._copy_in(slots, blocks)
        self._counts["hit_blocks_total"] += len(slots)

    # ----- the copies -----

    def take_copies(self) -> HostCopies | None:
        """The copies planned since the last call (None: none), for the next StepPlan; the slots they read
        become free."""
        if not (self._out or self._in or self._dropped):
            return None
        for slot, key in self._rejoining:
            self._recache(slot, key, read=True)
        pairs = lambda items, j: np.fromiter((p[j] for p in items), np.int32, len(items))  # noqa: E731
        copies = HostCopies(out_blocks=pairs(self._out, 0), out_slots=pairs(self._out, 1),
                            in_slots=pairs(self._in, 0), in_blocks=pairs(self._in, 1),
                            dropped=np.asarray(self._dropped, np.int32),
                            released=np.asarray(self._released, np.int32))
        self._free.extend(sorted(self._releasing, reverse=True))
        self._out, self._in, self._dropped, self._releasing, self._released, self._rejoining = [], [], [], [], [], []
        return copies

    def _copy_in(self, slots: list[int], blocks: list[int]) -> None:
        self._in.extend(zip(slots, blocks))
        self._counts["blocks_in_total"] += len(slots)

    def _take(self, count: int) -> list[int]:
        """`count` slots, evicting the oldest host-cached rBlocks when the free ones run short (count <=
        num_free)."""
        while len(self._free) < count:
            _, slot = self._cached.popitem(last=False)
            del self._key_of[slot]
            self._dropped.append(slot)  # forgotten now; the slot's new content arrives in this plan's out copies
            self._free.append(slot)
        return [self._free.pop() for _ in range(count)]
