"""DistKV-LLM (Infinite-LLM, arXiv 2401.02669): serving instances lend each other rBlocks.

Pure Python over integer ids, no device code. Every instance has an `RManager` over its own rBlock
pool; one `GManager` (on process 0, with every instance's scheduler) keeps the global debt ledger.
A request lives on its home instance (whose scheduler runs it and which merges its attention); its
rBlock table is a list of `Placement(instance, block)`: rBlocks of the home pool and rBlocks lent by
creditors. The rules:

- Local first. A request grows on its home pool; only what the home pool cannot give is borrowed.
- Creditors. The GManager ranks the other instances: same host first (lending inside a host runs
  over NVLink), then the most free rBlocks as last reported (`report`, the heartbeat; between
  heartbeats the GManager subtracts what it lent), then the lowest id. A creditor refuses what would
  take it below its reserve, and an instance that is itself in debt refuses to lend at all: it is
  short. A creditor only ever lends rBlocks of its own pool, so a borrowed rBlock is never re-lent
  (no borrowing chains): every loan's creditor is where its rBlock physically lives.
- No refusal while the mesh has room. If the willing creditors cannot cover a request, a last-resort
  pass takes from any instance with free rBlocks (reserves and debtors included): refusing a request
  while rBlocks are free anywhere is worse than a creditor dipping into its reserve. A request is
  refused (`OutOfBlocks`, nothing taken) only when the whole mesh has fewer free rBlocks than it needs.
- Return. A request that finishes or is cancelled gives its borrowed rBlocks back to their creditors.
- Striped requests (a long prompt prefilled by the whole mesh: jaxllm.engine.spread). `RManager.grow(..., stripe=n)`
  puts table entry e on instance e % n (borrowing it from that instance by name, `GManager.borrow_from`; where that
  one is full, the ordinary rules take over), so every instance holds an equal share of every stretch of the
  sequence and does an equal share of its attention. Their loans are placement, not debt: never recalled nor
  swapped home.
- Recall and circular debts (`GManager.plan_recalls`). First, circular debts are broken: where A owes B
  and B owes A, loans are paired off, and each pair becomes a swap of two rBlocks' contents, so both
  requests end up at home and min(A->B, B->A) loans disappear without any free memory. Then every
  debtor with free rBlocks above its reserve recalls borrowed rBlocks home, those from the creditor
  with the fewest free rBlocks first (it needs its memory back most). The plan is a list of copies
  (source placement -> destination placement) for the device to do, reading the pre-plan contents (a
  gather then a scatter, so a swap is two copies); the ledger changes only when the copies are
  confirmed (`confirm`), or the plan is dropped (`abort`). While a plan is outstanding, nothing else
  may change the tables: the device copy and the ledger would disagree.

One file of ~480 lines on purpose: the RManager and the GManager are the two halves of one protocol (every
borrow, repay, recall and confirm moves an rBlock in one and its debt in the other, and the ledger's invariants
span both), and the small records above them (Placement, Loan, Move, RecallPlan, Allocation) are its vocabulary.
"""

from __future__ import annotations

import dataclasses

from jaxllm.engine.allocator import BlockAllocator, OutOfBlocks

__all__ = ["Allocation", "GManager", "InstanceSpec", "Loan", "Move", "OutOfBlocks", "Placement", "RManager",
           "RecallPlan"]


@dataclasses.dataclass(frozen=True)
class InstanceSpec:
    """One serving instance: its id, the host it runs on, its pool size and what it keeps from lending."""

    instance: int
    host: int
    num_blocks: int
    reserve: int = 0

    def __post_init__(self):
        if self.instance < 0 or self.host < 0:
            raise ValueError(f"instance {self.instance} and host {self.host} must be >= 0")
        if self.num_blocks <= 0:
            raise ValueError(f"instance {self.instance}: num_blocks must be positive, got {self.num_blocks}")
        if not 0 <= self.reserve <= self.num_blocks:
            raise ValueError(f"instance {self.instance}: reserve {self.reserve} must be in [0, num_blocks "
                             f"{self.num_blocks}]")


@dataclasses.dataclass(frozen=True, order=True)
class Placement:
    """Where one rBlock of a request's table lives: rBlock `block` of instance `instance`'s pool."""

    instance: int
    block: int


