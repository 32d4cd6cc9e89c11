"""The executor: the one place that runs an engine's steps on the devices, for every mesh.

One GPU is the 1 x 1 mesh of `instance x tensor`; tensor parallelism and lending instances are larger meshes of
the same executor: one jitted program per bucket and variant (jaxllm.executor.programs), one warm-up, one
logits path, one leader/follower path (jaxllm.executor.calls), the tuner's variants and decode continuations
for all of them. Its parts, one file each: `inputs` (a plan padded to its bucket and stacked per instance),
`programs` (the jitted steps and their compile counters), `calls` (what process 0 sends the others),
`in_flight` (a dispatched step).

Shapes come from a small set of buckets (jaxllm.tuner.buckets), so a long-running server compiles a bounded
number of programs, all at warm-up: a decode step is shaped by its sequence count (a power of two), a
prefill step by its token count, the rBlock-table width by the context limit. A decode step whose
sequences are all greedy has its own variant (argmax, no sampler sort); a step in which some sequence wants
log-probabilities has a variant that returns them (with max_logprobs > 0). A step in which some sequence has a
penalty or a logit bias runs the sampling variant, which applies them (jaxllm.executor.penalties: the penalty
state is the programs' second donated argument, beside the pool). Each bucket has the Kernels
variants its StepTuner lists (jaxllm.tuner.protocol): every instance of a step runs the same variant, the one
the tuner picks for the busiest instance's rows. A step in which some sequence has rBlocks on another
instance runs the borrowed variant (DistAttention, with the bucket's first tuner variant), compiled at
warm-up beside the plain ones when instances lend; a step with nothing borrowed runs no collective.
With a host tier (one process) a plan's host copies (StepPlan.host_copies) run before its step, through the
HostStore (jaxllm.executor.host_store): runs of rBlocks gathered out of the pool and copied to host memory (before
the plan's recall copies), and runs copied back and scattered into the pool (after them), none of it waited for
by the host.

`dispatch` queues a step and returns without waiting; `InFlight.tokens()` waits. A decode continuation
takes its input tokens straight from the previous step's device output, so the host queues step N+1 while
step N runs instead of leaving the devices idle during every dispatch.
"""

from __future__ import annotations

import dataclasses
import sys

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxllm.contract import StepPlan
from jaxllm.contract import HostCopies
from jaxllm.contract import ExecutorStats, HostStoreStats
from jaxllm.executor.calls import BlockCopies, CallChannel, Op, StepCall, TokenSource
from jaxllm.executor.host_store import HostStore
from jaxllm.executor.host_transfer import AsyncHostTransfer, HostTransfer
from jaxllm.executor.in_flight import InFlight, Launched, host_array
from jaxllm.executor.inputs import InputLayout, token_rows
from jaxllm.executor.launcher import Launcher
from jaxllm.executor.penalties import PenaltyInputs, init_penalty_state
from jaxllm.executor.programs import StepPrograms
from jaxllm.executor.step import StepInputs, bucket
from jaxllm.model.kv_cache import KVCache
from jaxllm.model.llama import Llama
from jaxllm.tuner.buckets import Buckets
from jaxllm.tuner.fixed import FixedTuner
from jaxllm.tuner.protocol import StepTuner
from pallas_kernels import compat
from pallas_kernels.dispatch import Kernels, default_kernels
from sharding import multihost
from sharding.dist_attention import DistAttention
from sharding.mesh import INSTANCE, make_mesh
from sharding.tensor_parallel import tensor_parallel_kernels

__all__ = ["Executor", "InFlight", "host_array"]

_OPS = {Op.DECODE: "decode", Op.PREFILL: "prefill", Op.LOGITS: "logits"}
_SAMPLING = ("tokens", "temperature", "top_k", "top_p", "seed")


