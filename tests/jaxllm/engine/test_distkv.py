"""DistKV-LLM's protocol: each rule on its own, then 10,000 random operations with the invariants after each.

The random run draws a fresh seed and prints it; replay a failure with JAXLLM_TEST_SEED=<seed>. A fake
device keeps a tag per physical rBlock (which request's entry it holds), written on allocation and moved
only by the recall plans' copies, so a wrong plan shows up as a table entry holding another's KV.
"""

import random

import numpy as np
import pytest

from jaxllm.engine.distkv import GManager, InstanceSpec, OutOfBlocks, Placement, RManager
from tests.seeds import seed


def _mesh(*specs):
    """specs: (host, num_blocks[, reserve]) per instance, ids 0.."""
    gm = GManager()
    rms = [RManager(InstanceSpec(i, *spec), gm) for i, spec in enumerate(specs)]
    return gm, rms


class _Device:
    """What each physical rBlock holds: (request, table index) of the KV written into it."""

    def __init__(self):
        self.content: dict[Placement, tuple[int, int]] = {}

    def write(self, alloc, start=0):
        for i, p in enumerate(alloc.table[start:], start):
            self.content[p] = (alloc.request, i)

    def copy(self, plan):
        before = dict(self.content)  # every copy reads the pre-plan contents (a swap is two copies)
        for src, dst in plan.copies():
            self.content[dst] = before[src]

    def check(self, gm):
        for inst in gm.instances():
            rm = gm.rmanager(inst)
            for r in rm.requests():
                for i, p in enumerate(rm.table(r).table):
                    assert self.content[p] == (r, i), f"request {r} entry {i} at {p} holds {self.content[p]}"


def _audit(gm):
    """Never double-lends, never leaks, never chains; no plan left outstanding."""
    gm.check_no_plan("audit")
    seen: set[Placement] = set()
    owned = {i: 0 for i in gm.instances()}
    remote = 0
    ledger = {Placement(loan.creditor, loan.block): loan for loan in gm.loans()}
    for inst in gm.instances():
        rm = gm.rmanager(inst)
        for r in rm.requests():
            assert gm.home_of(r) == inst
            for p in rm.table(r).table:
                assert p not in seen, f"{p} is in two tables (or twice in one)"
                seen.add(p)
                if p.instance == inst:
                    owned[inst] += 1
                else:
                    remote += 1
                    loan = ledger.get(p)
                    # The creditor on record is the rBlock's own pool: a borrowed rBlock was never re-lent.
                    assert loan is not None and (loan.debtor, loan.request) == (inst, r), (p, loan)
    assert remote == len(gm.loans())
    for inst in gm.instances():
        rm = gm.rmanager(inst)
        free = rm.free_blocks()
        assert len(set(free)) == len(free) and not {Placement(inst, b) for b in free} & seen
        assert all(0 <= b < rm.spec.num_blocks for b in free)
        assert rm.num_owned == owned[inst]
        assert rm.num_free + owned[inst] + gm.lent(inst) == rm.spec.num_blocks, f"instance {inst} leaks"


# ----- one rule at a time -----

def test_local_first_then_the_most_free_creditor():
    gm, (a, b, c) = _mesh((0, 4), (0, 8), (0, 8))
    a_req = a.allocate(1, 3)
    assert {p.instance for p in a_req.table} == {0}
    b.allocate(2, 5)  # b: 3 free, c: 8 free
    for i in gm.instances():
        gm.report(i, gm.rmanager(i).num_free)
    got = a.grow(1, 6)
    assert [p.instance for p in got.table] == [0, 0, 0, 0, 2, 2]
    assert gm.debts() == {(0, 2): 2} and gm.metrics()["lenders"] == {0: [2]}
    assert got.parts() == {0: (0, 1, 2, 3), 2: (4, 5)}
    assert got.local_tables(16, 5 * 16 + 3) == {0: ((0, 1, 2, 3), 64), 2: ((0, 1), 19)}
    assert got.runs() == ((0, 0, (0, 1, 2, 3)), (2, 4, (0, 1)))
    with pytest.raises(ValueError, match="request 1: 97 tokens do not fit its 6 rBlocks of 16"):
        got.local_tables(16, 97)
    _audit(gm)


