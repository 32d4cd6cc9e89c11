"""Several serving instances behind one engine: a scheduler and an rBlock pool each, lending through DistKV.

The engine core drives one scheduler; with the mesh's `instance` axis longer than 1 that scheduler is an
`InstanceSchedulers`: one `Scheduler` per instance, each over a `LendingAllocator` of that instance's
`RManager`, and one `GManager` (the debt ledger) for them all. A request goes to the least-loaded instance
(fewest tokens queued and running; the lowest id on a tie) and stays there: its home instance runs it and
merges its attention, wherever its rBlocks are. A step joins every instance's plan (rows grouped by
instance, `StepPlan.instances` naming each row's home); the runner gives each instance its own rows.

After every step each instance reports its free rBlocks (the heartbeat), and when a debtor has room again
the GManager plans recalls (and swaps for circular debts); `recall_plan` hands the plan to the runner, which
copies the rBlocks on the device before `confirm_recall` moves the tables. Nothing is refused or preempted
while the mesh has free rBlocks (lending on); with lending off each instance lives within its pool.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection

import numpy as np

from jaxllm.engine.distkv import GManager, InstanceSpec, RecallPlan, RManager
from jaxllm.engine.lending import LendingAllocator
from jaxllm.engine.sampling import SamplingParams
from jaxllm.engine.scheduler import Scheduler, Sequence, StepPlan

__all__ = ["InstanceSchedulers", "PoolTotals"]


class PoolTotals:
    """The pool seen as one (the engine's stats): every instance's rBlocks."""

    def __init__(self, allocators: list[LendingAllocator]):
        self._allocators = allocators

    @property
    def num_blocks(self) -> int:
        return sum(a.num_blocks for a in self._allocators)

    @property
    def num_free(self) -> int:
        return sum(a.rmanager.num_free for a in self._allocators)

    @property
    def num_cached(self) -> int:
        return 0


class InstanceSchedulers:
    """One scheduler per instance, with the engine core's Scheduler interface."""

    def __init__(self, instances: int, blocks_per_instance: int, block_size: int, *, max_tokens_per_step: int,
                 max_seqs: int, lending: bool = True, hosts: list[int] | None = None, reserve: int = 0):
        """instances: the mesh's instance axis; blocks_per_instance: each instance's pool; max_tokens_per_step
        and max_seqs: each instance's step budget (a step runs every instance's rows side by side);
        hosts: each instance's host (lending prefers the same host); reserve: rBlocks an instance keeps from
        lending."""
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
        # Sequence ids i, i + n, i + 2n, ...: an id names its instance (id % n) engine-wide.
        self.schedulers = [Scheduler(a, block_size, max_tokens_per_step=max_tokens_per_step, max_seqs=max_seqs,
                                     prefix_caching=False, seq_ids=itertools.count(i, instances))
                           for i, a in enumerate(self.allocators)]
        self.allocator = PoolTotals(self.allocators)
        self.prefix_caching = False
        self._recall: RecallPlan | None = None

    # ----- the Scheduler interface the engine core uses -----

    @property
    def waiting(self) -> list[Sequence]:
        return [seq for s in self.schedulers for seq in s.waiting]

    @property
    def running(self) -> list[Sequence]:
        return [seq for s in self.schedulers for seq in s.running]

    @property
    def cached_tokens(self) -> int:
        return 0

    @property
    def preemptions(self) -> int:
        return sum(s.preemptions for s in self.schedulers)

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

    def plan(self) -> StepPlan | None:
        """Every instance's next step, joined (rows grouped by instance), or None when none can run."""
        plans = [(i, p) for i, s in enumerate(self.schedulers) if (p := s.plan()) is not None]
        if not plans:
            return None
        return join_plans(plans)

    def plan_continuation(self, prev: StepPlan) -> StepPlan | None:
        """Not with several instances: each step is planned after the previous one's tokens are in (the
        heartbeat and recalls run between steps)."""
        del prev
        return None

    def update(self, plan: StepPlan, sampled: np.ndarray, eos_id: int | Collection[int],
               logprobs=None) -> list[Sequence]:
        """Each instance records its own rows (a scheduler skips ids that are not its own); then the
        heartbeat: every instance reports its free rBlocks to the GManager."""
        advanced = [seq for s in self.schedulers for seq in s.update(plan, sampled, eos_id, logprobs)]
        for a in self.allocators:
            self.gmanager.report(a.instance, a.rmanager.num_free)
        return advanced

    # ----- recalls -----

    def recall_copies(self) -> list[tuple[int, int]]:
        """The GManager's next recall plan as rBlock copies (global source id, global destination id), all
        reads before any write; [] when nothing moves. The caller copies them on the device, then calls
        confirm_recall; until then no table may change."""
        if not self.lending or self._recall is not None or not self.gmanager.loans():
            return []
        plan = self.gmanager.plan_recalls()
        if not plan.moves:
            return []
        self._recall = plan
        return [(self.global_id(src), self.global_id(dst)) for src, dst in plan.copies()]

    def confirm_recall(self) -> None:
        if self._recall is not None:
            self.gmanager.confirm(self._recall)
            self._recall = None

    def global_id(self, placement) -> int:
        return placement.instance * self.blocks_per_instance + placement.block

    def lending_stats(self) -> dict:
        """Borrowed and lent rBlocks per instance, lenders per debtor, and the ledger's counters."""
        return self.gmanager.metrics()


def join_plans(plans: list[tuple[int, StepPlan]]) -> StepPlan:
    """Instances' plans as one StepPlan: rows in instance order, tokens packed likewise, `instances` naming
    each row's home. Block tables are padded to the widest."""
    width = max(p.block_tables.shape[1] for _, p in plans)
    tables = [np.pad(p.block_tables, ((0, 0), (0, width - p.block_tables.shape[1]))) for _, p in plans]
    offsets = np.cumsum([0] + [p.num_tokens for _, p in plans])
    cu = np.concatenate([[0]] + [p.cu_q_lens[1:] + off for (_, p), off in zip(plans, offsets)])
    cat = lambda name: np.concatenate([getattr(p, name) for _, p in plans])  # noqa: E731
    return StepPlan(
        seq_ids=cat("seq_ids"), token_ids=cat("token_ids"), positions=cat("positions"),
        slot_mapping=cat("slot_mapping"), cu_q_lens=cu.astype(np.int32), kv_lens=cat("kv_lens"),
        block_tables=np.concatenate(tables), sample=cat("sample"), temperature=cat("temperature"),
        top_k=cat("top_k"), top_p=cat("top_p"), seed=cat("seed"),
        logprobs=None if any(p.logprobs is None for _, p in plans) else cat("logprobs"),
        instances=np.concatenate([np.full(p.num_seqs, i, np.int32) for i, p in plans]),
        kv_extent=(sum(p.kv_extent[0] for _, p in plans), max(p.kv_extent[1] for _, p in plans)))
