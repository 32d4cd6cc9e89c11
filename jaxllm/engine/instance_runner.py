"""The runner of an engine of several instances: every instance runs its own rows in one step over the mesh.

The step functions of step.py run per instance inside a `shard_map` manual over the `instance` axis (the
`tensor` axis stays with XLA, and the Pallas kernels go per tensor shard inside it as on one instance): each
instance sees its own stacked inputs (jaxllm.engine.instance_inputs) and its own pool shard, and samples its
own tokens. Two variants of every bucket: the plain one (every sequence's rBlocks at home: no collective at
all, so instances cost nothing until they lend), and the borrowed one (DistParts: sharding.dist_step's
DistAttention). Recalls copy rBlocks between instances (`copy_blocks`) between steps.
"""

from __future__ import annotations

import dataclasses
import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxllm.engine.instance_inputs import inert_instance_inputs, instance_step_inputs
from jaxllm.engine.runner import InFlight, Runner, host_array
from jaxllm.engine.scheduler import StepPlan
from jaxllm.engine.step import StepInputs, bucket
from jaxllm.tuner.compile_cache import compile_events
from sharding import multihost
from sharding.mesh import INSTANCE, tensor_size

__all__ = ["InstanceRunner"]

# Call words of a multi-process run (Runner's ops are 0..2).
_DECODE, _PREFILL, _COPY = 0, 1, 3


