"""Properties of the host tier's ledger (jaxllm.engine.host_tier) over random sequences of its operations, through
its public API only: the host prefix cache is an LRU by content key (checked against a reference model written
here), and once a plan's copies are taken every slot is free, cached, swapped or claimed, none twice.

The operations follow the orders its callers use (jaxllm.engine.scheduler, instances): spills at any time;
swap_out of a new sequence; swap_in (some first rBlocks skipped, found on the device) or discard of a swapped one;
an admission is lookup, claim, the spills its grow causes, then restore or unclaim, with nothing else between;
take_copies ends a plan. Pure Python, fixed seeds (tests/seeds.py).
"""

from __future__ import annotations

import random
from collections import OrderedDict

from jaxllm.engine.host_tier import HostTier
from tests.seeds import seed

KEYS = [bytes([i]) for i in range(8)]  # few keys, few slots: re-spills, hits and evictions are common
FIRST_SLOT = 100  # slot ids are global: first_slot + local
RUNS, OPS = 150, 120


def test_spilling_a_key_again_makes_it_the_most_recently_used():
    host = HostTier(2)
    assert host.spill(b"k1", 1) and host.spill(b"k2", 2) and host.spill(b"k1", 3) and host.spill(b"k3", 4)
    assert host.lookup([b"k2"]) == [], "k2, the least recently spilled, should have been evicted"
    assert len(host.lookup([b"k1"])) == 1 and len(host.lookup([b"k3"])) == 1
    copies = host.take_copies()
    assert copies.out_blocks.tolist() == [1, 2, 4] and len(copies.dropped) == 1  # k1's second spill copies nothing


def test_a_plan_whose_only_change_is_a_discard_frees_the_slots():
    """A swapped sequence cancelled (discard), or swapped in with every rBlock found on the device (all skipped):
    no copy moves, but the slots must be free once the plan's copies are taken."""
    host = HostTier(3)
    assert host.swap_out(1, [10, 11]) and host.swap_out(2, [12])
    host.take_copies()
    host.discard(1)
    copies = host.take_copies()
    assert copies is not None and sorted(copies.dropped.tolist()) == [0, 1] and host.num_free == 2
    host.swap_in(2, [], skip=1)
    assert host.take_copies().dropped.tolist() == [2] and host.num_free == 3


