"""Context-parallel prefill: a long prompt prefilled by every instance at once, and what each instance did. Pure Python.

On one instance a prompt longer than a step's token budget (a chunk) is prefilled chunk after chunk. On a mesh of
several instances (InstanceSchedulers, lending on) such a prompt is SPREAD instead:

- Placement. Its rBlocks are striped (LendingAllocator.stripe: table entry e on instance e % instances), so every
  instance holds an equal share of every stretch of it. The attention of a query runs where its keys live
  (DistAttention), so each instance does an equal share of the attention work, in prefill and in every decode
  step afterwards (which reads every instance's share at once, as any borrowed decode does). The striped loans
  are placement, not debt: never recalled (distkv).
- Steps. A spread step gives instance j the j-th of up to `instances` consecutive pieces of the prompt, each at
  most one chunk (the step budget) long and the step's tokens split evenly among them, so each piece's matmuls run
  on its instance. Each piece is a plan row of the same sequence homed on that instance (rows in instance order,
  so positions increase with the row and the home scheduler records the last one's kv_len). DistAttention gathers
  the step's new q/k/v and writes each token's K/V where its rBlock lives before any instance attends, so piece j
  sees pieces 0 .. j-1 of the same step as past KV, and its own keys causally from the step's chunk pool; every
  partial is merged exactly on the piece's instance (residuals.merge_partials, the one merge). A prompt of N
  chunks takes about N / instances steps instead of N.
- The rule for several long prompts (a long prompt: more than one chunk of its prompt left, not penalized, not
  scoring its prompt). Fewer long prompts than instances: the oldest is spread (one at a time: the others run
  chunk by chunk on their homes, as requests are routed to the least-loaded instance). As many as instances or
  more: none is spread, each instance prefills its own, already in parallel. While a prompt is spread and other
  requests have work, spread steps and ordinary steps alternate, so decodes wait at most one step.
- It composes: tensor parallelism inside each instance and int8 KV are the executor's as for any borrowed step; a
  cached prefix is shared at admission (the home's cached rBlocks: past KV like any other) and the rest is
  striped; host tiers and lending are unchanged (a spread prompt preempted is admitted and spread again).
  A spread step is a prefill step of the instances' ordinary buckets (pieces of at most one chunk, one row each),
  so it compiles nothing after warm-up.

`PrefillReports` keeps, per prefill (spread or not), each instance's share of the work: matmul tokens (the
prompt tokens whose projections ran there) and attention key-query products (each query times the keys it reads
on that instance, its own chunk's causal triangle on its row's instance), and the steps it took.
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

from jaxllm.contract import StepKind, StepPlan
from jaxllm.engine.allocator import OutOfBlocks
from jaxllm.engine.plan_rows import assemble_plan
from jaxllm.engine.scheduler import Scheduler
from jaxllm.engine.sequence import Sequence, Status

__all__ = ["PrefillReport", "PrefillReports", "PromptSpread", "piece_sizes"]


def piece_sizes(tokens: int, instances: int, chunk: int) -> list[int]:
    """A spread step's pieces: `tokens` (at most instances x chunk) split as evenly as can be over
    min(instances, tokens) instances, in order."""
    if not 0 < tokens <= instances * chunk:
        raise ValueError(f"a spread step holds 1 .. {instances} x {chunk} tokens, got {tokens}")
    pieces = min(instances, tokens)
    return [tokens // pieces + (j < tokens % pieces) for j in range(pieces)]


class PromptSpread:
    """Which long prompt the instances spread, and its steps (the module docstring)."""

    def __init__(self, schedulers: list[Scheduler], chunk: int):
        """schedulers: one per instance, in instance order (their allocators LendingAllocators with lending on);
        chunk: tokens a step gives one instance (the step budget)."""
        self.schedulers = schedulers
        self.chunk = chunk
        self.seq: Sequence | None = None  # the prompt being spread
        self.home = -1

    @property
    def instances(self) -> int:
        return len(self.schedulers)

    def long(self, seq: Sequence) -> bool:
        """Whether seq is a long prompt (the module's rule): more than one chunk of its prompt to compute."""
        return (seq.num_computed < len(seq.prompt_ids) and seq.num_tokens - seq.num_computed > self.chunk
                and not seq.params.penalized and seq.params.prompt_logprobs is None)

    def choose(self) -> Sequence | None:
        """The prompt to spread now: the one being spread until its prompt is computed, else by the rule."""
        if self.seq is not None:
            if self.seq.status is not Status.FINISHED and self.seq.num_computed < len(self.seq.prompt_ids):
                return self.seq
            self.release()
        candidates = [(i, seq) for queue in ("running", "waiting") for i, s in enumerate(self.schedulers)
                      for seq in getattr(s, queue) if self.long(seq)]
        if not candidates or len(candidates) >= self.instances:
            return None
        self.home, self.seq = candidates[0]  # running before waiting: the oldest started first
        self.schedulers[self.home].held.add(self.seq.seq_id)
        return self.seq

    def release(self) -> None:
        """The spread prompt goes back to its home scheduler (its prompt computed, finished, or it cannot grow)."""
        if self.seq is not None:
            self.schedulers[self.home].held.discard(self.seq.seq_id)
        self.seq, self.home = None, -1

    def others_have_work(self) -> bool:
        """Whether some request other than the spread prompt has work (then steps alternate)."""
        held = None if self.seq is None else self.seq.seq_id
        return any(seq.seq_id != held for s in self.schedulers for seq in s.running + s.waiting)

    def step(self) -> list[tuple[int, StepPlan]] | None:
        """The spread step's plans, one piece an instance ((instance, plan) in instance order), its rBlocks grown
        striped; None when it cannot run now (its admission lacks a seat or rBlocks: it waits, held; a running one
        that cannot grow is released to its home, which preempts for it as for any sequence)."""
        seq, home = self.seq, self.schedulers[self.home]
        total = min(seq.num_tokens - seq.num_computed, self.instances * self.chunk)
        home.allocator.stripe(seq.seq_id)
        if seq.status is Status.WAITING:
            if len(home.running) >= home.max_seqs:
                return None
            planned = home.admit(seq, total)
            if planned is None:
                return None
            total = planned
        else:
            try:
                home.allocator.grow(seq.seq_id, -(-(seq.num_computed + total) // home.block_size))
            except OutOfBlocks:
                self.release()
                return None
        table = home.allocator.blocks(seq.seq_id)
        plans, start = [], seq.num_computed
        for j, size in enumerate(piece_sizes(total, self.instances, self.chunk)):
            row = (seq, start, seq.token_slice(start, start + size), start + size == seq.num_tokens)
            plans.append((j, assemble_plan([row], [table], home.block_size)))
            start += size
        return plans


@dataclasses.dataclass(frozen=True)
class PrefillReport:
    """One prompt's prefill: per instance its matmul tokens and attention key-query products, the steps it took,
    and whether it was spread."""

    seq_id: int
    prompt_tokens: int
    matmul_tokens: tuple[int, ...]
    attention: tuple[int, ...]
    steps: int
    spread: bool

    @staticmethod
    def _balance(shares: tuple[int, ...]) -> float:
        mean = sum(shares) / len(shares)
        return max(shares) / mean if mean else 1.0

    @property
    def attention_balance(self) -> float:
        """The busiest instance's attention work over the mean."""
        return self._balance(self.attention)

    @property
    def matmul_balance(self) -> float:
        """The busiest instance's matmul tokens over the mean."""
        return self._balance(self.matmul_tokens)


class PrefillReports:
    """The work of every prompt's prefill on the instances, step by step; the last `keep` finished ones kept."""

    def __init__(self, instances: int, blocks_per_instance: int, block_size: int, keep: int = 64):
        self.instances = instances
        self.blocks_per_instance = blocks_per_instance
        self.block_size = block_size
        self._open: dict[int, dict] = {}
        self.finished: collections.deque[PrefillReport] = collections.deque(maxlen=keep)

    def record(self, plan: StepPlan, prompt_len) -> None:
        """Count a step's prompt rows (prompt_len(seq_id): its prompt's tokens, None for a sequence gone). A
        sequence with several rows in the step is spread. A prompt whose last prompt token ran is reported."""
        if plan.kind is not StepKind.PREFILL or plan.num_seqs == 0:
            return
        ids, rows = np.unique(plan.seq_ids, return_counts=True)
        spread = set(ids[rows > 1].tolist())
        homes = np.zeros(plan.num_seqs, np.int64) if plan.instances is None else plan.instances.astype(np.int64)
        counted: set[int] = set()
        for r, seq_id in enumerate(plan.seq_ids.tolist()):
            prompt = prompt_len(seq_id)
            kv_len, q_len = int(plan.kv_lens[r]), int(plan.cu_q_lens[r + 1] - plan.cu_q_lens[r])
            if prompt is None or kv_len > prompt or q_len == 0:
                continue  # a decode row, or a sequence gone
            work = self._open.setdefault(seq_id, dict(matmul=np.zeros(self.instances, np.int64),
                                                      attention=np.zeros(self.instances, np.int64),
                                                      steps=0, spread=False))
            work["matmul"][homes[r]] += q_len
            work["attention"] += self._past_products(plan.block_tables[r], kv_len - q_len, q_len)
            work["attention"][homes[r]] += q_len * (q_len + 1) // 2  # its own keys, causal, on its instance
            work["spread"] |= seq_id in spread
            if seq_id not in counted:
                counted.add(seq_id)
                work["steps"] += 1
            if kv_len == prompt:
                done = self._open.pop(seq_id)
                self.finished.append(PrefillReport(
                    seq_id=seq_id, prompt_tokens=prompt, matmul_tokens=tuple(int(x) for x in done["matmul"]),
                    attention=tuple(int(x) for x in done["attention"]), steps=done["steps"], spread=done["spread"]))

    def _past_products(self, table: np.ndarray, past: int, q_len: int) -> np.ndarray:
        """[I] each instance's key-query products of q_len queries over the `past` keys of `table` it holds."""
        entries = -(-past // self.block_size)
        keys = np.minimum(self.block_size, past - np.arange(entries) * self.block_size)
        holders = table[:entries].astype(np.int64) // self.blocks_per_instance
        return q_len * np.bincount(holders, weights=keys, minlength=self.instances).astype(np.int64)