def test_the_heartbeat_ranks_creditors():
    gm, (a, b, c) = _mesh((0, 2), (0, 8), (0, 8))
    gm.report(1, 8)
    gm.report(2, 3)  # stale or not, the report decides the order
    assert gm.creditors(0) == [1, 2]
    a.allocate(1, 3)
    assert a.table(1).table[-1].instance == 1
    with pytest.raises(ValueError, match="instance 2 reports 9 free rBlocks; its pool holds 8"):
        gm.report(2, 9)


def test_same_host_first_even_with_less_free():
    gm, (a, b, c) = _mesh((0, 1), (0, 2), (1, 10))
    assert gm.creditors(0) == [1, 2]
    table = a.allocate(1, 4).table
    assert [p.instance for p in table] == [0, 1, 1, 2]  # the same host until it has nothing, then host 1


def test_a_creditor_short_itself_refuses_until_the_mesh_has_nothing_else():
    gm, (a, b, c) = _mesh((0, 2), (0, 6, 4), (1, 6))
    a.allocate(1, 5)  # 2 local; b lends only above its reserve (2), c the rest
    assert [p.instance for p in a.table(1).table] == [0, 0, 1, 1, 2]
    assert b.lendable(last_resort=False) == 0 and a.lendable(last_resort=False) == 0
    c.allocate(2, 5)  # c: 0 free; a is in debt: it would refuse even with room
    assert gm.counters["last_resort"] == 0
    a.grow(1, 8)  # only b's reserve is left: the mesh has room, so the request is not refused
    assert [p.instance for p in a.table(1).table][-3:] == [1, 1, 1] and gm.counters["last_resort"] == 3
    with pytest.raises(OutOfBlocks, match=r"request 1 on instance 0 needs 2 more rBlocks; the mesh has 1 free"):
        a.grow(1, 10)
    assert len(a.table(1).table) == 8  # nothing taken by the refusal
    _audit(gm)


def test_a_debtor_does_not_lend_while_another_can():
    gm, (a, b, c) = _mesh((0, 2), (0, 4), (0, 4))
    a.allocate(1, 4)  # a borrows 2 from b (lowest id among equals)
    a.finish(1)
    a.allocate(3, 3)  # a owes b 1 and has 0 free
    c.allocate(2, 6)  # needs 2 borrowed: b is a creditor, not a debtor
    assert {p.instance for p in c.table(2).table[4:]} == {1}
    _audit(gm)


@pytest.mark.parametrize("end", ["finish", "cancel"])
def test_lent_blocks_go_back_when_their_request_ends(end):
    gm, (a, b) = _mesh((0, 2), (0, 4))
    a.allocate(1, 5)
    assert (gm.borrowed(0), gm.lent(1), b.num_free) == (3, 3, 1)
    getattr(a, end)(1)
    assert (gm.borrowed(0), gm.lent(1), a.num_free, b.num_free) == (0, 0, 2, 4)
    assert gm.counters["returned"] == 3 and gm.counters[end + "ed" if end == "finish" else "cancelled"] == 1
    assert gm.home_of(1) is None
    with pytest.raises(KeyError, match="request 1 is not on instance 0 \\(it is on no instance\\)"):
        a.finish(1)
    _audit(gm)