@dataclasses.dataclass(frozen=True)
class Loan:
    """One lent rBlock: `creditor`'s rBlock `block`, in the table of `debtor`'s request `request`."""

    creditor: int
    debtor: int
    request: int
    block: int


@dataclasses.dataclass(frozen=True)
class Move:
    """Entry `index` of `request`'s table moves from `src` to `dst` (a copy of one rBlock's K and V)."""

    request: int
    index: int
    src: Placement
    dst: Placement


@dataclasses.dataclass(frozen=True)
class RecallPlan:
    """Copies the device does before `GManager.confirm`; all read the contents from before the plan."""

    serial: int
    moves: tuple[Move, ...]
    swaps: int  # circular-debt pairs among the moves (two moves each)

    def copies(self) -> tuple[tuple[Placement, Placement], ...]:
        """(source, destination) per copy: (creditor, block) -> (debtor, block), or the two halves of a swap."""
        return tuple((m.src, m.dst) for m in self.moves)


@dataclasses.dataclass(frozen=True)
class Allocation:
    """A request's rBlock table, entry i holding tokens [i * block_size, (i + 1) * block_size)."""

    request: int
    home: int
    table: tuple[Placement, ...]

    def parts(self) -> dict[int, tuple[int, ...]]:
        """Per instance holding some of it, the table indices it holds (ascending)."""
        out: dict[int, list[int]] = {}
        for i, p in enumerate(self.table):
            out.setdefault(p.instance, []).append(i)
        return {k: tuple(v) for k, v in sorted(out.items())}

    def local_tables(self, block_size: int, num_tokens: int) -> dict[int, tuple[tuple[int, ...], int]]:
        """Per instance: (its rBlock ids in table order, how many of the sequence's `num_tokens` they hold):
        a row of a DistAttention decode step's tables and lens (sharding.dist_attention.DistParts) (the partial last rBlock comes last where it is)."""
        if not 0 <= num_tokens <= len(self.table) * block_size:
            raise ValueError(f"request {self.request}: {num_tokens} tokens do not fit its {len(self.table)} "
                             f"rBlocks of {block_size}")
        return {inst: (tuple(self.table[i].block for i in idx),
                       sum(max(0, min(block_size, num_tokens - i * block_size)) for i in idx))
                for inst, idx in self.parts().items()}

    def runs(self) -> tuple[tuple[int, int, tuple[int, ...]], ...]:
        """Maximal runs of consecutive table entries on one instance: (instance, first entry, rBlock ids).
        Each run is a part with one start position (first entry x block_size) for causal prefill."""
        out: list[tuple[int, int, list[int]]] = []
        for i, p in enumerate(self.table):
            if out and out[-1][0] == p.instance:
                out[-1][2].append(p.block)
            else:
                out.append((p.instance, i, [p.block]))
        return tuple((inst, first, tuple(blocks)) for inst, first, blocks in out)