class Executor:
    """The StepRunner (jaxllm.engine.step_runner) of every mesh. Holds the model's state and the KV pool on a mesh; runs one step at a time (see the module docstring).

    mesh: the `instance x tensor` mesh the state and the pool are placed on (sharding.rules.shard_params /
    kv_pool_shardings); None: one device, the 1 x 1 mesh of the default device. instances: the mesh's
    instance axis; the pool then holds instances x blocks_per_instance rBlocks (global id = instance *
    blocks_per_instance + local). borrowing: steps may have rBlocks on other instances (lending on), so the
    borrowed variant is compiled at warm-up.
    kernels: the backend's Kernels (unwrapped; default from `backend`); tuner: the StepTuner that lists each
    bucket's variants and picks one per step (default FixedTuner(kernels)); set it before warm-up.
    penalties: keep the penalty state (max_seqs rows of the vocabulary per instance: jaxllm.executor.penalties) and
    apply each row's penalties and logit bias (at most max_logit_bias entries a row); False: steps as without
    them, and plans must carry none.
    host_tier: the slots of each instance's host tier (0: none): plans may carry host copies (one process), so
    the HostStore is built and its copy programs compiled at warm-up; host_transfer: how its runs cross the host
    link (default AsyncHostTransfer: JAX's host memory kinds).

    On a multi-process mesh every process holds an Executor over the same mesh and runs the same programs:
    process 0 sends each call through a CallChannel before running it, and every other process runs
    `follow()`, which receives and repeats them until process 0's `stop_followers()`.
    """

    def __init__(self, model: Llama, kv_cache: KVCache, *, max_seqs: int, max_tokens_per_step: int, table_width: int,
                 backend: str = "auto", min_tokens: int = 8, kernels: Kernels | None = None, mesh=None,
                 instances: int = 1, borrowing: bool = False, max_logprobs: int = 0, tuner: StepTuner | None = None,
                 penalties: bool = True, max_logit_bias: int = 64, host_tier: int = 0,
                 host_transfer: HostTransfer | None = None):
        if not 0 <= max_logprobs <= model.config.vocab_size:
            raise ValueError(f"max_logprobs {max_logprobs} must be in [0, {model.config.vocab_size}] (the vocabulary)")
        if max_logit_bias < 0:
            raise ValueError(f"max_logit_bias must be >= 0, got {max_logit_bias}")
        if kv_cache.num_blocks % instances:
            raise ValueError(f"the KV pool's {kv_cache.num_blocks} rBlocks do not split among {instances} instances")
        graphdef, state = nnx.split(model)
        # Committed where they lie (no copy): jit keys an uncommitted argument apart from a committed one, and
        # the donated pool comes back committed from the first step, which would trace every program twice.
        placed = lambda tree: jax.device_put(tree, jax.tree.map(lambda x: x.sharding, tree))  # noqa: E731
        self.state = placed(state)
        # An abstract pool (jax.ShapeDtypeStruct leaves, for step_memory before a pool exists) is kept as it is.
        self.abstract_pool = not all(isinstance(x, jax.Array) for x in jax.tree.leaves(kv_cache))
        kv_cache = kv_cache if self.abstract_pool else placed(kv_cache)
        self.state_leaves = jax.tree.leaves(self.state)  # what the programs take (programs.py says why)
        self.config = model.config
        self._pool = kv_cache  # touched by the launcher thread's calls alone (and by follow() on followers)
        self.launcher = Launcher()
        self.mesh = mesh if mesh is not None else make_mesh(1, 1, jax.devices()[:1])
        self.instances = instances
        self.blocks_per_instance = kv_cache.num_blocks // instances
        self.borrowing = borrowing and instances > 1
        self.max_logprobs = max_logprobs  # top tokens the logprob variants return (0: never run)
        multi_process = jax.process_count() > 1
        # Split over `instance` like the pool (each instance its max_seqs rows), whole on every tensor shard.
        rows = NamedSharding(self.mesh, P(INSTANCE) if instances > 1 else P())
        self._penalty_state = init_penalty_state(instances * max_seqs, model.config.vocab_size, rows) if penalties \
            else None
        self.programs = StepPrograms(graphdef, self.state, kv_cache, self.mesh, instances=instances,
                                     replicated_io=multi_process, penalty_state=self._penalty_state)
        self._inert_penalties: dict[tuple, PenaltyInputs] = {}  # placed once per shape (_placed says why)
        self.buckets = Buckets(max_seqs=max_seqs, max_tokens_per_step=max_tokens_per_step, table_width=table_width,
                               min_tokens=min_tokens)
        self.layout = InputLayout(instances=instances, blocks_per_instance=self.blocks_per_instance,
                                  block_size=kv_cache.block_size, min_tokens=min_tokens, seq_cap=self.buckets.seq_cap,
                                  table_width=table_width, bias_width=max_logit_bias if penalties else None)
        # Resolved once, here: inside the trace no backend name is read and no device is asked.
        base = kernels or default_kernels(backend, head_dim=model.config.head_dim)
        self.kernels = tensor_parallel_kernels(base, self.mesh)
        self.tuner = tuner if tuner is not None else FixedTuner(base)
        self._variants: dict[tuple[bool, int], tuple[Kernels, ...]] = {}
        self.channel = CallChannel() if multi_process else None
        self._last: InFlight | None = None  # the last step dispatched (a continuation's only possible source)
        # Served steps (warm-up's not counted) per bucket, (decode, padded size) -> steps; the padding they
        # carried (padded minus real tokens, all instances); steps that ran DistAttention; rBlocks copied.
        self.bucket_steps: dict[tuple[bool, int], int] = {}
        self.padding_tokens = 0
        self.borrowed_steps = 0
        self.copied_blocks = 0
        self.block_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(kv_cache)) // kv_cache.num_blocks
        self.host_store = None
        if host_tier:
            if self.abstract_pool:
                raise ValueError("an executor over an abstract pool (memory planning) has no host tier")
            if multi_process:
                raise ValueError(f"a host tier serves the instances of one process; this run has "
                                 f"{jax.process_count()} processes")
            longest_table = 1 << max(table_width - 1, 0).bit_length()  # a sequence's whole table in one run
            transfer = host_transfer or AsyncHostTransfer(self.programs.run_shardings, instances=instances)
            self.host_store = HostStore(
                self.programs, transfer, max_run=min(longest_table, 1 << (kv_cache.num_blocks.bit_length() - 1)),
                block_bytes=self.block_bytes, slots_per_instance=host_tier if instances > 1 else None,
                reserve_blocks=host_tier)
        if compat.on_gpu():
            compat.silence_triton_deprecation()  # jax 0.11 warns on every Triton-lowered kernel it traces

    # ----- what it is -----

    @property
    def kv_cache(self) -> KVCache:
        """The KV pool, once every call submitted so far has run."""
        self.launcher.drain()
        return self._pool

    @property
    def block_size(self) -> int:
        return self._pool.block_size

    @property
    def table_width(self) -> int:
        return self.layout.table_width

    @property
    def compile_count(self) -> int:
        """Programs traced (each a compile) so far: the figure that must stay flat after warm-up."""
        return self.programs.compile_count

    @property
    def xla_compiles(self) -> int:
        return self.programs.xla_compiles

    @property
    def persistent_cache_hits(self) -> int:
        return self.programs.persistent_cache_hits

    def stats(self) -> ExecutorStats:
        """What it compiled and ran, the tuner's counters and the host store's, a snapshot (safe beside the engine
        thread: it only reads)."""
        steps = sorted(list(self.bucket_steps.items()))  # one C-level copy
        return ExecutorStats(
            compile_count=self.compile_count, xla_compiles=self.xla_compiles,
            persistent_cache_hits=self.persistent_cache_hits,
            bucket_steps=tuple(("decode" if decode else "prefill", size, n) for (decode, size), n in steps),
            padding_tokens_total=self.padding_tokens, dist_steps_total=self.borrowed_steps,
            tuner=tuple(sorted((str(k), int(v)) for k, v in self.tuner.stats().items())),
            kv_block_bytes=self.block_bytes,
            host_store=HostStoreStats() if self.host_store is None else self.host_store.stats())

    def variants(self, decode: bool, padded_size: int) -> tuple[Kernels, ...]:
        """The tuner's variants of this bucket, wrapped for the mesh (memoised: asked once per bucket)."""
        key = (decode, padded_size)
        if key not in self._variants:
            listed = tuple(self.tuner.variants(decode, padded_size))
            if not listed:
                raise ValueError(f"the tuner lists no variant for the {'decode' if decode else 'prefill'} bucket "
                                 f"{padded_size}: it must list at least one (variants()[0] is the fallback)")
            self._variants[key] = tuple(tensor_parallel_kernels(k, self.mesh) for k in listed)
        return self._variants[key]

    def kernels_for(self, decode: bool, padded_size: int, variant: int = 0, *, borrowed: bool = False) -> Kernels:
        """The kernels a step of this bucket runs (`padded_size`: sequences for decode, tokens for prefill): the
        bucket's variant number `variant` (0: the tuner's fallback); a borrowed step: variant 0 with DistAttention."""
        listed = self.variants(decode, padded_size)
        if not 0 <= variant < len(listed):
            raise ValueError(f"variant {variant} of the {'decode' if decode else 'prefill'} bucket {padded_size} "
                             f"does not exist: the tuner lists {len(listed)}")
        if borrowed:
            return dataclasses.replace(listed[0], distributed=DistAttention())
        return listed[variant]

    def padded_sizes(self, decode: bool, size: int) -> tuple[int, int]:
        """(tokens, sequences) a step of `size` (sequences for decode, tokens for one instance's prefill) is
        padded to: Buckets.padded (ValueError past the largest bucket)."""
        return self.buckets.padded(decode, size)

    # ----- steps -----

    def dispatch(self, plan: StepPlan, *, token_source: InFlight | None = None) -> InFlight:
        """Start one step on the devices and return at once, without waiting for its tokens. The plan's
        block copies (recalls) are queued first.

        token_source: the in-flight (or finished) step this one continues (the scheduler's plan_continuation):
        a decode step of the same sequences in the same order. Its sampled-token array, still on the
        devices, becomes this step's input tokens, so step N+1 is queued before step N's tokens reach the
        host. Both are decode steps of the same sequence counts, hence the same padded shapes.
        """
        host = plan.host_copies if plan.host_copies is not None and len(plan.host_copies) else None
        if host is not None:
            self._copy_host(host, out=True)
        if plan.block_copies is not None and len(plan.block_copies):
            self._copy_blocks(plan.block_copies)
        if host is not None:
            self._copy_host(host, out=False)
        if plan.num_seqs == 0:  # a step of copies alone
            return InFlight(plan, Launched(None, None, None), np.zeros(0, np.int64))
        if self._penalty_state is None and (plan.penalties is not None or plan.logit_bias is not None):
            raise ValueError("the plan has penalties or a logit bias; this executor was built without them")
        batch = self.layout.build(plan)
        decode = plan.is_decode
        variant = self._choose(plan, batch)
        if token_source is not None:
            src = token_source.plan
            if not (decode and src.is_decode and np.array_equal(src.seq_ids, plan.seq_ids)):
                raise ValueError("token_source must be a decode step of the same sequences, in the same order, "
                                 f"as the step it feeds ({src.num_seqs} vs {plan.num_seqs} sequences)")
            if self.channel is not None and token_source is not self._last:
                raise ValueError("on a multi-process run a continuation must follow the step it continues: the "
                                 "other processes keep only their last step's tokens")
            call = StepCall(Op.DECODE, token_source.greedy, plan.wants_logprobs, variant, batch.borrowed,
                            TokenSource.CONTINUED)
        else:
            if np.any(plan.token_ids < 0):
                raise ValueError("the plan's token ids are placeholders (a continuation step): pass token_source")
            call = StepCall(Op.DECODE if decode else Op.PREFILL, _greedy(plan), plan.wants_logprobs, variant,
                            batch.borrowed)
        launched = self.launcher.submit(self._launch, call, batch.inputs, token_source)
        scored = None if plan.targets is None else token_rows(plan, self.instances, batch.inputs.num_tokens)
        self._last = InFlight(plan, launched, batch.rows, greedy=call.greedy, token_rows=scored)
        return self._last

    def _launch(self, call: StepCall, inputs: StepInputs, source: InFlight | None) -> Launched:
        """On the launcher thread: announce the call, place its inputs (or take the continued step's), run it."""
        self._announce(call, inputs)
        inputs = self._placed(inputs) if source is None else _continued(inputs, source.launched())
        out = self._run(call, inputs)
        if not call.logprobs:
            return Launched(out, None, inputs)
        tokens, sampled, prompt = out
        return Launched(tokens, sampled, inputs, prompt)

    def step(self, plan: StepPlan) -> np.ndarray:
        """Run one step and wait for it; returns the sampled token of every sequence in the plan ([S] int32)."""
        return self.dispatch(plan).tokens()

    def logits(self, plan: StepPlan) -> np.ndarray:
        """Teacher-forced logits [T, vocab] (float32) of every token in a prefill plan."""
        if plan.host_copies is not None and len(plan.host_copies):
            self._copy_host(plan.host_copies, out=True)
            self._copy_host(plan.host_copies, out=False)
        batch = self.layout.build(plan)
        call = StepCall(Op.LOGITS, variant=self._choose(plan, batch), borrowed=batch.borrowed)
        out = host_array(self.launcher.run(self._launch_logits, call, batch.inputs))
        rows = token_rows(plan, self.instances, batch.inputs.num_tokens)
        return out.reshape(-1, out.shape[-1])[rows]

    def _launch_logits(self, call: StepCall, inputs: StepInputs):
        self._announce(call, inputs)
        return self._run(call, self._placed(inputs))

    def _choose(self, plan: StepPlan, batch) -> int:
        """The tuner's variant for this step (host-side; the busiest instance's rows size it), counting the
        step in its bucket. A borrowed step runs variant 0."""
        decode = plan.is_decode
        self.bucket_steps[(decode, batch.size)] = self.bucket_steps.get((decode, batch.size), 0) + 1
        self.padding_tokens += batch.inputs.tokens.size - plan.num_tokens
        if batch.borrowed:
            self.borrowed_steps += 1
            return 0
        return int(self.tuner.choose(batch.heaviest, decode, batch.size))

    def _statics(self, call: StepCall, inputs: StepInputs) -> dict:
        """The static arguments of the program that runs `call` on these inputs."""
        decode = call.op == Op.DECODE
        size = inputs.num_seqs if decode else inputs.num_tokens
        statics = dict(kernels=self.kernels_for(decode, size, call.variant, borrowed=call.borrowed))
        if call.op != Op.LOGITS:
            if call.logprobs:  # absent: the plain variant
                statics["logprobs"] = self.max_logprobs
            if decode:
                statics["greedy"] = call.greedy
        return statics

    def _run(self, call: StepCall, inputs: StepInputs):
        """Run one program on placed inputs, updating the KV pool; returns its device outputs [I, ...]."""
        out, self._pool, self._penalty_state = self.programs.run(_OPS[call.op], self.state_leaves, self._pool, inputs,
                                                                 self._penalty_state, **self._statics(call, inputs))
        return out

    def step_memory(self, ops: tuple[str, ...] = ("decode", "prefill")) -> dict[str, int]:
        """Device bytes each of the largest programs needs while it runs, beyond its arguments (per device: XLA's
        memory analysis of the compiled program, its temporaries and the outputs not written in place), by name:
        every variant (sampling, logprobs, borrowed) of the largest decode and the largest prefill bucket, the
        buckets whose activations are largest (`ops`: of "decode" and "prefill"). Compiles them again, runs nothing;
        the pool may be abstract, so an engine sizes its pool from what is left after them (jaxllm.llm)."""
        needs = {}
        for decode in [name == "decode" for name in ops]:
            op = Op.DECODE if decode else Op.PREFILL
            size = (self.buckets.decode_sizes if decode else self.buckets.prefill_sizes)[-1]
            for logprobs in ((False, True) if self.max_logprobs else (False,)):
                for borrowed in ((False, True) if self.borrowing else (False,)):
                    call = StepCall(op, False, logprobs, 0, borrowed)
                    inputs = self._placed(self.layout.inert(decode, size, borrowed))
                    stats = self.programs.compiled(_OPS[op], self.state_leaves, self._pool, inputs,
                                                   self._penalty_state, **self._statics(call, inputs)
                                                   ).memory_analysis()
                    name = f"{_OPS[op]} {size}{' logprobs' if logprobs else ''}{' borrowed' if borrowed else ''}"
                    needs[name] = working_bytes(stats)
        return needs

    def compiled_step_text(self, plan: StepPlan) -> str:
        """XLA's optimized HLO of the program a (non-continued) step of this plan runs, with the variant the tuner
        picks (for profiling scripts: the collectives and copies in it). Compiles it again; runs nothing."""
        batch = self.layout.build(plan)
        decode = plan.is_decode
        call = StepCall(Op.DECODE if decode else Op.PREFILL, _greedy(plan), plan.wants_logprobs,
                        int(self.tuner.choose(batch.heaviest, decode, batch.size)) if not batch.borrowed else 0,
                        batch.borrowed)
        inputs = self._placed(batch.inputs)
        return self.programs.compiled(_OPS[call.op], self.state_leaves, self._pool, inputs, self._penalty_state,
                                      **self._statics(call, inputs)).as_text()

    def _placed(self, inputs: StepInputs) -> StepInputs:
        """Tokens, sampling arrays and penalty inputs on the devices once, so the continuations that reuse them
        transfer nothing (and jit sees the same committed arguments every step: a host array and a committed one
        of one shape are traced apart). Penalty inputs with no penalty and no bias in any row (most steps) are
        the same for every step of their shape: placed once."""
        placed = jax.device_put(tuple(getattr(inputs, name) for name in _SAMPLING), self.programs.io_sharding)
        inputs = dataclasses.replace(inputs, **dict(zip(_SAMPLING, placed)))
        rows = inputs.penalties
        if rows is None:
            return inputs
        if np.any(rows.slot >= 0) or np.any(rows.bias_ids >= 0):
            return dataclasses.replace(inputs, penalties=jax.device_put(rows, self.programs.io_sharding))
        key = (rows.slot.shape, rows.bias_ids.shape)
        if key not in self._inert_penalties:
            self._inert_penalties[key] = jax.device_put(rows, self.programs.io_sharding)
        return dataclasses.replace(inputs, penalties=self._inert_penalties[key])

    def _copy_blocks(self, copies: np.ndarray) -> None:
        """Copy rBlocks (global source, global destination) [M, 2] on the devices, all reads before any write."""
        m = bucket(len(copies), 8)
        src, dst = np.full(m, -1, np.int32), np.full(m, -1, np.int32)
        src[:len(copies)], dst[:len(copies)] = copies[:, 0], copies[:, 1]
        self.launcher.submit(self._launch_copy, BlockCopies(src, dst))
        self.copied_blocks += len(copies)

    def _copy_host(self, copies: HostCopies, *, out: bool) -> None:
        """Queue a plan's host-tier copies out (before its recall copies) or in (after them)."""
        if self.host_store is None:
            raise ValueError("the plan has host copies; this executor was built without a host tier")
        self.launcher.submit(self._launch_host_copies, copies, out)

    def _launch_host_copies(self, copies: HostCopies, out: bool) -> None:
        store = self.host_store
        self._pool = (store.copy_out if out else store.copy_in)(self._pool, copies)

    def _launch_copy(self, copies: BlockCopies) -> None:
        self._announce(StepCall(Op.COPY), copies)
        self._pool = self.programs.copy_blocks(self._pool, copies.src, copies.dst)

    def _warm_host_copies(self) -> None:
        self._pool = self.host_store.warm_up(self._pool)

    # ----- warm-up -----

    def bucket_shapes(self) -> list[tuple[bool, int, bool, bool]]:
        """Every (decode, size, greedy, logprobs) a step can take: sequences for decode, tokens for prefill
        (Buckets.shapes); decode steps in both variants (greedy only, or with the sampler); every shape also
        in its logprob variant when max_logprobs > 0."""
        shapes = [(shape.decode, shape.size, greedy) for shape in self.buckets.shapes()
                  for greedy in ((False, True) if shape.decode else (False,))]
        return [shape + (logprobs,) for logprobs in ((False, True) if self.max_logprobs else (False,))
                for shape in shapes]

    def warm_up_plan(self) -> list[tuple[StepCall, int]]:
        """Every (call, bucket size) warm-up compiles, one compile each: bucket_shapes x the tuner's variants
        of each bucket (a variant equal to an earlier one of its bucket is the same program, listed once), and
        with borrowing each shape's borrowed variant."""
        plan = []
        for decode, size, greedy, logprobs in self.bucket_shapes():
            op = Op.DECODE if decode else Op.PREFILL
            listed = self.variants(decode, size)
            plan += [(StepCall(op, greedy, logprobs, i), size) for i, k in enumerate(listed) if k not in listed[:i]]
            if self.borrowing:
                plan.append((StepCall(op, greedy, logprobs, 0, borrowed=True), size))
        return plan

    def warm_up(self, progress: bool = True) -> None:
        """Compile every program serving can meet now (warm_up_plan, its total said first; with borrowing the
        recall copy too), so serving compiles nothing new."""
        from jaxllm.progress import Progress

        plan = self.warm_up_plan()
        copies = 1 if self.borrowing else 0
        runs = [] if self.host_store is None else self.host_store.run_lengths()
        if progress:
            buckets = len(self.buckets.decode_sizes), len(self.buckets.prefill_sizes)
            borrowed = ", each also with borrowed rBlocks, and the recall copy" if copies else ""
            host = (f", and the host tier's gather and scatter of {len(runs)} run lengths, then its "
                    f"{self.host_store.reserve_blocks * self.block_bytes / (1 << 30):.1f} GiB of host memory an "
                    f"instance reserved" if runs else "")
            print(f"[jaxllm] warm-up: {len(plan) + copies + 2 * len(runs)} compiles ({buckets[0]} decode + "
                  f"{buckets[1]} prefill buckets x tuner variants x greedy/logprob variants{borrowed}{host})",
                  file=sys.stderr, flush=True)
        with Progress(len(plan) + copies + 2 * len(runs), "warm-up compiles", enabled=progress) as bar:
            for call, size in plan:
                inputs = self.layout.inert(call.op == Op.DECODE, size, call.borrowed)
                jax.block_until_ready(self.launcher.run(self._launch, call, inputs, None).tokens)
                bar.update(1, detail=f"{_OPS[call.op]} {size}{' greedy' if call.greedy else ''}"
                                     f"{' logprobs' if call.logprobs else ''}"
                                     f"{f' variant {call.variant}' if call.variant else ''}"
                                     f"{' borrowed' if call.borrowed else ''}")
            if copies:
                self._copy_blocks(np.zeros((1, 2), np.int32))  # the smallest copy bucket: rBlock 0 onto itself
                self.copied_blocks -= 1
                self.launcher.drain()
                bar.update(1, detail="recall copy")
            if runs:
                self.launcher.run(self._warm_host_copies)
                bar.update(2 * len(runs), detail=f"host copies of {runs[0]}..{runs[-1]} rBlocks, host memory "
                                                 f"reserved in {self.host_store.reserved_seconds:.1f} s")

    # ----- multi-process runs -----

    def _announce(self, call: StepCall, inputs) -> None:
        """Process 0: hand one call to every other process (their follow() runs it too)."""
        if self.channel is not None:
            self.channel.send(call, inputs)

    def follow(self) -> int:
        """Processes other than 0: run every call process 0 sends, as it runs them, until it stops; returns the
        number of calls run."""
        if self.channel is None or multihost.is_leader():
            raise ValueError("Executor.follow runs on the processes other than 0 of a multi-process run "
                             f"(this is process {jax.process_index()} of {jax.process_count()})")
        calls = 0
        while (received := self.channel.receive()) is not None:
            call, inputs = received
            if call.op == Op.COPY:
                self._pool = self.programs.copy_blocks(self._pool, inputs.src, inputs.dst)
            elif call.source == TokenSource.CONTINUED:
                inputs = _continued(inputs, self._last.launched())
                self._last = self._followed(call, inputs)
            else:
                inputs = self._placed(inputs)
                self._last = self._followed(call, inputs)
            calls += 1
        self.channel = None
        return calls

    def _followed(self, call: StepCall, inputs: StepInputs) -> InFlight:
        out = self._run(call, inputs)
        if call.op == Op.LOGITS:
            return self._last
        tokens = out[0] if call.logprobs else out  # the logprob variant also returns its (unread) arrays
        return InFlight(None, Launched(tokens, None, inputs), np.zeros(0, np.int64), greedy=call.greedy)

    def stop_followers(self) -> None:
        """Process 0 at shutdown: the other processes' follow() returns (they exit). Idempotent; a no-op on
        one process."""
        if self.channel is not None and multihost.is_leader():
            self.launcher.run(self.channel.stop)  # after every call already submitted
            self.channel = None