def test_recall_when_the_debtor_has_room_and_only_after_the_copy_is_confirmed():
    gm, (a, b) = _mesh((0, 4), (0, 4))
    device = _Device()
    device.write(a.allocate(1, 2))
    device.write(a.allocate(2, 4))  # borrows 2 from b
    a.finish(1)
    assert gm.borrowed(0) == 2 and a.num_free == 2
    plan = gm.plan_recalls()
    assert plan.swaps == 0 and [(s.instance, d.instance) for s, d in plan.copies()] == [(1, 0), (1, 0)]
    assert gm.borrowed(0) == 2  # the ledger waits for the device
    with pytest.raises(RuntimeError, match=f"cannot grow request 2: recall plan {plan.serial} is outstanding"):
        a.grow(2, 5)
    gm.abort(plan)
    assert a.num_free == 2 and gm.borrowed(0) == 2
    _audit(gm)
    plan = gm.plan_recalls()
    device.copy(plan)
    gm.confirm(plan)
    assert gm.borrowed(0) == 0 and b.num_free == 4 and a.num_free == 0
    assert {p.instance for p in a.table(2).table} == {0} and gm.counters["recalled"] == 2
    device.check(gm)
    _audit(gm)
    with pytest.raises(ValueError, match=f"recall plan {plan.serial} is not the outstanding one"):
        gm.confirm(plan)
    assert gm.plan_recalls().moves == ()


def test_recall_takes_from_the_neediest_creditor_and_respects_the_reserve():
    gm, (a, b, c) = _mesh((0, 4, 1), (0, 4), (0, 4))
    a.allocate(1, 4)
    b.allocate(3, 2)
    a.allocate(2, 4)  # 2 from c (most free), then 2 from b
    assert gm.debts() == {(0, 1): 2, (0, 2): 2}
    c.allocate(4, 1)  # b: 0 free, c: 1 free
    a.finish(1)  # a: 4 free, reserve 1: room for 3
    plan = gm.plan_recalls()
    assert [s.instance for s, _ in plan.copies()] == [1, 1, 2]
    gm.confirm(plan)
    assert gm.debts() == {(0, 2): 1} and a.num_free == 1  # the reserve stays free
    _audit(gm)


def test_circular_debt_is_broken_by_swaps():
    gm, (a, b) = _mesh((0, 4), (0, 4))
    device = _Device()
    device.write(a.allocate(1, 4))
    device.write(a.allocate(2, 2))  # a owes b 2
    device.write(b.allocate(3, 2))  # b is full
    a.finish(1)
    device.write(b.allocate(4, 3))  # b owes a 3 (a is a debtor: only the last resort lends)
    assert gm.debts() == {(0, 1): 2, (1, 0): 3}
    plan = gm.plan_recalls()
    assert plan.swaps == 2 and len(plan.moves) == 4  # a has 1 free, but nothing left to recall after the swaps
    assert {(s.instance, d.instance) for s, d in plan.copies()} == {(0, 1), (1, 0)}
    device.copy(plan)
    gm.confirm(plan)
    assert gm.debts() == {(1, 0): 1} and gm.counters["swapped"] == 2
    device.check(gm)
    _audit(gm)


def test_errors_name_the_request_and_instance():
    gm, (a, b) = _mesh((0, 2), (1, 2))
    a.allocate(7, 1)
    with pytest.raises(ValueError, match="request 7 already exists \\(on instance 0\\)"):
        b.allocate(7, 1)
    with pytest.raises(KeyError, match="request 7 is not on instance 1 \\(it is on instance 0\\)"):
        b.grow(7, 2)
    with pytest.raises(OutOfBlocks, match="request 8 on instance 1 needs 4 more rBlocks; the mesh has 3 free"):
        b.allocate(8, 4)
    assert gm.home_of(8) is None and 8 not in b.requests()
    with pytest.raises(ValueError, match="reserve 3 must be in \\[0, num_blocks 2\\]"):
        InstanceSpec(2, 0, 2, 3)
    with pytest.raises(ValueError, match="instance 0 is already registered"):
        RManager(InstanceSpec(0, 0, 2), gm)


# ----- 10,000 random operations -----

def _seed() -> int:
    return seed(97180)  # fixed: tests/seeds.py