class _Reference:
    """What the tier should hold, by content key rather than by slot (which slot it picks is its own business)."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.cached: OrderedDict[bytes, None] = OrderedDict()  # least recently used first
        self.swapped: dict[int, list[bytes | None]] = {}  # per slot: the key of a pinned one, None for a copied one
        self.claimed: list[bytes] = []
        self.rejoining: list[bytes] = []  # restored or swapped-in pinned keys: cached again when the copies are taken
        self.releasing = 0  # slots free once the copies are taken
        self.out = self.into = self.dropped = self.released = 0  # what the next take_copies should hold

    @property
    def free(self) -> int:
        held = len(self.cached) + sum(map(len, self.swapped.values())) + len(self.claimed) + len(self.rejoining)
        return self.num_slots - held - self.releasing

    def _take(self, count: int) -> None:
        while self.free < count:
            self.cached.popitem(last=False)
            self.dropped += 1

    def _recache(self, key: bytes, read: bool = False) -> None:
        if key in self.cached:  # spilled again meanwhile: this copy goes
            self.releasing += 1
            if read:
                self.released += 1
            else:
                self.dropped += 1
        else:
            self.cached[key] = None

    def _let_go(self, key: bytes | None) -> None:
        if key is None:
            self.dropped += 1
            self.releasing += 1
        else:
            self._recache(key)

    def spill(self, key: bytes) -> bool:
        if key in self.cached:
            self.cached.move_to_end(key)
            return True
        if any(key in slots for slots in self.swapped.values()):  # pinned
            return True
        if self.free + len(self.cached) == 0:
            return False
        self._take(1)
        self.cached[key] = None
        self.out += 1
        return True

    def swap_out(self, seq_id: int, count: int, keys: list[bytes]) -> bool:
        hits = {i for i, key in enumerate(keys[:count]) if key in self.cached}
        fresh = count - len(hits)
        if fresh > self.free + len(self.cached) - len(hits):
            return False
        for i in hits:
            del self.cached[keys[i]]
        self.swapped[seq_id] = [keys[i] for i in hits]  # held while the fresh slots are taken
        self._take(fresh)
        self.swapped[seq_id] = [keys[i] if i in hits else None for i in range(count)]
        self.out += fresh
        return True

    def swap_in(self, seq_id: int, skip: int) -> None:
        slots = self.swapped.pop(seq_id)
        for key in slots[:skip]:
            self._let_go(key)
        for key in slots[skip:]:
            if key is None:
                self.releasing += 1
                self.released += 1
            else:
                self.rejoining.append(key)
        self.into += len(slots) - skip

    def discard(self, seq_id: int) -> None:
        for key in self.swapped.pop(seq_id, []):
            self._let_go(key)

    def lookup(self, keys: list[bytes]) -> int:
        run = 0
        while run < len(keys) and keys[run] in self.cached:
            run += 1
        return run

    def claim(self, keys: list[bytes]) -> None:
        for key in keys:
            del self.cached[key]
        self.claimed = list(keys)

    def restore(self) -> None:
        self.rejoining.extend(self.claimed)
        self.into += len(self.claimed)
        self.claimed = []

    def unclaim(self) -> None:
        for key in self.claimed:
            self._recache(key)
        self.claimed = []

    def take_copies(self) -> tuple[int, int, int, int] | None:
        """(out, in, dropped, released), or None when nothing was planned."""
        if not (self.out or self.into or self.dropped):
            return None
        for key in self.rejoining:
            self._recache(key, read=True)
        counts = self.out, self.into, self.dropped, self.released
        self.rejoining, self.releasing, self.out, self.into, self.dropped, self.released = [], 0, 0, 0, 0, 0
        return counts


class _Workload:
    """A random run of legal operations on one tier; what a caller knows (its swapped sequences and their keys,
    the slots it claimed) and, optionally, the reference model stepped along and compared after every operation."""

    def __init__(self, run_seed: int, *, check_model: bool):
        self.rng = random.Random(run_seed)
        self.host = HostTier(self.rng.randint(1, 6), first_slot=FIRST_SLOT)
        self.model = _Reference(self.host.num_slots) if check_model else None
        self.swapped: list[int] = []
        self.claimed: list[int] = []
        self.next_seq = 1
        self.log: list[str] = []

    def context(self, run_seed: int) -> str:
        return f"seed={run_seed} slots={self.host.num_slots} last ops: {'; '.join(self.log[-8:])}"

    def _spill(self) -> None:
        key = self.rng.choice(KEYS)
        self.log.append(f"spill({key[0]})")
        got = self.host.spill(key, self.rng.randrange(1000))
        if self.model is not None:
            assert got == self.model.spill(key), f"spill returned {got}"

    def step(self) -> bool:
        """One operation; True when it was take_copies (a plan's end)."""
        rng, host, model = self.rng, self.host, self.model
        op = rng.choice(["spill", "spill", "spill", "swap_out", "swap_in", "discard", "admit", "take", "take"])
        if op == "spill":
            self._spill()
        elif op == "swap_out":
            seq_id, count = self.next_seq, rng.randint(1, 4)
            self.next_seq += 1
            keys = rng.sample(KEYS, rng.randint(0, count))  # its registered rBlocks' keys: distinct (chained)
            self.log.append(f"swap_out({seq_id}, {count}, {[k[0] for k in keys]})")
            got = host.swap_out(seq_id, [rng.randrange(1000) for _ in range(count)], keys)
            if model is not None:
                assert got == model.swap_out(seq_id, count, keys), f"swap_out returned {got}"
            if got:
                self.swapped.append(seq_id)
        elif op in ("swap_in", "discard") and self.swapped:
            seq_id = self.swapped.pop(rng.randrange(len(self.swapped)))
            if op == "swap_in":
                slots = host.swapped(seq_id)
                skip = rng.randint(0, len(slots))
                self.log.append(f"swap_in({seq_id}, skip={skip})")
                host.swap_in(seq_id, [rng.randrange(1000) for _ in slots[skip:]], skip=skip)
                if model is not None:
                    model.swap_in(seq_id, skip)
            else:
                self.log.append(f"discard({seq_id})")
                host.discard(seq_id)
                if model is not None:
                    model.discard(seq_id)
        elif op == "admit":
            self._admit()
        elif op == "take":
            self.log.append("take_copies")
            copies = host.take_copies()
            if model is not None:
                want = model.take_copies()
                got = None if copies is None else (copies.num_out, copies.num_in, len(copies.dropped),
                                                   len(copies.released))
                assert got == want, f"take_copies gave (out, in, dropped, released) {got}, the model {want}"
            return True
        if model is not None:
            self.compare()
        return False

    def _admit(self) -> None:
        """lookup, claim, the spills of the grow, then restore (admitted) or unclaim (out of rBlocks)."""
        rng, host, model = self.rng, self.host, self.model
        keys = rng.sample(KEYS, rng.randint(1, 4))
        slots = host.lookup(keys)
        self.log.append(f"lookup({[k[0] for k in keys]}) -> {len(slots)}")
        if model is not None:
            assert len(slots) == model.lookup(keys), f"lookup found {len(slots)} rBlocks"
        if not slots:
            return
        host.claim(slots)
        self.claimed = slots
        if model is not None:
            model.claim(keys[:len(slots)])
            self.compare()
        for _ in range(rng.randint(0, 2)):
            self._spill()
        if rng.random() < 0.7:
            self.log.append("restore")
            host.restore(slots, [rng.randrange(1000) for _ in slots])
            if model is not None:
                model.restore()
        else:
            self.log.append("unclaim")
            host.unclaim(slots)
            if model is not None:
                model.unclaim()
        self.claimed = []

    def compare(self) -> None:
        """The tier holds the model's keys, and as many slots are free or evictable."""
        host, model = self.host, self.model
        cached = [key[0] for key in KEYS if host.lookup([key])]
        want = [key[0] for key in KEYS if key in model.cached]
        assert cached == want, f"host cache holds keys {cached}, the LRU model {want}"
        assert host.stats().cached_blocks == len(model.cached)
        assert host.num_free == model.free + len(model.cached), f"num_free {host.num_free}"

    def held_slots(self) -> list[int]:
        """Every slot the tier says is held, by whom it says: the cache's, the swapped sequences', the claimed."""
        cached = [slot for key in KEYS for slot in self.host.lookup([key])]
        return cached + [slot for s in self.swapped for slot in self.host.swapped(s)] + self.claimed


def test_host_prefix_cache_is_an_lru_of_content_keys():
    """Random operation sequences against the reference model: every spill, swap_out and lookup answers as it
    does, the cache holds its keys after every operation (a re-spill refreshes a key; evictions take the least
    recently spilled or rejoined), and each take_copies holds as many copies of each kind."""
    base = seed(48101)
    for run_seed in range(base, base + RUNS):
        work = _Workload(run_seed, check_model=True)
        for _ in range(OPS):
            try:
                work.step()
            except AssertionError as err:
                raise AssertionError(f"{err} ({work.context(run_seed)})") from None


def test_every_slot_is_free_or_held_once_the_copies_are_taken():
    """After every take_copies (a plan's end, its copies handed to the executor): free + evictable slots
    (num_free) and the slots of the swapped sequences (pinned ones among them) and of claims add up to all
    slots, none held twice, all in the tier's id range; a plan whose only change is a discard frees slots too."""
    base = seed(48102)
    for run_seed in range(base, base + RUNS):
        work = _Workload(run_seed, check_model=False)
        host = work.host
        ids = range(FIRST_SLOT, FIRST_SLOT + host.num_slots)
        for _ in range(OPS):
            if not work.step():
                continue
            ctx = work.context(run_seed)
            held = work.held_slots()
            assert len(set(held)) == len(held) and set(held) <= set(ids), f"slots held twice or foreign: {held} ({ctx})"
            swapped = len(held) - host.stats().cached_blocks
            assert host.num_free + swapped == host.num_slots, \
                f"{host.num_free} free or evictable + {swapped} swapped or claimed != {host.num_slots} slots ({ctx})"
            stats = host.stats()
            assert stats.blocks_used == len(held) and stats.swapped_sequences == len(work.swapped), (stats, ctx)
