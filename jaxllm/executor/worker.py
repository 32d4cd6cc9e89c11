"""`Worker`: the part of the executor that owns the devices: the model's state and the KV pool placed on the mesh,
the jitted programs, the penalty state, the host tier's store, and the follower side of a multi-process run.

It runs `StepCall`s (jaxllm.executor.calls) on inputs already laid out (jaxllm.executor.inputs), in submission
order on its launcher thread (jaxllm.executor.launcher), and knows nothing of plans, buckets or the tuner's
choice: the ModelRunner (jaxllm.executor.model_runner) decides which call a plan is, this part runs it. Every
process of a multi-process mesh holds a Worker over the same mesh: process 0 announces each call through a
CallChannel as it submits it (a host message, sent while its own launcher may still be busy, in the launcher's
order), and every other process runs `follow()`, which receives each call and launches it at once, and hands the
outputs process 0 cannot read on its own devices (the rows of instances on this process's devices) to the results
channel (sharding.step_results), which sends them once they are computed.
Memory analysis lives here too: `working_bytes` compiles a call's program again and reads what XLA says it
allocates, so the engine can size its pool before one exists (the pool may be abstract).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxllm.contract import HostCopies, StepKind
from jaxllm.executor.calls import BlockCopies, CallChannel, Op, StepCall, TokenSource
from jaxllm.executor.host_store import HostStore
from jaxllm.executor.host_transfer import AsyncHostTransfer, HostTransfer
from jaxllm.executor.in_flight import InFlight, Launched, host_array, numbered_outputs
from jaxllm.executor.launcher import Launcher
from jaxllm.executor.penalties import PenaltyInputs, init_penalty_state
from jaxllm.executor.programs import StepPrograms
from jaxllm.executor.step import StepInputs
from jaxllm.executor.variants import KernelVariants
from jaxllm.model.kv_cache import KVCache
from jaxllm.model.llama import Llama
from jaxllm.tuner.buckets import pow2_at_least
from pallas_kernels import compat
from sharding import multihost
from sharding.mesh import INSTANCE

__all__ = ["Worker", "working_bytes"]

_SAMPLING = ("tokens", "temperature", "top_k", "top_p", "seed")


class Worker:
    """Holds the model's state and the KV pool on a mesh and runs calls on them (see the module docstring).

    mesh: the `instance x tensor` mesh the state and the pool are placed on (sharding.rules.shard_params /
    kv_pool_shardings); instances: its instance axis (the pool holds instances x blocks_per_instance rBlocks,
    global id = instance * blocks_per_instance + local). variants: the Kernels each call's variant runs.
    max_logprobs: top tokens the logprob variants return. penalty_rows: rows of penalty state per instance
    (jaxllm.executor.penalties; 0: penalties off). host_tier: the slots of each instance's host tier (0: none);
    longest_table: the most rBlocks a sequence's table holds (the host store's longest run); host_transfer: how
    runs cross the host link (default AsyncHostTransfer).
    """

    def __init__(self, model: Llama, kv_cache: KVCache, *, mesh, instances: int, variants: KernelVariants,
                 max_logprobs: int = 0, penalty_rows: int = 0, host_tier: int = 0, longest_table: int = 1,
                 host_transfer: HostTransfer | None = None):
        graphdef, state = nnx.split(model)
        # Committed where they lie (no copy): jit keys an uncommitted argument apart from a committed one, and
        # the donated pool comes back committed from the first step, which would trace every program twice.
        placed = lambda tree: jax.device_put(tree, jax.tree.map(lambda x: x.sharding, tree))  # noqa: E731
        self.state = placed(state)
        # An abstract pool (jax.ShapeDtypeStruct leaves, for working_bytes before a pool exists) is kept as it is.
        self.abstract_pool = not all(isinstance(x, jax.Array) for x in jax.tree.leaves(kv_cache))
        kv_cache = kv_cache if self.abstract_pool else placed(kv_cache)
        self.state_leaves = jax.tree.leaves(self.state)  # what the programs take (programs.py says why)
        self.config = model.config
        self._pool = kv_cache  # touched by the launcher thread's calls alone (and by follow() on followers)
        self.launcher = Launcher()
        self.mesh, self.instances, self.variants = mesh, instances, variants
        self.blocks_per_instance = kv_cache.num_blocks // instances
        self.max_logprobs = max_logprobs
        multi_process = jax.process_count() > 1
        # Split over `instance` like the pool (each instance its rows), whole on every tensor shard.
        rows = NamedSharding(mesh, P(INSTANCE) if instances > 1 else P())
        self._penalty_state = (init_penalty_state(instances * penalty_rows, model.config.vocab_size, rows)
                               if penalty_rows else None)
        self.programs = StepPrograms(graphdef, self.state, kv_cache, mesh, instances=instances,
                                     penalty_state=self._penalty_state)
        self._inert_penalties: dict[tuple, PenaltyInputs] = {}  # placed once per shape (place says why)
        self.channel = CallChannel() if multi_process else None
        results, leader = multihost.step_results(), multihost.is_leader()  # the results channel's end (or None)
        self._collector = results if leader else None  # process 0: the followers' rows of each output come here
        self._returner = None if leader else results  # a follower: its rows process 0 lacks go there
        self._submitting = threading.Lock()  # announcements in the launcher's order
        self.last: InFlight | None = None  # the last step dispatched (a continuation's only possible source)
        self.copied_blocks = 0  # rBlocks copied between instances (recalls), warm-up's not counted
        self.block_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(kv_cache)) // kv_cache.num_blocks
        self.host_store = None
        if host_tier:
            if self.abstract_pool:
                raise ValueError("an executor over an abstract pool (memory planning) has no host tier")
            if multi_process:
                raise ValueError(f"a host tier serves the instances of one process; this run has "
                                 f"{jax.process_count()} processes")
            transfer = host_transfer or AsyncHostTransfer(self.programs.run_shardings, instances=instances)
            self.host_store = HostStore(
                self.programs, transfer, max_run=min(pow2_at_least(longest_table),
                                                     1 << (kv_cache.num_blocks.bit_length() - 1)),
                block_bytes=self.block_bytes, slots_per_instance=host_tier if instances > 1 else None,
                reserve_blocks=host_tier)
        if compat.on_gpu():
            compat.silence_triton_deprecation()  # jax 0.11 warns on every Triton-lowered kernel it traces

    @property
    def kv_cache(self) -> KVCache:
        """The KV pool, once every call submitted so far has run."""
        self.launcher.drain()
        return self._pool

    @property
    def block_size(self) -> int:
        return self._pool.block_size

    @property
    def has_penalties(self) -> bool:
        """Whether it keeps penalty state (plans may carry penalties and logit biases)."""
        return self._penalty_state is not None

    # ----- running calls -----

    def statics(self, call: StepCall, inputs: StepInputs) -> dict:
        """The static arguments of the program that runs `call` on these inputs: its variant's Kernels (a logits
        call's are its prefill bucket's), and for a step its logprob variant and (decode, verify) its greedy one."""
        kind = call.kind if call.op is Op.STEP else StepKind.PREFILL
        size = inputs.num_tokens if kind is StepKind.PREFILL else inputs.num_seqs
        statics = dict(kernels=self.variants.kernels_for(kind, size, call.variant, borrowed=call.borrowed))
        if call.op is Op.STEP:
            if call.logprobs:  # absent: the plain variant
                statics["logprobs"] = self.max_logprobs
            if kind is not StepKind.PREFILL:
                statics["greedy"] = call.greedy
        return statics

    def run(self, call: StepCall, inputs: StepInputs):
        """Run one program on placed inputs, updating the KV pool; returns its device outputs [I, ...]."""
        out, self._pool, self._penalty_state = self.programs.run(call.program, self.state_leaves, self._pool, inputs,
                                                                 self._penalty_state, **self.statics(call, inputs))
        return out

    def launch(self, call: StepCall, inputs: StepInputs, source: InFlight | None) -> concurrent.futures.Future:
        """Queue a step: announced now, then on the launcher thread its inputs placed (or the continued step's
        taken) and run; the Future of its Launched."""
        return self._submit(call, inputs, self._launch, call, inputs, source)

    def launch_logits(self, call: StepCall, inputs: StepInputs) -> concurrent.futures.Future:
        """Queue a logits call (announced now, placed and run on the launcher thread); the Future of its output."""
        return self._submit(call, inputs, self._launch_logits, call, inputs)

    def _submit(self, call: StepCall, inputs, fn, *args) -> concurrent.futures.Future:
        with self._submitting:
            seq = self.announce(call, inputs)
            return self.launcher.submit(fn, *args, self.reader(seq))

    def reader(self, seq: int | None):
        """How process 0 reads call `seq`'s outputs on the host, `read(x, k)` (Launched.read): whole from its own
        devices, or with the other processes' rows from the results channel."""
        collector = self._collector
        if seq is None or collector is None:
            return host_array
        return lambda x, k: collector.read(x, seq, k)

    def _launch(self, call: StepCall, inputs: StepInputs, source: InFlight | None, read) -> Launched:
        inputs = self.place(inputs) if source is None else continued(inputs, source.launched())
        return _launched(call, self.run(call, inputs), inputs, read)

    def _launch_logits(self, call: StepCall, inputs: StepInputs, read) -> np.ndarray:
        return read(self.run(call, self.place(inputs)), 0)

    def place(self, inputs: StepInputs) -> StepInputs:
        """Tokens, sampling arrays and penalty inputs on the devices once, so the continuations that reuse them
        transfer nothing (and jit sees the same committed arguments every step: a host array and a committed one
        of one shape are traced apart). Penalty inputs with no penalty and no bias in any row (most steps) are
        the same for every step of their shape: placed once."""
        placed = multihost.put(tuple(getattr(inputs, name) for name in _SAMPLING), self.programs.io_sharding)
        inputs = dataclasses.replace(inputs, **dict(zip(_SAMPLING, placed)))
        rows = inputs.penalties
        if rows is None:
            return inputs
        if np.any(rows.slot >= 0) or np.any(rows.bias_ids >= 0):
            return dataclasses.replace(inputs, penalties=multihost.put(rows, self.programs.io_sharding))
        key = (rows.slot.shape, rows.bias_ids.shape)
        if key not in self._inert_penalties:
            self._inert_penalties[key] = multihost.put(rows, self.programs.io_sharding)
        return dataclasses.replace(inputs, penalties=self._inert_penalties[key])

    def compiled(self, call: StepCall, inputs: StepInputs):
        """The executable `call` runs on these (host) inputs, compiled again (runs nothing): its `as_text()` is
        XLA's optimized HLO, its `memory_analysis()` what it allocates (StepPrograms.compiled)."""
        inputs = self.place(inputs)
        return self.programs.compiled(call.program, self.state_leaves, self._pool, inputs, self._penalty_state,
                                      **self.statics(call, inputs))

    def working_bytes(self, call: StepCall, inputs: StepInputs) -> int:
        """Device bytes the program of `call` needs while it runs, beyond its arguments (per device)."""
        return working_bytes(self.compiled(call, inputs).memory_analysis())

    # ----- copies -----

    def copy_blocks(self, copies: np.ndarray) -> None:
        """Queue a copy of rBlocks (global source, global destination) [M, 2] on the devices, all reads before any
        write, padded to a power-of-two bucket of copies."""
        m = pow2_at_least(len(copies), 8)
        src, dst = np.full(m, -1, np.int32), np.full(m, -1, np.int32)
        src[:len(copies)], dst[:len(copies)] = copies[:, 0], copies[:, 1]
        padded = BlockCopies(src, dst)
        self._submit(StepCall(Op.COPY), padded, self._launch_copy, padded)
        self.copied_blocks += len(copies)

    def copy_host(self, copies: HostCopies, *, out: bool) -> None:
        """Queue a plan's host-tier copies out (before its recall copies) or in (after them)."""
        if self.host_store is None:
            raise ValueError("the plan has host copies; this executor was built without a host tier")
        self.launcher.submit(self._launch_host_copies, copies, out)

    def warm_up_copies(self) -> None:
        """Compile the recall copy (the smallest copy bucket, rBlock 0 onto itself, not counted) and wait."""
        self.copy_blocks(np.zeros((1, 2), np.int32))
        self.copied_blocks -= 1
        self.launcher.drain()

    def warm_up_host_copies(self) -> None:
        """Compile the host tier's gathers and scatters and reserve its host memory (HostStore.warm_up); waits."""
        self.launcher.run(self._warm_host_copies)

    def _launch_host_copies(self, copies: HostCopies, out: bool) -> None:
        store = self.host_store
        self._pool = (store.copy_out if out else store.copy_in)(self._pool, copies)

    def _launch_copy(self, copies: BlockCopies, read) -> None:
        self._pool = self.programs.copy_blocks(self._pool, copies.src, copies.dst)

    def _warm_host_copies(self) -> None:
        self._pool = self.host_store.warm_up(self._pool)

    # ----- multi-process runs -----

    def announce(self, call: StepCall, inputs) -> int | None:
        """Process 0: hand one call to every other process (their follow() runs it too); `_submit` calls it, in
        submission order. Its sequence number on a multi-process run, else None."""
        if self.channel is not None:
            return self.channel.send(call, inputs)
        return None

    def follow(self) -> int:
        """Processes other than 0: launch every call process 0 sends as it arrives, in its order, until it stops;
        returns the number of calls run."""
        if self.channel is None or multihost.is_leader():
            raise ValueError("follow runs on the processes other than 0 of a multi-process run "
                             f"(this is process {jax.process_index()} of {jax.process_count()})")
        calls = 0
        while (received := self.channel.receive()) is not None:
            call, inputs, seq = received
            if call.op is Op.COPY:
                self._pool = self.programs.copy_blocks(self._pool, inputs.src, inputs.dst)
            elif call.source == TokenSource.CONTINUED:
                inputs = continued(inputs, self.last.launched())
                self.last = self._followed(call, inputs, seq)
            else:
                self.last = self._followed(call, self.place(inputs), seq)
            calls += 1
        self.channel = None
        self._returner.close()  # what is queued goes first
        return calls

    def _followed(self, call: StepCall, inputs: StepInputs, seq: int) -> InFlight:
        out = self.run(call, inputs)
        if call.op is Op.LOGITS:
            self._returner.send(seq, [out])
            return self.last
        launched = _launched(call, out, inputs, host_array)
        self._returner.send(seq, numbered_outputs(launched))
        return InFlight(None, launched, np.zeros(0, np.int64), greedy=call.greedy)

    def stop_followers(self) -> None:
        """Process 0 at shutdown: the other processes' follow() returns (they exit). Idempotent; a no-op on
        one process."""
        if self.channel is not None and multihost.is_leader():
            with self._submitting:  # after every call already announced
                self.channel.stop()
                self.channel = None