def test_random_operations_keep_every_invariant():
    rng = random.Random(_seed())
    hosts = [rng.randrange(2) for _ in range(5)]
    gm, rms = _mesh(*[(h, rng.randint(3, 10), rng.randint(0, 2)) for h in hosts])
    device = _Device()
    next_request = 0
    seen_ops: dict[str, int] = {}
    for _ in range(10_000):
        live = [(rm, r) for rm in rms for r in rm.requests()]
        op = rng.choices(["allocate", "grow", "finish", "cancel", "report", "recall"], [4, 5, 2, 1, 2, 2])[0]
        if op in ("grow", "finish", "cancel") and not live:
            op = "allocate"
        seen_ops[op] = seen_ops.get(op, 0) + 1
        mesh_free = gm.total_free()
        if op == "allocate":
            rm, need = rng.choice(rms), rng.randint(0, 6)
            try:
                device.write(rm.allocate(next_request, need))
                assert need <= mesh_free
            except OutOfBlocks:
                assert need > mesh_free, f"refused {need} rBlocks with {mesh_free} free in the mesh"
            next_request += 1
        elif op == "grow":
            rm, r = rng.choice(live)
            old = len(rm.table(r).table)
            need = rng.randint(1, 4)
            try:
                device.write(rm.grow(r, old + need), start=old)
                assert need <= mesh_free
            except OutOfBlocks:
                assert need > mesh_free, f"refused {need} rBlocks with {mesh_free} free in the mesh"
                assert len(rm.table(r).table) == old
        elif op in ("finish", "cancel"):
            rm, r = rng.choice(live)
            getattr(rm, op)(r)
        elif op == "report":
            inst = rng.choice(gm.instances())
            truth = gm.rmanager(inst).num_free
            # Heartbeats may be stale: the ranking may be wrong, never the ledger.
            gm.report(inst, truth if rng.random() < 0.7 else rng.randint(0, gm.rmanager(inst).spec.num_blocks))
        else:
            plan = gm.plan_recalls()
            if plan.moves and rng.random() < 0.2:
                gm.abort(plan)
            elif plan.moves:
                # Each plan removes at least one loan, so planning again until nothing moves ends; a
                # confirm frees the recalled sources, which may give their creditor room for its own recall.
                while plan.moves:
                    loans = len(gm.loans())
                    device.copy(plan)
                    gm.confirm(plan)
                    assert len(gm.loans()) < loans
                    plan = gm.plan_recalls()
                # No circular debt is left, and no debtor with room above its reserve owes anything.
                debts = gm.debts()
                assert not any((b, a) in debts for a, b in debts), debts
                for inst in gm.instances():
                    rm = gm.rmanager(inst)
                    assert rm.num_free <= rm.spec.reserve or gm.borrowed(inst) == 0
        _audit(gm)
        device.check(gm)
    assert min(seen_ops.values()) > 500, seen_ops
    assert gm.counters["loans"] > 0 and gm.counters["recalled"] > 0, gm.counters


# ----- properties over many random meshes (fixed seeds) -----

def _random_mesh(rng, instances: int, hosts: int = 1):
    return _mesh(*[(int(rng.integers(hosts)), int(rng.integers(3, 11)), int(rng.integers(0, 3)))
                   for _ in range(instances)])


def _grow_or_allocate(rng, gm, rms, next_request: int) -> tuple[int, int, int]:
    """One random allocate or grow that the mesh can hold: (instance, request, rBlocks it adds)."""
    live = [(rm, r) for rm in rms for r in rm.requests()]
    if live and rng.random() < 0.5:
        rm, r = live[int(rng.integers(len(live)))]
        need = min(int(rng.integers(1, 5)), gm.total_free())
        rm.grow(r, len(rm.table(r).table) + need)
    else:
        rm = rms[int(rng.integers(len(rms)))]
        r, need = next_request, min(int(rng.integers(1, 7)), gm.total_free())
        rm.allocate(r, need)
    return rm.instance, r, need


