"""Continuous batching: which tokens of which sequences run in the next step. Pure Python.

Every step has one token budget shared by decodes (one token per running sequence) and prefill
chunks of sequences still reading their prompt. When the pool runs out, the youngest running
sequence is preempted: its rBlocks are freed and it is re-queued at the front to recompute its
prompt and the tokens it had produced, so no accepted request is ever lost. With a host tier
(jaxllm.engine.host_tier) a preempted sequence's computed rBlocks are copied to the host instead, when it has
room, and copied back when the sequence is admitted again (the rBlocks at the start of its table that the
device's prefix cache still holds are shared, not copied); without room it recomputes as before.

Prefix caching (on by default): each full rBlock a sequence computes is registered under a hash
chained over the tokens up to its end; a sequence admitted later whose tokens start with the same
full rBlocks shares them and prefills only the rest (at least its last token, whose logits it
samples from). A preempted sequence finds its own rBlocks still cached when it resumes, unless
the pool needed them meanwhile. With a host tier the device cache's evicted rBlocks are spilled to the host
(BlockAllocator's on_evict), and an admission continues its device-cache hit with the host cache's: those
rBlocks are copied back instead of prefilled. Every copy rides on the plan (StepPlan.host_copies) that the
change belongs to, so it runs on the device before any step can write the rBlocks it read.

Penalties (SamplingParams.penalized): such a sequence holds one of max_seqs rows ("slots") of the instance's
penalty state on the device while it runs, from admission to its finish, cancel or preemption; its plan rows
carry the slot (StepPlan.penalties), and its first step after admission clears it. The device state learns the
sequence's tokens by reading them as the step's inputs, so they must all be read after admission: with a
repetition penalty (which sees the prompt) nothing comes from the prefix cache; with frequency or presence
penalties alone (which count generated tokens) only rBlocks within the prompt do.

Speculative decoding (a `Speculation`: jaxllm.engine.speculative): a step whose rows are all decodes (no prompt
chunk, no penalties, no prompt scoring) becomes a verify step when the proposer drafts tokens for some row, every
row then holding Q = k + 1 tokens (its last token, its drafts, fillers: `verify`), at most max_tokens_per_step of
them; the row's rBlocks grow to hold them. Recording it (`update`) keeps the accepted drafts and the token drawn
after them, rolls each sequence's computed KV back to them and returns the rBlocks that held only rejected tokens;
a rejected token's KV is never registered in the prefix cache (only full rBlocks of computed, accepted tokens are).
A speculating sequence's decode step is never continued before its tokens are read (`plan_continuation`): the next
step's draft depends on them.

Held sequences (`held`): the instance set plans a long prompt it spreads over every instance itself
(jaxllm.engine.spread), admitting it through `admit` (the admission `plan` does for the others); `plan` skips them.
Their results are recorded here as any sequence's.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
from collections.abc import Collection, Iterator

import numpy as np

from jaxllm.contract import (HostTierStats, SamplingParams, SchedulerStats, SpeculativeStats, StepKind,
                             StepPlan)
from jaxllm.engine.allocator import BlockPool, OutOfBlocks
from jaxllm.engine.host_tier import HostTier
from jaxllm.engine.plan_rows import PlanRow, assemble_plan
from jaxllm.engine.sequence import Sequence, Status
from jaxllm.engine.speculative import Speculation


def block_key(previous: bytes, tokens: list[int]) -> bytes:
    """Key of a full rBlock holding `tokens`, after the rBlock keyed `previous` (b"" for the first):
    a hash of the whole prefix up to the block's end, so equal keys mean equal KV."""
    digest = hashlib.blake2b(previous, digest_size=16)
    digest.update(np.asarray(tokens, np.int64).tobytes())
    return digest.digest()