def working_bytes(stats) -> int:
    """What a compiled program allocates while it runs (per device), from its memory analysis: its temporaries
    and its outputs less those written in place over donated arguments (the pool, the penalty state)."""
    if stats is None:  # a backend without the analysis
        return 0
    return int(stats.temp_size_in_bytes + max(stats.output_size_in_bytes - stats.alias_size_in_bytes, 0))


def _greedy(plan: StepPlan) -> bool:
    """Whether a step runs the argmax-only decode variant. Padding rows are greedy, so "no row samples" is "every
    sequence is greedy"; a penalty or a bias moves even a greedy row's argmax, and only the sampling variant
    applies them."""
    return (plan.is_decode and not np.any(plan.temperature > 0) and plan.penalties is None
            and plan.logit_bias is None)


def _continued(inputs: StepInputs, source: Launched) -> StepInputs:
    """A continuation step's inputs: the previous step's sampled tokens (still on the devices) and its
    sampling arrays and penalty inputs (same sequences, same order, every row sampling in both: the same values,
    already on the devices; a row clears its penalty slot only at its admission's start position, which a
    continuation has left behind)."""
    prev = source.inputs
    return dataclasses.replace(inputs, tokens=source.tokens, temperature=prev.temperature, top_k=prev.top_k,
                               top_p=prev.top_p, seed=prev.seed, penalties=prev.penalties)