def test_a_debtor_never_lends_unless_the_mesh_would_otherwise_refuse():
    """Property: in every borrow, no instance that owes rBlocks lends, unless the willing creditors (no debt,
    free above reserve) cannot cover the loan: then (the last-resort pass) they are emptied to their reserves
    first, and debtors lend no more than the shortfall."""
    exercised = 0  # borrows where a debtor had rBlocks above its reserve and a willing creditor could cover it
    for seed in range(40):
        rng = np.random.default_rng(seed)
        gm, rms = _random_mesh(rng, int(rng.integers(3, 6)))
        next_request = 0
        for _ in range(300):
            live = [(rm, r) for rm in rms for r in rm.requests()]
            if live and rng.random() < 0.35:
                rm, r = live[int(rng.integers(len(live)))]
                rm.finish(r)
                continue
            if rng.random() < 0.3:
                i = int(rng.integers(len(rms)))
                gm.report(i, rms[i].num_free)
            if gm.total_free() == 0:
                continue
            debtors = {i for i in gm.instances() if gm.borrowed(i)}
            free = {rm.instance: rm.num_free for rm in rms}
            loans_before = set(gm.loans())
            home, request, added = _grow_or_allocate(rng, gm, rms, next_request)
            next_request += 1
            borrowed = added - min(added, free[home])
            if not borrowed:
                continue
            willing = sum(max(0, free[rm.instance] - rm.spec.reserve) for rm in rms
                          if rm.instance != home and rm.instance not in debtors)
            new = [loan for loan in gm.loans() if loan not in loans_before]
            assert len(new) == borrowed and all(loan.request == request for loan in new)
            from_debtors = sum(loan.creditor in debtors for loan in new)
            ctx = f"seed {seed}: instance {home} borrowed {borrowed}, willing {willing}, debtors {debtors}, free {free}"
            if borrowed <= willing:
                assert from_debtors == 0, ctx
                exercised += any(free[d] > gm.rmanager(d).spec.reserve for d in debtors - {home})
            else:
                assert from_debtors <= borrowed - willing, ctx
                assert all(rm.num_free <= rm.spec.reserve for rm in rms
                           if rm.instance != home and rm.instance not in debtors), ctx
            _audit(gm)
    assert exercised > 50, exercised


def test_loans_between_heartbeats_lower_the_reported_count():
    """Property: between heartbeats the GManager ranks creditors by the last report less what it lent since
    (never below 0), so a second loan goes to the next creditor once the first reports fewer free."""
    for seed in range(40):
        rng = np.random.default_rng(seed)
        gm, rms = _random_mesh(rng, int(rng.integers(3, 6)), hosts=2)
        reported = {rm.instance: rm.spec.num_blocks for rm in rms}  # registering reports a full pool
        next_request = 0
        for _ in range(200):
            live = [(rm, r) for rm in rms for r in rm.requests()]
            if live and rng.random() < 0.3:
                rm, r = live[int(rng.integers(len(live)))]
                rm.finish(r)  # returns change no report: only a heartbeat does
            elif rng.random() < 0.15:
                i = int(rng.integers(len(rms)))
                reported[i] = int(rng.integers(0, rms[i].spec.num_blocks + 1))  # stale or not
                gm.report(i, reported[i])
            elif gm.total_free():
                before = set(gm.loans())
                _grow_or_allocate(rng, gm, rms, next_request)
                next_request += 1
                for loan in set(gm.loans()) - before:
                    reported[loan.creditor] = max(0, reported[loan.creditor] - 1)
            for d in gm.instances():
                host = gm.rmanager(d).spec.host
                want = sorted((i for i in reported if i != d),
                              key=lambda i: (gm.rmanager(i).spec.host != host, -reported[i], i))
                assert gm.creditors(d) == want, (seed, d, reported)


def test_two_loans_between_heartbeats_go_to_two_creditors():
    """Property: creditors that reported the same free count share two back-to-back loans: the first goes to
    the lowest id, which then reports fewer free, so the second goes to the next one."""
    rng = np.random.default_rng(2024)
    for _ in range(200):
        creditors, size = int(rng.integers(2, 5)), int(rng.integers(2, 9))
        gm, rms = _mesh((0, 1), *[(0, size)] * creditors)
        first, second = (int(rng.integers(1, size)) for _ in range(2))
        rms[0].allocate(1, 1 + first)  # one local rBlock, the rest borrowed
        rms[0].allocate(2, second)
        lenders = [{p.instance for p in rms[0].table(r).table if p.instance != 0} for r in (1, 2)]
        assert lenders == [{1}, {2}], (creditors, size, first, second, lenders)