class Scheduler:
    """The StepScheduler (jaxllm.engine.scheduling) of one instance over one BlockPool (see the module docstring)."""

    def __init__(self, allocator: BlockPool, block_size: int, *, max_tokens_per_step: int, max_seqs: int,
                 prefix_caching: bool = True, seq_ids: Iterator[int] | None = None, host_tier: HostTier | None = None,
                 takes_host_copies: bool = True, speculation: Speculation | None = None):
        """seq_ids: where sequence ids come from (default 0, 1, 2, ...); several schedulers of one engine
        (one per instance) draw from disjoint ranges, so a plan's ids name one sequence engine-wide.
        host_tier: where preempted sequences swap to (and, if the allocator spills to it, the host prefix
        cache); None: preemption recomputes. takes_host_copies: its plans carry the tier's copies (False: the
        caller takes them once every scheduler of its step has planned: InstanceSchedulers). speculation:
        speculative decoding's proposer, k and counters (None: off)."""
        if max_tokens_per_step <= 0 or max_seqs <= 0:
            raise ValueError("max_tokens_per_step and max_seqs must be positive")
        self.allocator = allocator
        self.block_size = block_size
        self.max_tokens_per_step = max_tokens_per_step
        self.max_seqs = max_seqs
        self.prefix_caching = prefix_caching
        self.host = host_tier
        self.takes_host_copies = takes_host_copies and host_tier is not None
        self.speculation = speculation
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []  # oldest first
        self.cached_tokens = 0  # tokens whose KV came from the prefix cache, all admissions together
        self.preemptions = 0  # sequences preempted so far, all together
        self._ids = seq_ids if seq_ids is not None else itertools.count()
        self._live: dict[int, Sequence] = {}  # waiting or running, by seq_id: what a plan's ids name
        self._free_slots = list(range(max_seqs))  # rows of the penalty state no running sequence holds (a heap)
        # Sequences another part plans (the instance set's spread prompt: jaxllm.engine.spread): plan() skips them.
        self.held: set[int] = set()

    # ----- requests -----

    def add(self, prompt_ids: list[int], params: SamplingParams, max_len: int, *, reuse_prefix: bool = True
            ) -> Sequence:
        # A prompt to score needs every position's logits computed: nothing from the prefix cache.
        reuse_prefix = reuse_prefix and params.prompt_logprobs is None
        seq = Sequence(next(self._ids), list(prompt_ids), params, max_len, reuse_prefix=reuse_prefix)
        if params.prompt_logprobs is not None:
            seq.prompt_logprobs.append(None)  # the first prompt token has no distribution
        self.waiting.append(seq)
        self._live[seq.seq_id] = seq
        return seq

    def sequence(self, seq_id: int) -> Sequence | None:
        """The waiting or running sequence with this id (a plan's seq_ids), None once it has finished."""
        return self._live.get(int(seq_id))

    def cancel(self, seq: Sequence) -> None:
        self._finish(seq, "cancelled")

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def stats(self) -> SchedulerStats:
        """The queue and the pool, a snapshot (lending all 0: one instance; host all 0 without a host tier)."""
        pool = self.allocator
        return SchedulerStats(waiting=len(self.waiting), running=len(self.running), preemptions=self.preemptions,
                              cached_tokens=self.cached_tokens, pool_blocks=pool.num_blocks,
                              pool_blocks_free=pool.num_free, cached_blocks=pool.num_cached,
                              host=HostTierStats() if self.host is None else self.host.stats(),
                              speculative=SpeculativeStats() if self.speculation is None else self.speculation.stats())

    # ----- planning -----

    def plan(self, *, speculate: bool = True) -> StepPlan | None:
        """The next step, or None when nothing can run. speculate: a step of decodes may become a verify step (with
        speculative decoding on; the instance set decides for all its instances at once)."""
        budget = self.max_tokens_per_step
        chunks: list[tuple[Sequence, int]] = []
        # Running sequences first (oldest first): decodes cost one token each.
        for seq in list(self.running):
            if budget <= 0:
                break
            if seq.status is not Status.RUNNING or seq.seq_id in self.held:  # preempted making room; spread
                continue
            n = min(seq.num_tokens - seq.num_computed, budget)
            if self._reserve(seq, seq.num_computed + n, chunks):
                chunks.append((seq, n))
                budget -= n
        # Then admit waiting sequences while budget, slots and rBlocks allow (no preemption for them).
        while budget > 0 and len(self.running) < self.max_seqs:
            seq = next((s for s in self.waiting if s.seq_id not in self.held), None)
            n = None if seq is None else self.admit(seq, budget)
            if n is None:
                break
            chunks.append((seq, n))
            budget -= n
        copies = self.host.take_copies() if self.takes_host_copies else None
        if not chunks:
            return None if copies is None else StepPlan.copies_only(host_copies=copies)
        plan = self._build(chunks, copies)
        if speculate and (requests := self.draft_requests(plan)) is not None:
            asked = [(seq, k) for seq, k in requests if k]
            drafted = dict(zip((seq.seq_id for seq, _ in asked), self.speculation.proposer.propose(asked)))
            return self.verify(plan, drafted) or plan
        return plan

    def admit(self, seq: Sequence, max_tokens: int) -> int | None:
        """Admit waiting `seq` with up to max_tokens of its tokens planned (its cached prefix shared first, its
        rBlocks grown to hold them, its host slots' copies planned): the tokens planned, or None, changing nothing,
        when its rBlocks are not free (no preemption for an admission). The caller checks running < max_seqs."""
        slots = self._share_cached_prefix(seq)
        n = min(seq.num_tokens - seq.num_computed, max_tokens)
        try:
            self.allocator.grow(seq.seq_id, self._blocks_for(seq.num_computed + n))
        except OutOfBlocks:
            self.allocator.free(seq.seq_id)  # the shared prefix goes back to the cache
            if slots and not seq.num_swapped:
                self.host.unclaim(slots)  # and so do the host cache's rBlocks
            seq.num_computed = seq.num_cached_prompt = seq.num_registered = 0
            return None
        if slots:
            self._copy_in(seq, slots)
        self.cached_tokens += seq.num_cached_prompt
        self.waiting.remove(seq)
        seq.status = Status.RUNNING
        if seq.params.penalized:  # running < max_seqs, and each running sequence holds at most one slot
            seq.penalty_slot = heapq.heappop(self._free_slots)
            seq.penalty_start, seq.penalty_recount_end = seq.num_computed, seq.num_tokens
        self.running.append(seq)
        return n

    # ----- speculative decoding -----

    def draft_requests(self, plan: StepPlan) -> list[tuple[Sequence, int]] | None:
        """For a plan of this scheduler's that may become a verify step, each row's (sequence, the most drafts it
        may take: Speculation.tokens_for, 0 for none); None when it may not: speculation off, a row that is no
        decode (a prompt chunk, penalties, prompt scoring), more rows than a verify step holds, a row whose Q tokens
        would pass its context limit, or no row that speculates."""
        spec = self.speculation
        if spec is None or plan.kind is not StepKind.DECODE or plan.penalties is not None or plan.scores_prompt:
            return None
        q = spec.queries
        if len(plan) * q > self.max_tokens_per_step:
            return None
        seqs = [self.sequence(i) for i in plan.seq_ids]
        if any(seq.num_computed != seq.num_tokens - 1 or seq.num_computed + q > seq.max_len for seq in seqs):
            return None
        requests = [(seq, spec.tokens_for(seq)) for seq in seqs]
        return requests if any(k for _, k in requests) else None

    def verify(self, plan: StepPlan, drafts: dict[int, list[int]], *, force: bool = False) -> StepPlan | None:
        """The verify step of `plan` (draft_requests' plan) with these drafts (seq_id -> its tokens; absent: none):
        every row its last token, its drafts and fillers (its last token again), Q tokens in all, its rBlocks grown
        to hold them. None, growing nothing, when no row has a draft (unless force: the instance set's other
        instances have some) or the rBlocks are not free without preempting anyone."""
        q = self.speculation.queries
        if not force and not any(drafts.get(int(i)) for i in plan.seq_ids):
            return None
        seqs = [self.sequence(i) for i in plan.seq_ids]
        need = [self._blocks_for(seq.num_computed + q) - len(self.allocator.blocks(seq.seq_id)) for seq in seqs]
        if sum(max(n, 0) for n in need) > self.allocator.num_free:
            return None
        rows, targets = [], np.full(len(seqs) * q, -1, np.int32)
        for i, seq in enumerate(seqs):
            if need[i] > 0:
                self.allocator.grow(seq.seq_id, self._blocks_for(seq.num_computed + q))
            last = seq.token_slice(seq.num_tokens - 1, seq.num_tokens)
            draft = [int(t) for t in drafts.get(seq.seq_id, ())][:q - 1]
            rows.append((seq, seq.num_computed, last + draft + last * (q - 1 - len(draft)), True))
            targets[i * q:i * q + len(draft)] = draft  # the draft after each token
        return self._assemble(rows, host_copies=plan.host_copies, kind=StepKind.VERIFY, targets=targets)

    def plan_continuation(self, prev: StepPlan) -> StepPlan | None:
        """The decode step that follows `prev` while prev's sampled tokens are still on the device.

        Lets the caller dispatch step N+1 before reading step N's tokens: the new step has prev's
        sequences in prev's order, one token each, at the position prev is sampling; its token_ids
        are PENDING_TOKEN placeholders that the runner takes from prev's device output. Call it after
        prev was planned and before prev's results are recorded (`update`). Returns None, changing
        nothing, unless prev is a pure decode step in which every sequence samples, the sequences
        are exactly the running set and still running, nobody waits for admission (plan() would
        admit them), none of them is certain to finish on prev's token (its length limit), and
        every one can grow by one token without preempting anyone. Only grows rBlocks: sequences'
        tokens and counters change in `update` alone, so dropping the returned step unrecorded
        leaves the scheduler consistent (plan() would then recompute the token).
        """
        if self.waiting or not len(prev) or prev.kind is not StepKind.DECODE or not bool(np.all(prev.sample)) \
                or len(prev) != len(self.running):
            return None
        seqs = [self.sequence(i) for i in prev.seq_ids]
        for i, seq in enumerate(seqs):
            if seq is None or seq.status is not Status.RUNNING or int(prev.kv_lens[i]) != seq.num_tokens:
                return None  # finished, or prev's result is already recorded: not the step to continue
            if len(seq.output_ids) + 1 >= seq.params.max_new_tokens or seq.num_tokens + 1 >= seq.max_len:
                return None  # prev's token ends it: a step after it would be wasted
            if self.speculation is not None and self.speculation.tokens_for(seq):
                return None  # it speculates: its next step's draft follows prev's token, which plan() must read
        # The new step writes position num_tokens, so it needs num_tokens + 1 slots.
        need = [self._blocks_for(seq.num_tokens + 1) - len(self.allocator.blocks(seq.seq_id)) for seq in seqs]
        if sum(max(n, 0) for n in need) > self.allocator.num_free:
            return None  # checked first, so a shortage leaves every table as it was
        grown = [i for i, more in enumerate(need) if more > 0]  # most decode steps stay inside their last rBlock
        for i in grown:
            self.allocator.grow(seqs[i].seq_id, self._blocks_for(seqs[i].num_tokens + 1))
        # A grow may have evicted cached rBlocks that the host tier keeps: copied out before this step writes them.
        copies = self.host.take_copies() if self.takes_host_copies else None
        # prev's plan, one token on (StepPlan.next_decode): the same rows, so only the grown tables are new.
        return prev.next_decode(self.block_size, self._grown_tables(prev, seqs, grown), host_copies=copies)

    def _grown_tables(self, prev: StepPlan, seqs: list[Sequence], grown: list[int]) -> np.ndarray | None:
        """prev's rBlock tables with the grown rows' new entries (widened where one outgrew them); None if none
        grew."""
        if not grown:
            return None
        rows = {i: self.allocator.blocks(seqs[i].seq_id) for i in grown}
        width = max(prev.block_tables.shape[1], max(len(b) for b in rows.values()))
        tables = np.zeros((len(seqs), width), np.int32)
        tables[:, :prev.block_tables.shape[1]] = prev.block_tables
        for i, blocks in rows.items():
            tables[i, :len(blocks)] = blocks
        return tables

    def _share_cached_prefix(self, seq: Sequence) -> list[int]:
        """Admission: take the longest run of cached full rBlocks that starts seq's tokens, leaving at
        least its last token to compute (its logits give the next token): the device cache's first, then the
        host cache's. A swapped sequence takes its own KV back instead (_resume_swapped). Returns the host
        slots to copy into the table once it has grown (from rBlock seq.num_registered on)."""
        if seq.num_swapped:
            return self._resume_swapped(seq)
        if not (self.prefix_caching and seq.reuse_prefix) or seq.params.repetition_penalty != 1:
            return []  # a repetition penalty reads the whole prompt into the penalty state (see the module docstring)
        usable = (seq.num_tokens - 1) // self.block_size
        if seq.params.penalized:  # generated tokens are counted as they are read: only the prompt's rBlocks
            usable = min(usable, len(seq.prompt_ids) // self.block_size)
        keys = self._block_keys(seq, usable)[:usable]
        blocks = self.allocator.lookup(keys)
        slots = [] if self.host is None else self.host.lookup(keys[len(blocks):])
        if slots:
            self.host.claim(slots)  # the grow that follows may spill: it must not evict these
        if blocks:
            self.allocator.share(seq.seq_id, blocks)
        seq.num_computed = (len(blocks) + len(slots)) * self.block_size
        seq.num_cached_prompt = seq.num_computed
        seq.num_registered = len(blocks)  # the host's rBlocks are registered again once copied in
        return slots

    def _resume_swapped(self, seq: Sequence) -> list[int]:
        """A swapped sequence's admission: its KV comes back from the host, except the rBlocks at its start that
        the device's prefix cache still holds (shared instead of copied). Returns its host slots."""
        slots = self.host.swapped(seq.seq_id)
        blocks = []
        if self.prefix_caching and seq.reuse_prefix:
            full = min(seq.num_swapped // self.block_size, len(slots))
            blocks = self.allocator.lookup(self._block_keys(seq, full)[:full])
            if blocks:
                self.allocator.share(seq.seq_id, blocks)
        seq.num_computed = seq.num_swapped
        seq.num_cached_prompt = 0  # its own KV, not a prompt-cache hit
        seq.num_registered = len(blocks)
        return slots

    def _copy_in(self, seq: Sequence, slots: list[int]) -> None:
        """seq was admitted: plan its host slots' copies into its table (from rBlock seq.num_registered on)."""
        table = self.allocator.blocks(seq.seq_id)
        first = seq.num_registered
        if seq.num_swapped:
            self.host.swap_in(seq.seq_id, table[first:len(slots)], skip=first)
            seq.num_swapped = 0
        else:
            self.host.restore(slots, table[first:first + len(slots)])

    def _block_keys(self, seq: Sequence, count: int) -> list[bytes]:
        """seq.block_keys, extended to at least its first `count` full rBlocks (their tokens must be
        known); each key is computed once."""
        keys, bs = seq.block_keys, self.block_size
        while len(keys) < count:
            i = len(keys)
            keys.append(block_key(keys[-1] if keys else b"", seq.token_slice(i * bs, (i + 1) * bs)))
        return keys

    def _register_full_blocks(self, seq: Sequence) -> None:
        """After a step: record the rBlocks seq has filled with computed KV, for later sequences."""
        if not self.prefix_caching:
            return
        full = seq.num_computed // self.block_size
        if full <= seq.num_registered:
            return
        blocks, keys = self.allocator.blocks(seq.seq_id), self._block_keys(seq, full)
        for i in range(seq.num_registered, full):  # only the new ones: a decode step fills one at most
            self.allocator.register(blocks[i], keys[i])
        seq.num_registered = full

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _reserve(self, seq: Sequence, num_tokens: int, planned: list[tuple[Sequence, int]]) -> bool:
        """Grow seq's rBlocks to hold num_tokens, preempting the youngest other sequences if needed
        (never one already planned for this step)."""
        protect = {s for s, _ in planned}  # Sequence hashes by identity
        while True:
            try:
                self.allocator.grow(seq.seq_id, self._blocks_for(num_tokens))
                return True
            except OutOfBlocks:
                victims = [s for s in reversed(self.running) if s is not seq and s not in protect]
                if not victims:
                    # Nothing left to evict: this sequence itself goes back to wait.
                    self._preempt(seq)
                    return False
                self._preempt(victims[0])

    def _release_slot(self, seq: Sequence) -> None:
        if seq.penalty_slot >= 0:
            heapq.heappush(self._free_slots, seq.penalty_slot)
            seq.penalty_slot = -1

    def _preempt(self, seq: Sequence) -> None:
        # Swapped rather than recomputed where the host tier has room. Not a penalized sequence: its penalty state
        # learns its generated tokens by reading them again (the module docstring), so it must recompute them.
        # Its registered rBlocks' keys: those the host cache holds already are not copied again (host_tier).
        swapped = self.host is not None and not seq.params.penalized and self.host.swap_out(
            seq.seq_id, self.allocator.blocks(seq.seq_id)[:self._blocks_for(seq.num_computed)],
            seq.block_keys[:seq.num_registered])
        self.allocator.free(seq.seq_id)
        self._release_slot(seq)
        self._forget_draft(seq)
        self.running.remove(seq)
        seq.num_swapped = seq.num_computed if swapped else 0
        seq.num_computed = seq.num_registered = 0
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.preemptions += 1
        self.waiting.insert(0, seq)

    def _build(self, chunks: list[tuple[Sequence, int]], host_copies=None) -> StepPlan:
        rows = []
        for seq, n in chunks:
            start = seq.num_computed
            rows.append((seq, start, seq.token_slice(start, start + n), start + n == seq.num_tokens))
        return self._assemble(rows, host_copies=host_copies)

    def _assemble(self, rows: list[PlanRow], kv_extent: tuple[int, int] | None = None,
                  host_copies=None, **verify) -> StepPlan:
        """The plan of `rows` over their rBlock tables (plan_rows.assemble_plan; verify: its kind and targets)."""
        tables = [self.allocator.blocks(seq.seq_id) for seq, _, _, _ in rows]
        return assemble_plan(rows, tables, self.block_size, kv_extent=kv_extent, host_copies=host_copies, **verify)

    # ----- results -----

    def update(self, plan: StepPlan, sampled: np.ndarray, eos_id: int | Collection[int],
               logprobs: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
               prompt_logprobs: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None) -> list[Sequence]:
        """Record a step's results; returns the sequences that received a new token.

        eos_id: the id, or every id (Llama-3.1 has three), that ends a sequence.
        logprobs: (sampled token's logprob [S], top ids [S, K], top logprobs [S, K]) when the step computed
        them (plan.wants_logprobs); each sequence that asked keeps its own top k with its new token.
        prompt_logprobs: the same per token of the step [T], for the prompt token each one's logits give
        (plan.targets); each sequence scoring its prompt keeps them, once per position.
        A verify step's sampled and logprobs are [S, Q] (and [S, Q, K]): each row's kept tokens, -1 after them."""
        eos_ids = (eos_id,) if isinstance(eos_id, (int, np.integer)) else frozenset(eos_id)
        if plan.kind is StepKind.VERIFY:
            return self._update_verify(plan, sampled, eos_ids, logprobs)
        advanced = []
        for i, seq_id in enumerate(plan.seq_ids):
            seq = self.sequence(seq_id)
            if seq is None or seq.status is not Status.RUNNING:
                # Finished (cancel, stop string, or an earlier step's EOS/length) while this step ran: drop
                # its result. A continuation step may have written this sequence's next KV row into an
                # rBlock that finishing freed; that is harmless. Device steps run in dispatch order (each
                # consumes the pool the previous one returned), so the stray write lands before any step
                # of a new owner; a new owner writes each slot in the step whose kv_len first covers it,
                # before attention reads it, and attention never reads past kv_len. The stray value is
                # overwritten before anyone reads it.
                continue
            seq.num_computed = int(plan.kv_lens[i])
            self._register_full_blocks(seq)
            if seq.params.prompt_logprobs is not None:
                self._record_prompt_logprobs(seq, plan, i, prompt_logprobs)
            if not plan.sample[i]:
                continue
            if seq.params.max_new_tokens == 0:  # the prompt was scored, nothing is generated
                self._finish(seq, "length")
                continue
            taken, _ = self._take(seq, int(sampled[i]), eos_ids, logprobs, (i,))
            if taken:
                advanced.append(seq)
        return advanced

    def _take(self, seq: Sequence, token: int, eos_ids, logprobs, at: tuple) -> tuple[bool, bool]:
        """seq's next token (its logprobs at index `at` of the step's arrays): (appended, seq runs on). EOS (unless
        ignored) and stop token ids finish it unappended, max_new_tokens and the context limit after it."""
        if (token in eos_ids and not seq.params.ignore_eos) or token in seq.params.stop_token_ids:
            self._finish(seq, "stop")
            return False, False
        seq.output_ids.append(token)
        if seq.params.logprobs is not None:
            if logprobs is None:
                raise ValueError(f"sequence {seq.seq_id} wants logprobs but the step computed none")
            chosen, top_ids, top = (x[at] for x in logprobs)
            k = seq.params.logprobs
            seq.output_logprobs.append((float(chosen), tuple(zip(top_ids[:k].tolist(), top[:k].tolist()))))
        if len(seq.output_ids) >= seq.params.max_new_tokens or seq.num_tokens >= seq.max_len:
            self._finish(seq, "length")
            return True, False
        return True, True

    def _update_verify(self, plan: StepPlan, kept: np.ndarray, eos_ids, logprobs) -> list[Sequence]:
        """Record a verify step (update's docstring): per row its accepted drafts and the token drawn after them,
        in order, until one ends it; its computed KV rolled back to them, the rBlocks past its tokens returned."""
        q = plan.verify_queries
        drafted = plan.draft_lens
        advanced = []
        for i, seq_id in enumerate(plan.seq_ids):
            seq = self.sequence(seq_id)
            if seq is None or seq.status is not Status.RUNNING:
                continue  # finished while the step ran: its result is dropped (see update)
            tokens = kept[i][kept[i] >= 0]
            accepted = len(tokens) - 1
            self.speculation.record(int(drafted[i]), accepted)
            # KV is right for the last token and the accepted drafts: the step's other rows hold rejected tokens.
            seq.num_computed = int(plan.kv_lens[i]) - q + 1 + accepted
            self._register_full_blocks(seq)
            appended = False
            for j, token in enumerate(tokens.tolist()):
                taken, runs = self._take(seq, token, eos_ids, logprobs, (i, j))
                appended |= taken
                if not runs:
                    break
            if seq.status is Status.RUNNING:
                self.allocator.shrink(seq.seq_id, self._blocks_for(seq.num_tokens))
            if appended:
                advanced.append(seq)
        return advanced

    @staticmethod
    def _record_prompt_logprobs(seq: Sequence, plan: StepPlan, row: int, computed) -> None:
        """Keep the prompt log-probabilities row `row`'s tokens gave, each position once (a recompute after a
        preemption gives them again: the first ones stay)."""
        first, last = int(plan.cu_q_lens[row]), int(plan.cu_q_lens[row + 1])
        if plan.targets is None or not np.any(plan.targets[first:last] >= 0):
            return
        if computed is None:
            raise ValueError(f"sequence {seq.seq_id} scores its prompt but the step computed no log-probabilities")
        chosen, top_ids, top = computed
        k = seq.params.prompt_logprobs
        for t in range(first, last):
            if plan.targets[t] >= 0 and int(plan.positions[t]) + 1 == len(seq.prompt_logprobs):
                seq.prompt_logprobs.append((float(chosen[t]), tuple(zip(top_ids[t, :k].tolist(), top[t, :k].tolist()))))

    def record_computed(self, plan: StepPlan) -> None:
        """A step ran for its KV alone (teacher-forced logits): every row's sequence has its KV up to its
        kv_len, and its full rBlocks go to the prefix cache as a sampled step's would."""
        for i, seq_id in enumerate(plan.seq_ids):
            seq = self.sequence(seq_id)
            if seq is not None and seq.status is Status.RUNNING:
                seq.num_computed = int(plan.kv_lens[i])
                self._register_full_blocks(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """End a sequence early (stop string matched, client gone)."""
        self._finish(seq, reason)

    def _finish(self, seq: Sequence, reason: str) -> None:
        if seq.status is Status.FINISHED:
            return
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        self.allocator.free(seq.seq_id)
        if seq.num_swapped:
            self.host.discard(seq.seq_id)
            seq.num_swapped = 0
        self._release_slot(seq)
        self._forget_draft(seq)
        self._live.pop(seq.seq_id, None)
        seq.status = Status.FINISHED
        seq.finish_reason = reason

    def _forget_draft(self, seq: Sequence) -> None:
        if self.speculation is not None:
            self.speculation.proposer.forget(seq.seq_id)