def working_bytes(stats) -> int:
    """What a compiled program allocates while it runs (per device), from its memory analysis: its temporaries
    and its outputs less those written in place over donated arguments (the pool, the penalty state)."""
    if stats is None:  # a backend without the analysis
        return 0
    return int(stats.temp_size_in_bytes + max(stats.output_size_in_bytes - stats.alias_size_in_bytes, 0))


def _launched(call: StepCall, out, inputs: StepInputs, read) -> Launched:
    """A step program's outputs as a Launched (the logprob variant's are (tokens, sampled, prompt))."""
    if not call.logprobs:
        return Launched(out, None, inputs, read=read)
    tokens, sampled, prompt = out
    return Launched(tokens, sampled, inputs, prompt, read=read)


def continued(inputs: StepInputs, source: Launched) -> StepInputs:
    """A continuation step's inputs: the previous step's sampled tokens (still on the devices) and its
    sampling arrays and penalty inputs (same sequences, same order, every row sampling in both: the same values,
    already on the devices; a row clears its penalty slot only at its admission's start position, which a
    continuation has left behind)."""
    prev = source.inputs
    return dataclasses.replace(inputs, tokens=source.tokens, temperature=prev.temperature, top_k=prev.top_k,
                               top_p=prev.top_p, seed=prev.seed, penalties=prev.penalties)