class RManager:
    """One instance's rBlock manager: its pool, its requests' tables, and its side of lending."""

    def __init__(self, spec: InstanceSpec, gmanager: GManager):
        self.spec = spec
        # This instance's rBlocks: its own requests' (prefix cache included), lent ones, recall destinations.
        self.pool = BlockAllocator(spec.num_blocks)
        self._tables: dict[int, list[Placement]] = {}
        self._reserved: set[int] = set()  # recall destinations of an outstanding plan
        self._gm = gmanager
        gmanager.register(self)

    @property
    def instance(self) -> int:
        return self.spec.instance

    @property
    def num_free(self) -> int:
        return self.pool.num_free

    @property
    def num_owned(self) -> int:
        """rBlocks of this pool in this instance's own requests' tables (recall destinations included)."""
        return sum(p.instance == self.instance for t in self._tables.values() for p in t) + len(self._reserved)

    def free_blocks(self) -> tuple[int, ...]:
        return tuple(self.pool.free_ids())

    def requests(self) -> tuple[int, ...]:
        return tuple(self._tables)

    def placements(self, request: int) -> tuple[Placement, ...]:
        """request's table, entry by entry (Allocation.table without the Allocation)."""
        if request not in self._tables:
            raise KeyError(f"instance {self.instance} has no request {request}")
        return tuple(self._tables[request])

    def table(self, request: int) -> Allocation:
        if request not in self._tables:
            raise KeyError(f"instance {self.instance} has no request {request}")
        return Allocation(request, self.instance, tuple(self._tables[request]))

    # ----- the home side -----

    def allocate(self, request: int, num_blocks: int, *, stripe: int = 1) -> Allocation:
        """Start `request` here with `num_blocks` rBlocks (local first, then borrowed; stripe: as grow's)."""
        if self._gm.home_of(request) is not None:
            raise ValueError(f"request {request} already exists (on instance {self._gm.home_of(request)})")
        if num_blocks < 0:
            raise ValueError(f"request {request}: num_blocks must be >= 0, got {num_blocks}")
        self._gm.check_no_plan(f"allocate request {request}")
        self._tables[request] = []
        self._gm.adopt(request, self.instance)
        try:
            return self.grow(request, num_blocks, stripe=stripe)
        except OutOfBlocks:
            del self._tables[request]
            self._gm.forget(request)
            raise

    def start_shared(self, request: int, blocks: list[int]) -> Allocation:
        """Start `request` here with these cached rBlocks of this pool as its first (a shared prefix: the
        prefix cache's `lookup`); it grows from there."""
        if self._gm.home_of(request) is not None:
            raise ValueError(f"request {request} already exists (on instance {self._gm.home_of(request)})")
        self._gm.check_no_plan(f"allocate request {request}")
        self.pool.share(request, blocks)
        self._tables[request] = [Placement(self.instance, b) for b in blocks]
        self._gm.adopt(request, self.instance)
        return self.table(request)

    def grow(self, request: int, num_blocks_total: int, *, stripe: int = 1) -> Allocation:
        """Make `request`'s table `num_blocks_total` long; raises OutOfBlocks (nothing taken) when the
        whole mesh has fewer free rBlocks than it needs. stripe > 1: new entry e goes on instance e % stripe (a
        striped request: the module's rules), local first otherwise."""
        table = self._own_table(request)
        need = num_blocks_total - len(table)
        if need <= 0:
            return self.table(request)
        self._gm.check_no_plan(f"grow request {request}")
        mesh_free = self._gm.total_free()
        if need > mesh_free:
            raise OutOfBlocks(f"request {request} on instance {self.instance} needs {need} more rBlocks; the mesh "
                              f"has {mesh_free} free ({self._gm.free_by_instance()})")
        if stripe > 1:
            self._grow_striped(request, table, num_blocks_total, stripe)
            return self.table(request)
        local = min(need, self.num_free)
        if local:
            held = len(self.pool.blocks(request))
            new = self.pool.grow(request, held + local)[held:]  # continues the last local rBlock where free
            table.extend(Placement(self.instance, b) for b in new)
        if need > local:
            table.extend(self._gm.borrow(self.instance, request, need - local))
        return self.table(request)

    def _grow_striped(self, request: int, table: list[Placement], num_blocks_total: int, stripe: int) -> None:
        """grow's striped case: entry e on instance e % stripe where that instance has a free rBlock, else local
        first, then borrowed (the mesh has them all: grow checked)."""
        self._gm.stripe(request)
        for e in range(len(table), num_blocks_total):
            want = e % stripe
            if want == self.instance and self.num_free:
                held = len(self.pool.blocks(request))
                table.extend(Placement(self.instance, b) for b in self.pool.grow(request, held + 1)[held:])
            elif want != self.instance and want in self._gm.instances() and self._gm.rmanager(want).num_free:
                table.extend(self._gm.borrow_from(self.instance, request, want, 1))
            elif self.num_free:
                held = len(self.pool.blocks(request))
                table.extend(Placement(self.instance, b) for b in self.pool.grow(request, held + 1)[held:])
            else:
                table.extend(self._gm.borrow(self.instance, request, 1))

    def shrink(self, request: int, num_blocks_total: int) -> None:
        """Keep the first num_blocks_total entries of `request`'s table; the others go back to their pools (lent
        ones to their creditors), as if it had never grown past them."""
        table = self._own_table(request)
        if len(table) <= num_blocks_total:
            return
        self._gm.check_no_plan(f"shrink request {request}")
        dropped = table[num_blocks_total:]
        del table[num_blocks_total:]
        local = [p.block for p in dropped if p.instance == self.instance]
        if local:
            self.pool.release(request, local)
        self._gm.give_back(request, [p for p in dropped if p.instance != self.instance])

    def finish(self, request: int) -> None:
        """The request ended: its rBlocks go back to their pools (lent ones to their creditors)."""
        self._end(request, "finished")

    def cancel(self, request: int) -> None:
        """The request was cancelled: the same as finish, counted apart."""
        self._end(request, "cancelled")

    def _end(self, request: int, how: str) -> None:
        table = self._own_table(request)
        self._gm.check_no_plan(f"end request {request}")
        self.pool.free(request)  # its local rBlocks (registered ones stay cached)
        self._gm.repay(request, [p for p in table if p.instance != self.instance], how)
        del self._tables[request]

    def _own_table(self, request: int) -> list[Placement]:
        if request not in self._tables:
            home = self._gm.home_of(request)
            where = "no instance" if home is None else f"instance {home}"
            raise KeyError(f"request {request} is not on instance {self.instance} (it is on {where})")
        return self._tables[request]

    # ----- the GManager's calls: lending, returns, recalls -----

    def lendable(self, last_resort: bool) -> int:
        """How many rBlocks this instance agrees to lend now (see the module's rules)."""
        if last_resort:
            return self.num_free
        if self._gm.borrowed(self.instance):
            return 0
        return max(0, self.num_free - self.spec.reserve)

    def give(self, count: int) -> list[int]:
        """Take `count` free rBlocks out of the pool for a loan (the GManager records it)."""
        if count > self.num_free:
            raise OutOfBlocks(f"instance {self.instance} cannot lend {count} rBlocks: {self.num_free} free")
        return self.pool.lend(count)

    def take_back(self, blocks) -> None:
        """Lent rBlocks come home free (their request ended, or they were recalled)."""
        self.pool.take_back(blocks)

    def reserve_for_recall(self, count: int) -> list[int]:
        blocks = self.pool.lend(count)
        self._reserved.update(blocks)
        return blocks

    def unreserve(self, blocks, *, used: bool) -> None:
        """Recall destinations: now in a table (used) or back to the pool (the plan was aborted)."""
        self._reserved.difference_update(blocks)
        if not used:
            self.pool.take_back(blocks)

    def move(self, request: int, index: int, src: Placement, dst: Placement) -> None:
        table = self._own_table(request)
        if table[index] != src:
            raise ValueError(f"request {request} entry {index} is {table[index]}, not {src}: stale plan")
        table[index] = dst
        if dst.instance == self.instance:  # a recall destination, or the other half of a swap: now its own
            self.pool.adopt(request, dst.block)


