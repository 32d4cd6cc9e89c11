"""`ModelRunner`: the part of the executor that turns plans into calls: the StepRunner the engine core drives.

Per step it lays the plan out (jaxllm.executor.inputs: one function for one instance or many), picks the
call (the plan's StepKind, greedy or sampling, logprobs, the tuner's variant for the busiest instance's rows,
the borrowed variant where some sequence has rBlocks on another instance), counts the step in its bucket,
and hands the call to its Worker (jaxllm.executor.worker), which runs it on the devices. It also says what
warm-up compiles (every bucket x variant a step can meet: `warm_up_plan`) and which programs are the largest
(`step_memory`), and asks the worker to compile or measure them.

Shapes come from a small set of buckets (jaxllm.tuner.buckets), so a long-running server compiles a bounded
number of programs, all at warm-up: a decode step is shaped by its sequence count (a power of two), a
prefill step by its token count, the rBlock-table width by the context limit. A decode step whose
sequences are all greedy has its own variant (argmax, no sampler sort); a step in which some sequence wants
log-probabilities has a variant that returns them (with max_logprobs > 0). A step in which some sequence has a
penalty or a logit bias runs the sampling variant, which applies them (jaxllm.executor.penalties). Each bucket
has the Kernels variants its StepTuner lists (jaxllm.tuner.protocol): every instance of a step runs the same
variant, the one the tuner picks for the busiest instance's rows. A borrowed step runs DistAttention with the
bucket's first variant, compiled at warm-up beside the plain ones when instances lend; a step with nothing
borrowed runs no collective. A plan's host copies (StepPlan.host_copies) run before its step, its out copies
before its recall copies and its in copies after, none of it waited for by the host.

`dispatch` queues a step and returns without waiting; `InFlight.tokens()` waits. A decode continuation
takes its input tokens straight from the previous step's device output, so the host queues step N+1 while
step N runs instead of leaving the devices idle during every dispatch.
"""

from __future__ import annotations

import sys

import jax
import numpy as np

from jaxllm.contract import ExecutorStats, HostStoreStats, StepKind, StepPlan
from jaxllm.executor.calls import Op, StepCall, TokenSource
from jaxllm.executor.in_flight import InFlight, Launched
from jaxllm.executor.inputs import InputLayout, StepBatch, token_rows
from jaxllm.executor.worker import Worker
from jaxllm.tuner.buckets import Buckets
from jaxllm.tuner.protocol import StepTuner

__all__ = ["ModelRunner"]


