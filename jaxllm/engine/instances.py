"""Several serving instances behind one engine: a scheduler and an rBlock pool each, lending through DistKV.

The engine core drives one StepScheduler (jaxllm.engine.scheduling); with the mesh's `instance` axis longer
than 1 that is an `InstanceSchedulers`: one `Scheduler` per instance, each over a `LendingAllocator` of that
instance's `RManager`, and one `GManager` (the debt ledger) for them all. A request goes to the
least-loaded instance (fewest tokens queued and running; the lowest id on a tie) and stays there: its home
instance runs it and merges its attention, wherever its rBlocks are. A step joins every instance's plan
(rows grouped by instance, `StepPlan.instances` naming each row's home); the executor gives each instance
its own rows. Each instance keeps its own prefix cache (lending.py says what it caches).

After every step each instance reports its free rBlocks (the heartbeat). When a debtor has room again the
GManager plans recalls (and swaps for circular debts): `plan()` puts them on the step as
`StepPlan.block_copies`, which the executor copies on the device before the step, and moves the tables at
once (device work runs in dispatch order, so every later step reads the rBlocks where they landed).
Decode continuations run as on one instance when every instance can continue. Nothing is refused or
preempted while the mesh has free rBlocks (lending on); with lending off each instance lives within its pool.

With a host tier each instance's scheduler has its own (jaxllm.engine.host_tier: slots i * host_blocks + local),
its pool's prefix cache spilling there. A step's host copies are every instance's, joined; the host copies out run
before the recall copies (a spill reads an evicted rBlock that a recall may be about to fill) and read a recalled
rBlock at its source (`HostTier.moved`), the copies in after them. A spill caused by another instance's loan
(the creditor's pool evicts) rides on the same step: every tier's copies are taken after every instance planned.

Context-parallel prefill (jaxllm.engine.spread; `spread_prompts`, lending on, several instances): a long prompt is
spread, one piece of it an instance per step, its rBlocks striped across the instances; fewer long prompts than
instances: the oldest is spread, as many or more: each instance prefills its own. Spread steps and ordinary steps
alternate while other requests have work. `prefill_reports` keeps each prefill's per-instance work and steps.

Speculative decoding: one step runs one program, so a step verifies on every instance or on none. Each instance
plans its rows without speculating; when every instance's plan may become a verify step (Scheduler.draft_requests)
the proposer drafts for all of their rows at once (one batch: a draft model's step serves every instance) and each
instance turns its plan into its verify rows (an instance whose rows got no draft too: they verify nothing).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Collection

import numpy as np

from jaxllm.contract import (HostCopies, LendingStats, LogitBias, RowPenalties, SamplingParams, SchedulerStats,
                             StepKind, StepPlan)
from jaxllm.engine.distkv import GManager, InstanceSpec, RManager
from jaxllm.engine.host_tier import HostTier
from jaxllm.engine.lending import LendingAllocator
from jaxllm.engine.scheduler import Scheduler
from jaxllm.engine.sequence import Sequence
from jaxllm.engine.spread import PrefillReports, PromptSpread
from jaxllm.engine.speculative import Proposer, Speculation

__all__ = ["InstanceSchedulers", "join_plans"]


class InstanceSchedulers:
    """The StepScheduler (jaxllm.engine.scheduling) of several instances: one Scheduler each, joined plans."""

    def __init__(self, instances: int, blocks_per_instance: int, block_size: int, *, max_tokens_per_step: int,
                 max_seqs: int, lending: bool = True, prefix_caching: bool = True, hosts: list[int] | None = None,
                 reserve: int = 0, host_blocks: int = 0, proposer: Proposer | None = None,
                 speculative_tokens: int = 0, spread_prompts: bool = True):
        """instances: the mesh's instance axis; blocks_per_instance: each instance's pool; max_tokens_per_step
        and max_seqs: each instance's step budget (a step runs every instance's rows side by side);
        hosts: each instance's host (lending prefers the same host); reserve: rBlocks an instance keeps from
        lending; host_blocks: the slots of each instance's host tier (0: none); proposer and speculative_tokens:
        speculative decoding's draft source and k (None: off), each instance counting its own verify rows;
        spread_prompts: a long prompt is prefilled by every instance at once (jaxllm.engine.spread; with lending on
        and several instances), else chunk by chunk on its home."""
        if instances < 1:
            raise ValueError(f"instances must be >= 1, got {instances}")
        hosts = hosts or [0] * instances
        if len(hosts) != instances:
            raise ValueError(f"hosts names {len(hosts)} instances, the engine has {instances}")
        self.instances = instances
        self.block_size = block_size
        self.blocks_per_instance = blocks_per_instance
        self.max_tokens_per_step = max_tokens_per_step
        self.max_seqs = max_seqs
        self.lending = lending
        self.gmanager = GManager()
        self.allocators = [
            LendingAllocator(RManager(InstanceSpec(i, hosts[i], blocks_per_instance, reserve), self.gmanager),
                             self.gmanager, lending=lending)
            for i in range(instances)]
        self.host_tiers = [HostTier(host_blocks, first_slot=i * host_blocks) for i in range(instances)] \
            if host_blocks else []
        for i, allocator in enumerate(self.allocators if self.host_tiers else []):
            allocator.rmanager.pool.on_evict = functools.partial(self._spill, i)
        self._pending_copies: list[HostCopies] = []  # of continuations that were dropped: ride on the next plan
        # Sequence ids i, i + n, i + 2n, ...: an id names its instance (id % n) engine-wide.
        self.proposer = proposer
        self.schedulers = [Scheduler(a, block_size, max_tokens_per_step=max_tokens_per_step, max_seqs=max_seqs,
                                     prefix_caching=prefix_caching, seq_ids=itertools.count(i, instances),
                                     host_tier=self.host_tiers[i] if self.host_tiers else None,
                                     takes_host_copies=False,
                                     speculation=None if proposer is None else Speculation(proposer,
                                                                                           speculative_tokens))
                           for i, a in enumerate(self.allocators)]
        self._last: tuple[StepPlan, list[tuple[int, StepPlan]]] | None = None  # the last joined plan, its parts
        self.spread = PromptSpread(self.schedulers, max_tokens_per_step) \
            if spread_prompts and lending and instances > 1 else None
        self._spread_ran = False  # the last plan was a spread step (the next one is the others', if they have work)
        self.prefill_reports = PrefillReports(instances, blocks_per_instance, block_size)

    # ----- requests -----

    @property
    def running(self) -> list[Sequence]:
        return [seq for s in self.schedulers for seq in s.running]

    @property
    def waiting(self) -> list[Sequence]:
        return [seq for s in self.schedulers for seq in s.waiting]

    def load(self, instance: int) -> int:
        """Tokens queued and running on `instance` (what routing balances)."""
        s = self.schedulers[instance]
        return sum(seq.num_tokens for seq in s.waiting) + sum(seq.num_tokens for seq in s.running)

    def add(self, prompt_ids: list[int], params: SamplingParams, max_len: int, *, reuse_prefix: bool = True
            ) -> Sequence:
        home = min(range(self.instances), key=lambda i: (self.load(i), i))
        return self.schedulers[home].add(prompt_ids, params, max_len, reuse_prefix=reuse_prefix)

    def home(self, seq_id: int) -> int:
        return int(seq_id) % self.instances

    def sequence(self, seq_id: int) -> Sequence | None:
        return self.schedulers[self.home(seq_id)].sequence(seq_id)

    def cancel(self, seq: Sequence) -> None:
        self.schedulers[self.home(seq.seq_id)].cancel(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        self.schedulers[self.home(seq.seq_id)].finish(seq, reason)

    def has_work(self) -> bool:
        return any(s.has_work() for s in self.schedulers)

    # ----- planning -----

    def plan(self) -> StepPlan | None:
        """Every instance's next step, joined (rows grouped by instance), with the recall copies to do first;
        None when nothing can run."""
        copies = self._recall()
        moved = {} if copies is None else {int(dst): int(src) for src, dst in copies}
        for tier in self.host_tiers:
            tier.moved = moved
        try:
            plans = self._spread_step()
            if plans is None:
                plans = [(i, p) for i, s in enumerate(self.schedulers) if (p := s.plan(speculate=False)) is not None]
        finally:
            for tier in self.host_tiers:
                tier.moved = {}
        if self.proposer is not None and plans:
            plans = self._verified(plans) or plans
        host = self._host_copies()
        if not plans and copies is None and host is None:
            return None
        return self._joined(plans, copies, host)

    def _spread_step(self) -> list[tuple[int, StepPlan]] | None:
        """The spread prompt's step (jaxllm.engine.spread), unless the last step was one and other requests have
        work (they alternate), or none can run."""
        if self.spread is None or self.spread.choose() is None:
            self._spread_ran = False
            return None
        plans = None if self._spread_ran and self.spread.others_have_work() else self.spread.step()
        self._spread_ran = plans is not None
        return plans

    def _verified(self, plans: list[tuple[int, StepPlan]]) -> list[tuple[int, StepPlan]] | None:
        """Every instance's plan as its verify rows (the module docstring), or None when some instance's may not
        be one, no row got a draft, or some instance lacks the rBlocks (those grown for others stay theirs)."""
        requests = [self.schedulers[i].draft_requests(p) for i, p in plans]
        if any(r is None for r in requests):
            return None
        asked = [(seq, k) for r in requests for seq, k in r if k]
        drafts = {seq.seq_id: d for (seq, _), d in zip(asked, self.proposer.propose(asked)) if d}
        if not drafts:
            return None
        verified = []
        for i, p in plans:
            v = self.schedulers[i].verify(p, drafts, force=True)
            if v is None:
                return None
            verified.append((i, v))
        return verified

    def _joined(self, plans: list[tuple[int, StepPlan]], copies: np.ndarray | None = None,
                host: HostCopies | None = None) -> StepPlan:
        """join_plans, remembering the parts: a continuation of the joined plan starts from them."""
        joined = join_plans(plans, block_copies=copies, host_copies=host)
        self._last = (joined, plans)
        return joined

    def _spill(self, instance: int, key: bytes, local: int) -> bool:
        """Instance `instance`'s pool evicts cached rBlock `local`: its host tier keeps it."""
        return self.host_tiers[instance].spill(key, instance * self.blocks_per_instance + local)

    def _host_copies(self) -> HostCopies | None:
        """The host copies a step needs, taken once every instance has planned (a loan makes its creditor evict
        and spill, and a slot read by a copy in is free only once the step's copies are taken): those of dropped
        continuations first (older copies out land first), then every tier's."""
        parts, self._pending_copies = self._pending_copies + [tier.take_copies() for tier in self.host_tiers], []
        return HostCopies.join(parts)

    def plan_continuation(self, prev: StepPlan) -> StepPlan | None:
        """The decode step after `prev` (see Scheduler.plan_continuation) when every instance that ran in prev
        can continue and no other instance has work waiting; otherwise None."""
        if prev.instances is None or prev.kind is not StepKind.DECODE or prev.block_copies is not None:
            return None
        if self._last is not None and self._last[0] is prev:
            parts = self._last[1]  # the plans prev was joined from
        else:
            bounds = prev.instance_bounds(self.instances)
            parts = [(i, prev.rows(bounds[i], bounds[i + 1])) for i in range(self.instances) if bounds[i + 1] > bounds[i]]
        ran = {i for i, _ in parts}
        if any(self.schedulers[i].has_work() for i in range(self.instances) if i not in ran):
            return None
        plans = []
        for i, part in parts:
            following = self.schedulers[i].plan_continuation(part)
            if following is None:
                # rBlocks grown for the others stay theirs: harmless, the next plan uses them; the copies out of
                # what their grows evicted must run before that plan's step writes them.
                copies = self._host_copies()
                self._pending_copies = [] if copies is None else [copies]
                return None
            plans.append((i, following))
        host = self._host_copies()
        if all(following.block_tables is part.block_tables for (_, part), (_, following) in zip(parts, plans)):
            # No table grew (most steps): the joined plan one token on, its tables prev's (StepPlan.next_decode),
            # equal to joining the parts anew, and the executor advances prev's inputs instead of laying them out.
            joined = prev.next_decode(self.block_size, host_copies=host)
            self._last = (joined, plans)
            return joined
        return self._joined(plans, host=host)

    def _recall(self) -> np.ndarray | None:
        """The GManager's recall plan as rBlock copies [M, 2] (global source, global destination), tables and
        ledger moved at once (the executor copies before the step that reads them); None when nothing moves."""
        if not self.lending or not self.gmanager.loans():
            return None
        plan = self.gmanager.plan_recalls()
        if not plan.moves:
            return None
        copies = np.array([(self.global_id(src), self.global_id(dst)) for src, dst in plan.copies()], np.int32)
        self.gmanager.confirm(plan)
        return copies

    def global_id(self, placement) -> int:
        return placement.instance * self.blocks_per_instance + placement.block

    # ----- results -----

    def update(self, plan: StepPlan, sampled: np.ndarray, eos_id: int | Collection[int],
               logprobs=None, prompt_logprobs=None) -> list[Sequence]:
        """Each instance records its own rows (a scheduler skips ids that are not its own); then the
        heartbeat: every instance reports its free rBlocks to the GManager."""
        self._report(plan)
        advanced = [seq for s in self.schedulers for seq in s.update(plan, sampled, eos_id, logprobs, prompt_logprobs)]
        self._heartbeat()
        return advanced

    def record_computed(self, plan: StepPlan) -> None:
        self._report(plan)
        for s in self.schedulers:
            s.record_computed(plan)
        self._heartbeat()

    def _report(self, plan: StepPlan) -> None:
        """The step's prompt rows into the prefill reports (before the schedulers record it: a sequence may end)."""
        def prompt_len(seq_id: int) -> int | None:
            seq = self.sequence(seq_id)
            return None if seq is None else len(seq.prompt_ids)

        self.prefill_reports.record(plan, prompt_len)

    def _heartbeat(self) -> None:
        for a in self.allocators:
            self.gmanager.report(a.instance, a.rmanager.num_free)

    def stats(self) -> SchedulerStats:
        """Every instance's queue, pool and host tier summed, with the lending ledger's figures (free rBlocks as
        the lending allocators count them)."""
        ledger = self.gmanager.metrics()
        lending = LendingStats(borrowed_by_instance=tuple(ledger["borrowed"][i] for i in sorted(ledger["borrowed"])),
                               lending_instances=sum(1 for n in ledger["lent"].values() if n),
                               loans_total=ledger["loans"], recalled_blocks_total=ledger["recalled"],
                               swapped_pairs_total=ledger["swapped"])
        total = sum((s.stats() for s in self.schedulers), SchedulerStats())
        return dataclasses.replace(total, pool_blocks_free=sum(a.rmanager.num_free for a in self.allocators),
                                   lending=lending)