class InstanceRunner(Runner):
    """A Runner whose steps take a joined plan of `instances` instances (StepPlan.instances set) and whose
    KV pool holds `blocks_per_instance` rBlocks per instance (global id = instance * blocks + local)."""

    def __init__(self, model, kv_cache, *, instances: int, blocks_per_instance: int, mesh, **kwargs):
        if mesh is None or int(mesh.shape.get(INSTANCE, 1)) != instances:
            raise ValueError(f"an InstanceRunner of {instances} instances needs a mesh whose {INSTANCE!r} axis has "
                             f"{instances} devices")
        if kv_cache.num_blocks != instances * blocks_per_instance:
            raise ValueError(f"the KV pool holds {kv_cache.num_blocks} rBlocks, not {instances} instances x "
                             f"{blocks_per_instance}")
        self.instances = instances
        self.blocks_per_instance = blocks_per_instance
        self.borrowed_steps = 0  # steps that ran DistAttention
        self.copies = 0  # rBlocks copied by recalls
        super().__init__(model, kv_cache, mesh=mesh, **kwargs)
        # DistAttention calls its kernels directly: under tensor parallelism they would see whole KV heads, so
        # there the borrowed variant takes the references, which XLA partitions over `tensor`.
        self.dist_kernels = self.kernels if tensor_size(mesh) == 1 else dataclasses.replace(
            self.kernels, decode_attention="reference", prefill_attention="reference")
        self._copy = jax.jit(self._counted_copy, donate_argnums=(0,), out_shardings=jax.tree.map(
            lambda x: x.sharding, kv_cache))

    def _counted(self, fn):
        """fn (a step function of step.py) with the graphdef bound, run per instance: inputs [I, ...]
        -> outputs [I, ...]."""
        bound = super()._counted(fn)
        mesh = self.mesh

        def per_instance(state, pool, inputs, **statics):
            def local(state, pool, inputs):
                out, pool = bound(state, pool, jax.tree.map(lambda x: x[0], inputs), **statics)
                return jax.tree.map(lambda x: x[None], out), pool

            return jax.shard_map(local, mesh=mesh, in_specs=(P(), P(INSTANCE), P(INSTANCE)),
                                 out_specs=(P(INSTANCE), P(INSTANCE)), axis_names={INSTANCE},
                                 check_vma=False)(state, pool, inputs)

        return functools.wraps(fn)(per_instance)

    # ----- steps -----

    def kernels_for(self, decode: bool, padded_size: int, variant: int = 0, *, borrowed: bool = False):
        """Every instance runs the tuner's fallback variant; a borrowed step the DistAttention kernels."""
        return self.dist_kernels if borrowed else super().kernels_for(decode, padded_size, 0)

    def run_step(self, decode: bool, inputs: StepInputs, *, greedy: bool = False, logprobs: bool = False,
                 variant: int = 0):
        del variant  # one variant a bucket on several instances
        borrowed = inputs.parts is not None
        self.borrowed_steps += borrowed
        size = inputs.num_seqs if decode else inputs.num_tokens
        kernels = self.kernels_for(decode, size, borrowed=borrowed)
        extra = {"logprobs": self.max_logprobs} if logprobs else {}
        before = compile_events()
        if decode:
            tokens, self.kv_cache = self.decode_step(self.state, self.kv_cache, inputs, kernels=kernels,
                                                     greedy=greedy, **extra)
        else:
            tokens, self.kv_cache = self.prefill_step(self.state, self.kv_cache, inputs, kernels=kernels, **extra)
        self._count_compiles(before)
        return tokens

    def instance_inputs(self, plan: StepPlan):
        return instance_step_inputs(plan, instances=self.instances, blocks_per_instance=self.blocks_per_instance,
                                    block_size=self.block_size, min_tokens=self.min_tokens, seq_cap=self.seq_cap,
                                    table_width=self.table_width)

    def dispatch(self, plan: StepPlan, *, token_source: InFlight | None = None) -> InFlight:
        """Start one step of every instance's rows (a joined plan); no continuations (the heartbeat and the
        recalls run between steps)."""
        if token_source is not None:
            raise ValueError("an engine of several instances plans each step after the last one's tokens are in")
        if plan.instances is None:
            raise ValueError("an engine of several instances runs joined plans (StepPlan.instances set)")
        built = self.instance_inputs(plan)
        inputs, decode = built.inputs, plan.is_decode
        size = inputs.num_seqs if decode else inputs.num_tokens
        self.bucket_steps[(decode, size)] = self.bucket_steps.get((decode, size), 0) + 1
        self.padding_tokens += self.instances * inputs.num_tokens - plan.num_tokens
        greedy = decode and not np.any(plan.temperature > 0)
        if self.broadcast is not None:
            self._announce(_DECODE if decode else _PREFILL, inputs, greedy, 0, plan.wants_logprobs)
        inputs = self._sampling_on_device(inputs)
        out = self.run_step(decode, inputs, greedy=greedy, logprobs=plan.wants_logprobs)
        tokens, logprobs = out if plan.wants_logprobs else (out, None)
        rows = built.rows
        flat = lambda x: x.reshape(-1, *x.shape[2:])  # noqa: E731  [I, S, ...] -> [I*S, ...]
        self._last = InstanceInFlight(plan, tokens, inputs, greedy, logprobs, rows=rows, flat=flat)
        return self._last

    def logits(self, plan: StepPlan) -> np.ndarray:
        raise ValueError("teacher-forced logits (prompt log-probabilities) run on an engine of one instance")

    # ----- recalls -----

    def _counted_copy(self, pool, src, dst):
        """Copy rBlocks src[m] -> dst[m] (global ids; -1: padding) across instances: every instance puts in
        the rBlocks it holds, a psum over the axis hands each its destinations' contents. Reads all before
        writing any, so a swap is two copies."""
        self.compile_count += 1
        nb = self.blocks_per_instance

        def local(pool, src, dst):
            me = jax.lax.axis_index(INSTANCE)

            def move(x):
                mine = (src >= 0) & (src // nb == me)
                taken = jnp.where(mine.reshape((-1,) + (1,) * (x.ndim - 1)), x[jnp.where(mine, src % nb, 0)], 0)
                # Summed in float32 whatever the pool's dtype (int8 and bf16 values are exact there, and only
                # one instance puts in each rBlock): XLA's CPU all-reduce of bf16 fails to compile.
                moved = jax.lax.psum(taken.astype(jnp.float32), INSTANCE)
                target = jnp.where((dst >= 0) & (dst // nb == me), dst % nb, x.shape[0])  # out of range: dropped
                return x.at[target].set(moved.astype(x.dtype), mode="drop")

            return jax.tree.map(move, pool)

        return jax.shard_map(local, mesh=self.mesh, in_specs=(P(INSTANCE), P(), P()), out_specs=P(INSTANCE),
                             axis_names={INSTANCE}, check_vma=False)(pool, src, dst)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy rBlocks (global source id, global destination id) on the device, all reads before any write."""
        if not copies:
            return
        m = bucket(len(copies), 8)
        src = np.full(m, -1, np.int32)
        dst = np.full(m, -1, np.int32)
        src[:len(copies)], dst[:len(copies)] = zip(*copies)
        if self.broadcast is not None:
            self.broadcast.send({"call": np.array([_COPY, 0, 0, 0], np.int32), "inputs": {"src": src, "dst": dst}})
        self.kv_cache = self._copy(self.kv_cache, src, dst)
        self.copies += len(copies)

    # ----- warm-up and followers -----

    def bucket_shapes(self):
        """Every (decode, size, greedy, logprobs, borrowed) a step can take: Runner's, each in both variants."""
        shapes = super().bucket_shapes()  # (zero-argument super() does not work inside the comprehension)
        return [shape + (borrowed,) for borrowed in (False, True) for shape in shapes]

    def warm_up_plan(self):
        """Every (decode, size, greedy, logprobs, variant, borrowed) warm-up compiles: each bucket shape in
        its plain and its borrowed variant (one tuner variant a bucket)."""
        return [(decode, size, greedy, logprobs, 0, borrowed)
                for decode, size, greedy, logprobs, borrowed in self.bucket_shapes()]

    def warm_up(self, progress: bool = True) -> None:
        from jaxllm.progress import Progress

        shapes = self.bucket_shapes()
        if progress:
            print(f"[jaxllm] warm-up: {len(shapes) + 1} step compiles (every bucket plain and with borrowed rBlocks, "
                  "and the recall copy)", file=sys.stderr, flush=True)
        with Progress(len(shapes), "warm-up compiles", enabled=progress) as bar:
            for decode, size, greedy, logprobs, borrowed in shapes:
                t_pad, s_pad = self.padded_sizes(decode, size)
                inputs = inert_instance_inputs(decode, t_pad, s_pad, self.table_width, self.instances, borrowed)
                if self.broadcast is not None:
                    self._announce(_DECODE if decode else _PREFILL, inputs, greedy, 0, logprobs)
                inputs = self._sampling_on_device(inputs)  # as dispatch places them (Runner.warm_up says why)
                jax.block_until_ready(self.run_step(decode, inputs, greedy=greedy, logprobs=logprobs))
                bar.update(1, detail=f"{'decode' if decode else 'prefill'} {size}{' greedy' if greedy else ''}"
                                     f"{' logprobs' if logprobs else ''}{' borrowed' if borrowed else ''}")
            self.copy_blocks([(0, 0)])  # the recall copy's smallest bucket (a copy of rBlock 0 onto itself)
            self.copies -= 1

    def follow(self) -> int:
        if self.broadcast is None or multihost.is_leader():
            raise ValueError("Runner.follow runs on the processes other than 0 of a multi-process run "
                             f"(this is process {jax.process_index()} of {jax.process_count()})")
        calls = 0
        while (message := self.broadcast.receive()) is not None:
            op, greedy, _mode, logprobs = (int(x) for x in message["call"][:4])
            if op == _COPY:
                self.kv_cache = self._copy(self.kv_cache, message["inputs"]["src"], message["inputs"]["dst"])
            else:
                inputs = message["inputs"]
                if _mode == 0:
                    inputs = self._sampling_on_device(inputs)
                self.run_step(op == _DECODE, inputs, greedy=bool(greedy), logprobs=bool(logprobs))
            calls += 1
        self.broadcast = None
        return calls


class InstanceInFlight(InFlight):
    """A dispatched step of several instances: outputs [I, S_pad, ...]; `rows` picks each plan row's."""

    def __init__(self, plan, device_tokens, inputs, greedy, device_logprobs, *, rows: np.ndarray, flat):
        super().__init__(plan, device_tokens, inputs, greedy, device_logprobs)
        self.rows = rows
        self.flat = flat

    def tokens(self) -> np.ndarray:
        return self.flat(host_array(self.device_tokens))[self.rows]

    def logprobs(self):
        if self.device_logprobs is None:
            return None
        return tuple(self.flat(host_array(a))[self.rows] for a in self.device_logprobs)