class ModelRunner:
    """The StepRunner (jaxllm.engine.step_runner) of every mesh: plans in, steps queued on its worker (see the
    module docstring). borrowing: steps may have rBlocks on other instances (lending on), so the borrowed
    variant is compiled at warm-up."""

    def __init__(self, worker: Worker, layout: InputLayout, *, borrowing: bool = False):
        self.worker, self.layout = worker, layout
        self.buckets: Buckets = layout.buckets
        self.variants = worker.variants
        self.borrowing = borrowing and layout.instances > 1
        # Served steps (warm-up's not counted) per bucket, (kind, padded size) -> steps; the padding they carried
        # (padded minus real tokens, all instances); steps that ran DistAttention.
        self.bucket_steps: dict[tuple[StepKind, int], int] = {}
        self.padding_tokens = 0
        self.borrowed_steps = 0

    @property
    def tuner(self) -> StepTuner:
        """The StepTuner that lists each bucket's variants and picks one per step (the worker's KernelVariants')."""
        return self.variants.tuner

    @tuner.setter
    def tuner(self, tuner: StepTuner) -> None:
        """Replace the tuner before anything asked for a bucket's variants (before warm-up); ValueError after."""
        self.variants.use(tuner)

    # ----- what it counts (the StepRunner's figures) -----

    @property
    def compile_count(self) -> int:
        """Programs traced (each a compile) so far: the figure that must stay flat after warm-up."""
        return self.worker.programs.compile_count

    @property
    def xla_compiles(self) -> int:
        return self.worker.programs.xla_compiles

    @property
    def persistent_cache_hits(self) -> int:
        return self.worker.programs.persistent_cache_hits

    @property
    def block_bytes(self) -> int:
        return self.worker.block_bytes

    @property
    def block_size(self) -> int:
        return self.worker.block_size

    def stats(self) -> ExecutorStats:
        """What it compiled and ran, the tuner's counters and the host store's (jaxllm.contract.stats), a snapshot
        (safe beside the engine thread: it only reads)."""
        steps = list(self.bucket_steps.items())  # one C-level copy: safe beside the engine thread
        store = self.worker.host_store
        return ExecutorStats(
            compile_count=self.compile_count, xla_compiles=self.xla_compiles,
            persistent_cache_hits=self.persistent_cache_hits,
            bucket_steps=tuple(sorted((kind.label, size, n) for (kind, size), n in steps)),
            padding_tokens_total=self.padding_tokens, dist_steps_total=self.borrowed_steps,
            tuner=tuple(sorted((str(k), int(v)) for k, v in self.tuner.stats().items())),
            kv_block_bytes=self.block_bytes, host_store=HostStoreStats() if store is None else store.stats())

    # ----- steps -----

    def dispatch(self, plan: StepPlan, *, token_source: InFlight | None = None) -> InFlight:
        """Start one step on the devices and return at once, without waiting for its tokens. The plan's
        block copies (recalls) are queued first.

        token_source: the in-flight (or finished) step this one continues (the scheduler's plan_continuation):
        a decode step of the same sequences in the same order. Its sampled-token array, still on the
        devices, becomes this step's input tokens, so step N+1 is queued before step N's tokens reach the
        host. Both are decode steps of the same sequence counts, hence the same padded shapes.
        """
        self._copy(plan)
        worker = self.worker
        if plan.num_seqs == 0:  # a step of copies alone
            return InFlight(plan, Launched(None, None, None), np.zeros(0, np.int64))
        if not worker.has_penalties and (plan.penalties is not None or plan.logit_bias is not None):
            raise ValueError("the plan has penalties or a logit bias; this executor was built without them")
        # A continuation's rows sit where its source's did: its batch is the source's, advanced one token.
        source_batch = None if token_source is None else token_source.batch
        batch = self.layout.build(plan) if source_batch is None else self.layout.advance(source_batch, plan)
        variant = self._choose(batch)
        if token_source is not None:
            src = token_source.plan
            if not (plan.kind is src.kind is StepKind.DECODE and np.array_equal(src.seq_ids, plan.seq_ids)):
                raise ValueError("token_source must be a decode step of the same sequences, in the same order, "
                                 f"as the step it feeds ({src.num_seqs} vs {plan.num_seqs} sequences)")
            if worker.channel is not None and token_source is not worker.last:
                raise ValueError("on a multi-process run a continuation must follow the step it continues: the "
                                 "other processes keep only their last step's tokens")
            call = StepCall(Op.STEP, StepKind.DECODE, token_source.greedy, plan.wants_logprobs, variant,
                            batch.borrowed, TokenSource.CONTINUED)
        else:
            if np.any(plan.token_ids < 0):
                raise ValueError("the plan's token ids are placeholders (a continuation step): pass token_source")
            call = self._call(plan, batch, variant)
        launched = worker.launch(call, batch.inputs, token_source)
        scored = token_rows(plan, self.layout.instances, batch.inputs.num_tokens) if plan.scores_prompt else None
        worker.last = InFlight(plan, launched, batch.rows, greedy=call.greedy, token_rows=scored, batch=batch)
        return worker.last

    def step(self, plan: StepPlan) -> np.ndarray:
        """Run one step and wait for it; returns the sampled token of every sequence in the plan ([S] int32)."""
        return self.dispatch(plan).tokens()

    def logits(self, plan: StepPlan) -> np.ndarray:
        """Teacher-forced logits [T, vocab] (float32) of every token in a prefill plan."""
        host = plan.host_copies if plan.host_copies is not None and len(plan.host_copies) else None
        if host is not None:
            self.worker.copy_host(host, out=True)
            self.worker.copy_host(host, out=False)
        batch = self.layout.build(plan)
        call = StepCall(Op.LOGITS, variant=self._choose(batch), borrowed=batch.borrowed)
        out = self.worker.launch_logits(call, batch.inputs).result()
        rows = token_rows(plan, self.layout.instances, batch.inputs.num_tokens)
        return out.reshape(-1, out.shape[-1])[rows]

    def compiled_step_text(self, plan: StepPlan) -> str:
        """XLA's optimized HLO of the program a (non-continued) step of this plan runs, with the variant the tuner
        picks: what profiling scripts (scripts/trace_tp_step.py, scripts/profile_decode_step.py) read for the
        collectives and copies in it. Compiles it again; runs nothing and counts no step."""
        batch = self.layout.build(plan)
        variant = 0 if batch.borrowed else int(self.tuner.choose(batch.heaviest, plan.kind, batch.size))
        return self.worker.compiled(self._call(plan, batch, variant), batch.inputs).as_text()

    def _copy(self, plan: StepPlan) -> None:
        """Queue the plan's copies: host copies out, then recalls between instances, then host copies in."""
        host = plan.host_copies if plan.host_copies is not None and len(plan.host_copies) else None
        if host is not None:
            self.worker.copy_host(host, out=True)
        if plan.block_copies is not None and len(plan.block_copies):
            self.worker.copy_blocks(plan.block_copies)
        if host is not None:
            self.worker.copy_host(host, out=False)

    def _call(self, plan: StepPlan, batch: StepBatch, variant: int) -> StepCall:
        return StepCall(Op.STEP, plan.kind, _greedy(plan), plan.wants_logprobs, variant, batch.borrowed)

    def _choose(self, batch: StepBatch) -> int:
        """The tuner's variant for this step (host-side; the busiest instance's rows size it), counting the
        step in its bucket. A borrowed step runs variant 0."""
        plan = batch.plan
        key = (plan.kind, batch.size)
        self.bucket_steps[key] = self.bucket_steps.get(key, 0) + 1
        self.padding_tokens += batch.inputs.tokens.size - plan.num_tokens
        if batch.borrowed:
            self.borrowed_steps += 1
            return 0
        return int(self.tuner.choose(batch.heaviest, plan.kind, batch.size))

    # ----- warm-up and memory -----

    def bucket_shapes(self) -> list[tuple[StepKind, int, bool, bool]]:
        """Every (kind, size, greedy, logprobs) a step can take: sequences for decode, tokens for prefill and
        verify (Buckets.shapes); decode and verify steps in both variants (greedy only, or with the sampler); every
        shape also in its logprob variant when max_logprobs > 0."""
        shapes = [(shape.kind, shape.size, greedy) for shape in self.buckets.shapes()
                  for greedy in ((False, True) if shape.kind is not StepKind.PREFILL else (False,))]
        return [shape + (logprobs,) for logprobs in ((False, True) if self.worker.max_logprobs else (False,))
                for shape in shapes]

    def warm_up_plan(self) -> list[tuple[StepCall, int]]:
        """Every (call, bucket size) warm-up compiles, one compile each: bucket_shapes x the tuner's variants
        of each bucket (a variant equal to an earlier one of its bucket is the same program, listed once), and
        with borrowing each shape's borrowed variant."""
        plan = []
        for kind, size, greedy, logprobs in self.bucket_shapes():
            listed = self.variants.variants(kind, size)
            plan += [(StepCall(Op.STEP, kind, greedy, logprobs, i), size)
                     for i, k in enumerate(listed) if k not in listed[:i]]
            if self.borrowing:
                plan.append((StepCall(Op.STEP, kind, greedy, logprobs, 0, borrowed=True), size))
        return plan

    def warm_up(self, progress: bool = True) -> None:
        """Compile every program serving can meet now (warm_up_plan, its total said first; with borrowing the
        recall copy too; with a host tier its copies, and its host memory reserved), so serving compiles nothing
        new."""
        from jaxllm.progress import Progress

        worker, store = self.worker, self.worker.host_store
        plan = self.warm_up_plan()
        copies = 1 if self.borrowing else 0
        runs = [] if store is None else store.run_lengths()
        if progress:
            buckets = len(self.buckets.decode_sizes), len(self.buckets.prefill_sizes), len(self.buckets.verify_sizes)
            borrowed = ", each also with borrowed rBlocks, and the recall copy" if copies else ""
            host = (f", and the host tier's gather and scatter of {len(runs)} run lengths, then its "
                    f"{store.reserve_blocks * worker.block_bytes / (1 << 30):.1f} GiB of host memory an "
                    f"instance reserved" if runs else "")
            verify = f" + {buckets[2]} verify" if buckets[2] else ""
            print(f"[jaxllm] warm-up: {len(plan) + copies + 2 * len(runs)} compiles ({buckets[0]} decode + "
                  f"{buckets[1]} prefill{verify} buckets x tuner variants x greedy/logprob variants{borrowed}{host})",
                  file=sys.stderr, flush=True)
        with Progress(len(plan) + copies + 2 * len(runs), "warm-up compiles", enabled=progress) as bar:
            for call, size in plan:
                inputs = self.layout.inert(call.kind, size, call.borrowed)
                jax.block_until_ready(worker.launch(call, inputs, None).result().tokens)
                bar.update(1, detail=f"{call.program} {size}{' greedy' if call.greedy else ''}"
                                     f"{' logprobs' if call.logprobs else ''}"
                                     f"{f' variant {call.variant}' if call.variant else ''}"
                                     f"{' borrowed' if call.borrowed else ''}")
            if copies:
                worker.warm_up_copies()
                bar.update(1, detail="recall copy")
            if runs:
                worker.warm_up_host_copies()
                bar.update(2 * len(runs), detail=f"host copies of {runs[0]}..{runs[-1]} rBlocks, host memory "
                                                 f"reserved in {store.reserved_seconds:.1f} s")

    def step_memory(self, kinds: tuple[StepKind, ...] = tuple(StepKind)) -> dict[str, int]:
        """Device bytes each of the largest programs needs while it runs, beyond its arguments (per device:
        Worker.working_bytes), by name: every variant (sampling, logprobs, borrowed) of the largest bucket of each
        of `kinds`, the buckets whose activations are largest. Compiles them again, runs nothing; the pool may be
        abstract, so an engine sizes its pool from what is left after them (jaxllm.memory_plan)."""
        needs = {}
        for kind in kinds:
            if not self.buckets.sizes(kind):
                continue  # no verify buckets: speculative decoding is off
            size = self.buckets.sizes(kind)[-1]
            for logprobs in ((False, True) if self.worker.max_logprobs else (False,)):
                for borrowed in ((False, True) if self.borrowing else (False,)):
                    call = StepCall(Op.STEP, kind, False, logprobs, 0, borrowed)
                    inputs = self.layout.inert(kind, size, borrowed)
                    name = f"{kind.label} {size}{' logprobs' if logprobs else ''}{' borrowed' if borrowed else ''}"
                    needs[name] = self.worker.working_bytes(call, inputs)
        return needs


def _greedy(plan: StepPlan) -> bool:
    """Whether a step runs the argmax-only variant of its kind (decode or verify). Padding rows are greedy, so "no
    row samples" is "every sequence is greedy"; a penalty or a bias moves even a greedy row's argmax, and only the
    decode step's sampling variant applies them (a verify step applies a bias in both variants and has no
    penalties)."""
    if plan.kind is StepKind.VERIFY:
        return not np.any(plan.temperature > 0)
    return (plan.kind is StepKind.DECODE and not np.any(plan.temperature > 0) and plan.penalties is None
            and plan.logit_bias is None)