class GManager:
    """The global manager: instances, their reported free rBlocks, the debt ledger, recall plans."""

    def __init__(self):
        self._rms: dict[int, RManager] = {}
        self._reported: dict[int, int] = {}
        self._loans: dict[Placement, Loan] = {}  # keyed by the lent rBlock
        self._homes: dict[int, int] = {}  # request -> home instance
        self._striped: set[int] = set()  # requests placed across instances on purpose: their loans stay
        self._plan: RecallPlan | None = None
        self._serial = 0
        self.counters = dict(loans=0, returned=0, recalled=0, swapped=0, finished=0, cancelled=0, last_resort=0)

    # ----- instances and heartbeats -----

    def register(self, rm: RManager) -> None:
        if rm.instance in self._rms:
            raise ValueError(f"instance {rm.instance} is already registered")
        self._rms[rm.instance] = rm
        self._reported[rm.instance] = rm.num_free

    def instances(self) -> tuple[int, ...]:
        return tuple(sorted(self._rms))

    def rmanager(self, instance: int) -> RManager:
        if instance not in self._rms:
            raise KeyError(f"no instance {instance}; known: {self.instances()}")
        return self._rms[instance]

    def report(self, instance: int, free: int) -> None:
        """Heartbeat: `instance` has `free` free rBlocks."""
        capacity = self.rmanager(instance).spec.num_blocks
        if not 0 <= free <= capacity:
            raise ValueError(f"instance {instance} reports {free} free rBlocks; its pool holds {capacity}")
        self._reported[instance] = free

    def total_free(self) -> int:
        return sum(rm.num_free for rm in self._rms.values())

    def free_by_instance(self) -> dict[int, int]:
        return {i: self._rms[i].num_free for i in self.instances()}

    # ----- requests and the ledger -----

    def home_of(self, request: int) -> int | None:
        return self._homes.get(request)

    def adopt(self, request: int, home: int) -> None:
        self._homes[request] = home

    def forget(self, request: int) -> None:
        self._homes.pop(request, None)
        self._striped.discard(request)

    def stripe(self, request: int) -> None:
        """`request`'s table is striped across instances (RManager.grow's stripe): its loans are never recalled."""
        self._striped.add(request)

    def striped(self, request: int) -> bool:
        return request in self._striped

    def loans(self) -> tuple[Loan, ...]:
        return tuple(self._loans.values())

    def borrowed(self, instance: int) -> int:
        """rBlocks `instance`'s requests hold on other instances."""
        return sum(loan.debtor == instance for loan in self._loans.values())

    def lent(self, instance: int) -> int:
        """rBlocks of `instance`'s pool in other instances' requests."""
        return sum(loan.creditor == instance for loan in self._loans.values())

    def debts(self) -> dict[tuple[int, int], int]:
        """(debtor, creditor) -> rBlocks owed."""
        out: dict[tuple[int, int], int] = {}
        for loan in self._loans.values():
            out[loan.debtor, loan.creditor] = out.get((loan.debtor, loan.creditor), 0) + 1
        return out

    def creditors(self, debtor: int) -> list[int]:
        """Instances to ask, best first: same host, most free rBlocks as last reported, lowest id."""
        host = self.rmanager(debtor).spec.host
        others = [i for i in self._rms if i != debtor]
        return sorted(others, key=lambda i: (self._rms[i].spec.host != host, -self._reported[i], i))

    def borrow(self, debtor: int, request: int, count: int) -> list[Placement]:
        """Lend `count` rBlocks to `debtor`'s `request`; the caller has checked the mesh has them."""
        got: list[Placement] = []
        for last_resort in (False, True):
            for creditor in self.creditors(debtor):
                n = min(count - len(got), self._rms[creditor].lendable(last_resort))
                if n <= 0:
                    continue
                self.counters["last_resort"] += n if last_resort else 0
                for block in self._rms[creditor].give(n):
                    self._loans[Placement(creditor, block)] = Loan(creditor, debtor, request, block)
                    got.append(Placement(creditor, block))
                self._reported[creditor] = max(0, self._reported[creditor] - n)
                self.counters["loans"] += n
                if len(got) == count:
                    return got
        raise OutOfBlocks(f"request {request} on instance {debtor}: lent {len(got)} of {count} rBlocks; "
                          f"free: {self.free_by_instance()}")  # the caller's check makes this unreachable

    def borrow_from(self, debtor: int, request: int, creditor: int, count: int) -> list[Placement]:
        """Lend `count` rBlocks of `creditor`'s pool to `debtor`'s `request` (a striped table names where each
        entry goes); the caller has checked that creditor has them free."""
        if creditor == debtor:
            raise ValueError(f"request {request}: instance {debtor} cannot borrow from itself")
        got = [Placement(creditor, block) for block in self._rms[creditor].give(count)]
        for p in got:
            self._loans[p] = Loan(creditor, debtor, request, p.block)
        self._reported[creditor] = max(0, self._reported[creditor] - count)
        self.counters["loans"] += count
        return got

    def repay(self, request: int, placements: list[Placement], how: str) -> None:
        """`request` ended ("finished" or "cancelled"): its borrowed rBlocks go back to their creditors."""
        self.give_back(request, placements)
        self.counters[how] += 1
        self.forget(request)

    def give_back(self, request: int, placements: list[Placement]) -> None:
        """These borrowed rBlocks of `request` go back to their creditors (it ended, or shrank)."""
        for p in placements:
            loan = self._loans.pop(p, None)
            if loan is None or loan.request != request:
                raise ValueError(f"request {request} holds {p}, which the ledger has not lent to it ({loan})")
            self._rms[p.instance].take_back([p.block])
        self.counters["returned"] += len(placements)

    # ----- recalls -----

    def check_no_plan(self, doing: str) -> None:
        if self._plan is not None:
            raise RuntimeError(f"cannot {doing}: recall plan {self._plan.serial} is outstanding; confirm or abort "
                               f"it first")

    def plan_recalls(self) -> RecallPlan:
        """Swaps that break circular debts, then recalls into debtors with room (the module's rules).

        An empty plan needs no confirm; a non-empty one blocks every other change until confirm/abort.
        """
        self.check_no_plan("plan recalls")
        moves: list[Move] = []
        used: set[Placement] = set()
        by_pair: dict[tuple[int, int], list[Loan]] = {}
        kept = {p: loan for p, loan in self._loans.items() if loan.request not in self._striped}  # placed, not owed
        for p, loan in sorted(kept.items()):
            by_pair.setdefault((loan.debtor, loan.creditor), []).append(loan)
        swaps = 0
        for (a, b), owed in sorted(by_pair.items()):
            if a > b:
                continue
            for x, y in zip(owed, by_pair.get((b, a), [])):  # x: a's request on b; y: b's request on a
                px, py = Placement(b, x.block), Placement(a, y.block)
                moves.append(Move(x.request, self._index(x), px, py))
                moves.append(Move(y.request, self._index(y), py, px))
                used.update((px, py))
                swaps += 1
        for debtor in self.instances():
            rm = self._rms[debtor]
            room = rm.num_free - rm.spec.reserve
            owed = [loan for p, loan in sorted(kept.items()) if loan.debtor == debtor and p not in used]
            if room <= 0 or not owed:
                continue
            owed.sort(key=lambda loan: (self._rms[loan.creditor].num_free, loan.creditor, loan.block))
            owed = owed[:room]
            for loan, block in zip(owed, rm.reserve_for_recall(len(owed))):
                moves.append(Move(loan.request, self._index(loan), Placement(loan.creditor, loan.block),
                                  Placement(debtor, block)))
        self._serial += 1
        plan = RecallPlan(self._serial, tuple(moves), swaps)
        if moves:
            self._plan = plan
        return plan

    def confirm(self, plan: RecallPlan) -> None:
        """The device did the plan's copies: tables and ledger follow, sources no longer used go free."""
        self._check_plan(plan)
        srcs, dsts = {m.src for m in plan.moves}, {m.dst for m in plan.moves}
        for m in plan.moves:
            self._loans.pop(m.src)
            self._rms[self._homes[m.request]].move(m.request, m.index, m.src, m.dst)
        for p in sorted(srcs - dsts):
            self._rms[p.instance].take_back([p.block])
        for p in sorted(dsts - srcs):
            self._rms[p.instance].unreserve([p.block], used=True)
        self.counters["recalled"] += len(plan.moves) - 2 * plan.swaps
        self.counters["swapped"] += plan.swaps
        self._plan = None

    def abort(self, plan: RecallPlan) -> None:
        """The device did not do the plan: nothing moves, reserved destinations go free."""
        self._check_plan(plan)
        srcs = {m.src for m in plan.moves}
        for m in plan.moves:
            if m.dst not in srcs:
                self._rms[m.dst.instance].unreserve([m.dst.block], used=False)
        self._plan = None

    def _check_plan(self, plan: RecallPlan) -> None:
        if self._plan is None or plan.serial != self._plan.serial:
            current = None if self._plan is None else self._plan.serial
            raise ValueError(f"recall plan {plan.serial} is not the outstanding one (outstanding: {current})")

    def _index(self, loan: Loan) -> int:
        return self._rms[loan.debtor].table(loan.request).table.index(Placement(loan.creditor, loan.block))

    def metrics(self) -> dict:
        """Borrowed and lent rBlocks per instance, lenders per debtor, and the counters."""
        lenders: dict[int, set[int]] = {}
        for loan in self._loans.values():
            lenders.setdefault(loan.debtor, set()).add(loan.creditor)
        return dict(borrowed={i: self.borrowed(i) for i in self.instances()},
                    lent={i: self.lent(i) for i in self.instances()},
                    lenders={i: sorted(v) for i, v in lenders.items()}, **self.counters)