def join_plans(plans: list[tuple[int, StepPlan]], block_copies: np.ndarray | None = None,
               host_copies: HostCopies | None = None) -> StepPlan:
    """Instances' plans as one StepPlan: rows in instance order, tokens packed likewise, `instances` naming
    each row's home. Block tables are padded to the widest. No plans: a step of copies alone. Verify plans (all
    of them or none) join into a verify plan."""
    if not plans:
        return StepPlan.copies_only(block_copies=block_copies, host_copies=host_copies, instances=True)
    width = max(p.block_tables.shape[1] for _, p in plans)
    tables = np.zeros((sum(p.num_seqs for _, p in plans), width), np.int32)
    row = 0
    for _, p in plans:
        tables[row:row + p.num_seqs, :p.block_tables.shape[1]] = p.block_tables
        row += p.num_seqs
    offsets = np.cumsum([0] + [p.num_tokens for _, p in plans])
    cu = np.concatenate([[0]] + [p.cu_q_lens[1:] + off for (_, p), off in zip(plans, offsets)])
    cat = lambda name: np.concatenate([getattr(p, name) for _, p in plans])  # noqa: E731
    return StepPlan(
        seq_ids=cat("seq_ids"), token_ids=cat("token_ids"), positions=cat("positions"),
        slot_mapping=cat("slot_mapping"), cu_q_lens=cu.astype(np.int32), kv_lens=cat("kv_lens"),
        block_tables=tables, sample=cat("sample"), temperature=cat("temperature"),
        top_k=cat("top_k"), top_p=cat("top_p"), seed=cat("seed"),
        logprobs=None if any(p.logprobs is None for _, p in plans) else cat("logprobs"),
        targets=None if all(p.targets is None for _, p in plans) else np.concatenate(
            [np.full(p.num_tokens, -1, np.int32) if p.targets is None else p.targets for _, p in plans]),
        instances=np.concatenate([np.full(p.num_seqs, i, np.int32) for i, p in plans]),
        block_copies=block_copies,
        host_copies=host_copies,
        penalties=RowPenalties.join([p.penalties for _, p in plans], [p.num_seqs for _, p in plans]),
        logit_bias=LogitBias.join([p.logit_bias for _, p in plans], [p.num_seqs for _, p in plans]),
        kv_extent=(sum(p.kv_extent[0] for _, p in plans), max(p.kv_extent[1] for _, p in plans)),
        kind=StepKind.VERIFY if all(p.kind is StepKind.VERIFY for _, p in plans) else None)
