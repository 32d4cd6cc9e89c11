"""The one engine module that runs jax: pads step plans to shape buckets and runs the jitted steps of step.py.

Shapes come from a small set of buckets, so a long-running server compiles a bounded number of
step functions, all of them at warm-up: a decode step is shaped by its sequence count alone (a
power of two), a prefill/mixed step by its token count alone (a power of two; its sequence axis
padded to the same size, capped at max_seqs), and the rBlock-table width is fixed by the context
limit (jaxllm.tuner.buckets.Buckets owns the rule and states the padding waste it accepts). A decode
step whose sequences are all greedy has its own variant that takes the argmax and skips sampling's
full-vocabulary sort (the sort costs tens to hundreds of microseconds a step, the argmax
a few: scripts/bench_sampling.py, benchmarks/NOTES.md); prefill steps always carry the sampler, so warm-up compiles one more
function per decode bucket only. A step in which some sequence wants log-probabilities runs a variant
of its step that also returns them (the top `max_logprobs`), so the plain variants, and decode speed,
are untouched; with max_logprobs > 0 warm-up compiles those variants of every bucket too. Every trace of a step function (a cache miss, hence a compile) is
counted in `compile_count`; the XLA compiles behind them (a persistent-cache read is not one) in
`xla_compiles`. Each bucket has the variants (`Kernels`) its StepTuner lists (jaxllm/tuner/protocol.py;
FixedTuner, one variant, unless a tuner is given): warm-up compiles every bucket x variant
(`warm_up_plan`), and each step runs the variant the tuner's `choose` picks on the host.

`dispatch` queues a step and returns without waiting; `InFlight.tokens()` waits. A decode step can
take its input tokens straight from the previous step's device output, so the host can queue step
N+1 while step N runs instead of leaving the device idle during every dispatch.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect

import jax
import numpy as np
from flax import nnx

from jaxllm.engine.kv_cache import KVCache
from jaxllm.engine.scheduler import StepPlan
from jaxllm.engine.step import (StepInputs, bucket, decode_step, inert_step_inputs, logits_step, make_step_inputs,
                                prefill_step)
from jaxllm.model.llama import Llama
from jaxllm.tuner.buckets import Buckets
from jaxllm.tuner.compile_cache import compile_events
from jaxllm.tuner.fixed import FixedTuner
from jaxllm.tuner.protocol import StepTuner
from pallas_kernels import compat
from pallas_kernels.dispatch import Kernels, default_kernels
from sharding import multihost
from sharding.rules import replicated
from sharding.tensor_parallel import tensor_parallel_kernels

__all__ = ["InFlight", "Runner", "bucket", "host_array"]

# A multi-process run's call word [op, greedy, mode, logprobs, variant]: which jitted step, where its inputs
# come from, and which of the bucket's tuner variants runs it.
_DECODE, _PREFILL, _LOGITS = 0, 1, 2
_FRESH, _CONTINUED, _AS_SENT = 0, 1, 2  # sampling arrays put on the devices / the previous step's / warm-up's


class InFlight:
    """A dispatched step: its plan and its sampled tokens, still on the device until `tokens()`."""

    def __init__(self, plan: StepPlan, device_tokens: jax.Array, inputs: StepInputs, greedy: bool = False,
                 device_logprobs: tuple[jax.Array, jax.Array, jax.Array] | None = None):
        self.plan = plan
        self.greedy = greedy  # ran the greedy-only step variant (every sequence at temperature 0)
        self.device_tokens = device_tokens  # [padded sequences] int32
        self.inputs = inputs  # the step's inputs; its sampling arrays are on the device
        # The logprob variant's (token logprob [S], top ids [S, K], top logprobs [S, K]); None otherwise.
        self.device_logprobs = device_logprobs
        self._host: np.ndarray | None = None

    def tokens(self) -> np.ndarray:
        """The sampled token of every sequence in the plan ([S] int32); waits for the device."""
        if self._host is None:
            self._host = host_array(self.device_tokens)[:self.plan.num_seqs]
        return self._host

    def logprobs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """(token logprob [S] float32, top ids [S, K] int32, top logprobs [S, K] float32) of every sequence in
        the plan, None unless the step computed them; waits for the device."""
        if self.device_logprobs is None:
            return None
        return tuple(np.asarray(a)[:self.plan.num_seqs] for a in self.device_logprobs)


def host_array(x: jax.Array) -> np.ndarray:
    """A replicated device array on the host: on a multi-process mesh, this process's copy."""
    return np.asarray(x if x.is_fully_addressable else x.addressable_data(0))


def _jit_on_mesh(fn, *, static_argnames: tuple[str, ...], in_shardings, out_shardings):
    """fn(state, pool, inputs, **statics) jitted with shardings and the pool donated, called as jax.jit's
    result is. jit takes no keyword arguments alongside in_shardings, so the static ones travel
    positionally (a keyword left out takes fn's default)."""
    defaults = {name: p.default for name, p in inspect.signature(fn).parameters.items() if name in static_argnames}

    def positional(state, pool, inputs, *statics):
        return fn(state, pool, inputs, **dict(zip(static_argnames, statics)))

    jitted = jax.jit(positional, static_argnums=tuple(range(3, 3 + len(static_argnames))), donate_argnums=(1,),
                     in_shardings=in_shardings, out_shardings=out_shardings)

    def call(state, pool, inputs, **statics):
        return jitted(state, pool, inputs, *(statics.get(name, defaults.get(name)) for name in static_argnames))

    return call


class Runner:
    """Holds the model's state and the KV pool; runs one step at a time.

    mesh: None runs on one device. Otherwise the model's state and the KV pool must already be placed
    on it (sharding.rules.shard_params / shard_kv_pool); the steps are jitted with those shardings in
    and out (the pool donated), the inputs and the sampled tokens / logits replicated, and the kernels
    wrapped for the mesh (sharding.tensor_parallel.tensor_parallel_kernels).

    tuner: the StepTuner that lists each bucket's Kernels variants and picks one per step (default
    FixedTuner(kernels): one variant, the backend's kernels); its Kernels are unwrapped, the runner
    wraps them for the mesh. Set it before warm-up: each bucket's variants are asked once.

    On a multi-process mesh every process holds a Runner over the same mesh and runs the same jitted
    calls (../shared/DESIGN.md decision 6): process 0's runner sends each call (which step, the greedy
    flag, its StepInputs) through sharding.multihost.StepBroadcast before running it, and every other
    process runs `follow()`, which receives and repeats them until process 0's `stop_followers()`.
    The scheduler, the engine core and the servers run on process 0 alone and never know.
    """

    def __init__(self, model: Llama, kv_cache: KVCache, *, max_seqs: int, max_tokens_per_step: int,
                 table_width: int, backend: str = "auto", min_tokens: int = 8, kernels: Kernels | None = None,
                 mesh=None, max_logprobs: int = 0, tuner: StepTuner | None = None):
        self.graphdef, self.state = nnx.split(model)
        self.config = model.config
        self.kv_cache = kv_cache
        self.backend = backend
        # Resolved once, here: inside the trace no backend name is read and no device is asked.
        base = kernels or default_kernels(backend, head_dim=model.config.head_dim)
        self.mesh = mesh
        self.kernels = base if mesh is None else tensor_parallel_kernels(base, mesh)
        # Lists each bucket's variants (unwrapped: `variants` wraps them for the mesh) and picks one per step.
        self.tuner = tuner if tuner is not None else FixedTuner(base)
        self._variants: dict[tuple[bool, int], tuple[Kernels, ...]] = {}
        # Where dispatch puts the sampling arrays (None: the default device, as without a mesh).
        self._input_sharding = None if mesh is None else replicated(mesh)
        # Every call mirrored to the other processes (process 0) or received from process 0 (the others).
        self.broadcast = multihost.StepBroadcast() if mesh is not None and jax.process_count() > 1 else None
        self._last: InFlight | None = None  # the last step dispatched (a continuation's only possible source)
        self.min_tokens = min_tokens
        self.max_seqs = max_seqs
        self.max_tokens_per_step = max_tokens_per_step
        self.buckets = Buckets(max_seqs=max_seqs, max_tokens_per_step=max_tokens_per_step, table_width=table_width,
                               min_tokens=min_tokens)
        self.seq_cap = self.buckets.seq_cap
        self.table_width = table_width
        self.compile_count = 0
        self.xla_compiles = 0  # executables XLA compiled for this runner's steps (compile_cache.CompileEvents)
        self.persistent_cache_hits = 0  # ... and those read from the persistent compilation cache instead
        # Served steps (warm-up's not counted) per bucket, (decode, padded size) -> steps, and the padding
        # they carried: padded minus real tokens, summed.
        self.bucket_steps: dict[tuple[bool, int], int] = {}
        self.padding_tokens = 0
        if not 0 <= max_logprobs <= model.config.vocab_size:
            raise ValueError(f"max_logprobs {max_logprobs} must be in [0, {model.config.vocab_size}] (the vocabulary)")
        self.max_logprobs = max_logprobs  # top tokens the logprob variants return (0: never run)
        if compat.on_gpu():
            compat.silence_triton_deprecation()  # jax 0.11 warns on every Triton-lowered kernel it traces
        # The step functions take (state, kv_pool, inputs) with this runner's graphdef bound, not passed:
        # as a static argument it would be hashed on every call (~0.7 ms for a 32-layer model, a fifth of
        # a 1K-context decode step on an H100). The pool (argument 1) is donated: each step updates it in place.
        jit = functools.partial(jax.jit, donate_argnums=(1,))
        if mesh is not None:
            # State and pool as placed (out == in, so the donated pool is updated in place), inputs and
            # outputs whole on every device: process 0's tokens are every process's tokens.
            pool = jax.tree.map(lambda x: x.sharding, kv_cache)
            whole = replicated(mesh)
            jit = functools.partial(_jit_on_mesh, in_shardings=(jax.tree.map(lambda x: x.sharding, self.state), pool,
                                                                whole), out_shardings=(whole, pool))
        self.decode_step = jit(self._counted(decode_step), static_argnames=("kernels", "greedy", "logprobs"))
        self.prefill_step = jit(self._counted(prefill_step), static_argnames=("kernels", "logprobs"))
        self.logits_step = jit(self._counted(logits_step), static_argnames=("kernels",))

    def _counted(self, fn):
        """fn with this runner's graphdef bound, counting its traces (each a cache miss, hence a compile)
        in compile_count."""
        @functools.wraps(fn)
        def traced(*args, **kwargs):
            self.compile_count += 1
            return fn(self.graphdef, *args, **kwargs)
        return traced

    @property
    def block_size(self) -> int:
        return self.kv_cache.block_size

    def variants(self, decode: bool, padded_size: int) -> tuple[Kernels, ...]:
        """The tuner's variants of this bucket, wrapped for the mesh (memoised: asked once per bucket)."""
        key = (decode, padded_size)
        if key not in self._variants:
            listed = tuple(self.tuner.variants(decode, padded_size))
            if not listed:
                raise ValueError(f"the tuner lists no variant for the {'decode' if decode else 'prefill'} bucket "
                                 f"{padded_size}: it must list at least one (variants()[0] is the fallback)")
            self._variants[key] = listed if self.mesh is None else tuple(
                tensor_parallel_kernels(k, self.mesh) for k in listed)
        return self._variants[key]

    def kernels_for(self, decode: bool, padded_size: int, variant: int = 0) -> Kernels:
        """The kernels a step of this bucket runs (`padded_size`: sequences for decode, tokens for prefill):
        the bucket's variant number `variant` (0: the tuner's fallback)."""
        listed = self.variants(decode, padded_size)
        if not 0 <= variant < len(listed):
            raise ValueError(f"variant {variant} of the {'decode' if decode else 'prefill'} bucket {padded_size} "
                             f"does not exist: the tuner lists {len(listed)}")
        return listed[variant]

    def padded_sizes(self, decode: bool, size: int) -> tuple[int, int]:
        """(tokens, sequences) a step of `size` (sequences for decode, tokens for prefill) is padded to:
        Buckets.padded (ValueError past the largest bucket), so warm-up compiles exactly the shapes serving meets."""
        return self.buckets.padded(decode, size)

    def step_inputs(self, plan: StepPlan) -> StepInputs:
        """The plan padded to this runner's bucket for it (host arrays)."""
        self.padded_sizes(plan.is_decode, plan.num_seqs if plan.is_decode else plan.num_tokens)  # in a bucket
        return make_step_inputs(plan, min_tokens=self.min_tokens, seq_cap=self.seq_cap, table_width=self.table_width)

    def _choose(self, plan: StepPlan, inputs: StepInputs) -> int:
        """The tuner's variant for this step (host-side), counting the step in its bucket."""
        decode = plan.is_decode
        size = inputs.num_seqs if decode else inputs.num_tokens
        self.bucket_steps[(decode, size)] = self.bucket_steps.get((decode, size), 0) + 1
        self.padding_tokens += inputs.num_tokens - plan.num_tokens
        return int(self.tuner.choose(plan, decode, size))

    def run_step(self, decode: bool, inputs: StepInputs, *, greedy: bool = False, logprobs: bool = False,
                 variant: int = 0):
        """Run one jitted step on padded inputs, updating the KV pool; returns the sampled tokens
        [padded sequences] int32 on the device (not waited for). logprobs: run the logprob variant and
        return (tokens, (token logprob [S], top ids [S, max_logprobs], top logprobs [S, max_logprobs])).
        variant: which of the bucket's tuner variants runs it."""
        size = inputs.num_seqs if decode else inputs.num_tokens
        kernels = self.kernels_for(decode, size, variant)
        extra = {"logprobs": self.max_logprobs} if logprobs else {}  # absent: the plain variant, as before
        before = compile_events()
        if decode:
            tokens, self.kv_cache = self.decode_step(self.state, self.kv_cache, inputs,
                                                     kernels=kernels, greedy=greedy, **extra)
        else:
            tokens, self.kv_cache = self.prefill_step(self.state, self.kv_cache, inputs,
                                                      kernels=kernels, **extra)
        self._count_compiles(before)
        return tokens

    def _count_compiles(self, before) -> None:
        """Add the XLA compiles and persistent-cache reads since `before` (a compile happens inside the call
        that needs it, on this thread)."""
        delta = compile_events() - before
        self.xla_compiles += delta.xla_compiles
        self.persistent_cache_hits += delta.cache_hits

    # ----- public -----

    def dispatch(self, plan: StepPlan, *, token_source: InFlight | None = None) -> InFlight:
        """Start one step on the device and return at once, without waiting for its tokens.

        token_source: the in-flight (or finished) step this one continues (Scheduler.plan_continuation):
        a decode step of the same sequences in the same order. Its sampled-token array, still on the
        device, becomes this step's input tokens, so step N+1 is queued before step N's tokens reach the
        host. Both are decode steps of the same sequence count, hence the same padded size.
        """
        decode = plan.is_decode
        inputs = self.step_inputs(plan)
        variant = self._choose(plan, inputs)
        if token_source is not None:
            src = token_source.plan
            if not (decode and src.is_decode and np.array_equal(src.seq_ids, plan.seq_ids)):
                raise ValueError("token_source must be a decode step of the same sequences, in the same order, "
                                 f"as the step it feeds ({src.num_seqs} vs {plan.num_seqs} sequences)")
            if self.broadcast is not None:
                if token_source is not self._last:
                    raise ValueError("on a multi-process run a continuation must follow the step it continues: the "
                                     "other processes keep only their last step's tokens")
                self._announce(_DECODE, inputs, token_source.greedy, _CONTINUED, plan.wants_logprobs, variant)
            inputs = _continued(inputs, token_source)
            greedy = token_source.greedy
        else:
            if np.any(plan.token_ids < 0):
                raise ValueError("the plan's token ids are placeholders (a continuation step): pass token_source")
            # Padding rows are greedy, so "no row samples" is "every sequence is greedy".
            greedy = decode and not np.any(plan.temperature > 0)
            if self.broadcast is not None:
                self._announce(_DECODE if decode else _PREFILL, inputs, greedy, _FRESH, plan.wants_logprobs, variant)
            inputs = self._sampling_on_device(inputs)
        if plan.wants_logprobs:  # a continuation has its source's sequences: the same wishes
            next_tokens, logprobs = self.run_step(decode, inputs, greedy=greedy, logprobs=True, variant=variant)
            self._last = InFlight(plan, next_tokens, inputs, greedy, logprobs)
            return self._last
        next_tokens = self.run_step(decode, inputs, greedy=greedy, variant=variant)
        self._last = InFlight(plan, next_tokens, inputs, greedy)
        return self._last

    def _sampling_on_device(self, inputs: StepInputs) -> StepInputs:
        """On the device once, so the continuation steps that reuse them transfer nothing. On a mesh the token
        ids too: a continuation's tokens are the last step's output, committed to the mesh, and jit traces a
        committed argument and a host array of one shape apart, so every step passes them committed."""
        names = ("temperature", "top_k", "top_p", "seed") + (("tokens",) if self.mesh is not None else ())
        placed = jax.device_put(tuple(getattr(inputs, name) for name in names), self._input_sharding)
        return dataclasses.replace(inputs, **dict(zip(names, placed)))

    def step(self, plan: StepPlan) -> np.ndarray:
        """Run one step and wait for it; returns the sampled token of every sequence in the plan ([S] int32)."""
        return self.dispatch(plan).tokens()

    def logits(self, plan: StepPlan) -> np.ndarray:
        """Teacher-forced logits [T, vocab] (float32) of every token in a prefill plan."""
        inputs = self.step_inputs(plan)
        variant = self._choose(plan, inputs)
        if self.broadcast is not None:
            self._announce(_LOGITS, inputs, False, _AS_SENT, False, variant)
        return host_array(self._logits(inputs, variant))[:plan.num_tokens]

    def _logits(self, inputs: StepInputs, variant: int = 0) -> jax.Array:
        kernels = self.kernels_for(False, inputs.num_tokens, variant)
        before = compile_events()
        out, self.kv_cache = self.logits_step(self.state, self.kv_cache, inputs, kernels=kernels)
        self._count_compiles(before)
        return out

    def bucket_shapes(self) -> list[tuple[bool, int, bool, bool]]:
        """Every (decode, size, greedy, logprobs) a step can take: sequences for decode, tokens for prefill
        (Buckets.shapes); decode steps in both variants (greedy only, or with the sampler); every shape also
        in its logprob variant when max_logprobs > 0."""
        shapes = [(shape.decode, shape.size, greedy) for shape in self.buckets.shapes()
                  for greedy in ((False, True) if shape.decode else (False,))]
        return [shape + (logprobs,) for logprobs in ((False, True) if self.max_logprobs else (False,))
                for shape in shapes]

    def warm_up_plan(self) -> list[tuple[bool, int, bool, bool, int]]:
        """Every (decode, size, greedy, logprobs, variant) warm-up compiles, one compile each: bucket_shapes
        x the tuner's variants of each bucket. A variant equal to an earlier one of its bucket is the same
        jitted function (Kernels is the static argument), so it is listed once, at its first index."""
        plan = []
        for decode, size, greedy, logprobs in self.bucket_shapes():
            listed = self.variants(decode, size)
            plan += [(decode, size, greedy, logprobs, i) for i, k in enumerate(listed) if k not in listed[:i]]
        return plan

    def warm_up(self, progress: bool = True) -> None:
        """Compile every step shape x tuner variant now (warm_up_plan, its total said first), so serving
        compiles nothing new."""
        import sys

        from jaxllm.progress import Progress

        plan = self.warm_up_plan()
        if progress:
            buckets = len(self.buckets.decode_sizes), len(self.buckets.prefill_sizes)
            print(f"[jaxllm] warm-up: {len(plan)} step compiles ({buckets[0]} decode + {buckets[1]} prefill buckets"
                  f" x tuner variants x greedy/logprob variants)", file=sys.stderr, flush=True)
        with Progress(len(plan), "warm-up compiles", enabled=progress) as bar:
            for decode, size, greedy, logprobs, variant in plan:
                t_pad, s_pad = self.padded_sizes(decode, size)  # size is a bucket already: t_pad == size
                inputs = inert_step_inputs(decode, t_pad, s_pad, self.table_width)
                if self.broadcast is not None:
                    self._announce(_DECODE if decode else _PREFILL, inputs, greedy, _FRESH, logprobs, variant)
                # Sampling arrays placed as dispatch places them: on a mesh, host arrays and arrays committed to
                # the mesh are different arguments to jit, and serving would trace every step again.
                inputs = self._sampling_on_device(inputs)
                jax.block_until_ready(self.run_step(decode, inputs, greedy=greedy, logprobs=logprobs,
                                                    variant=variant))
                bar.update(1, detail=f"{'decode' if decode else 'prefill'} {size}{' greedy' if greedy else ''}"
                                     f"{' logprobs' if logprobs else ''}{f' variant {variant}' if variant else ''}")

    # ----- multi-process runs -----

    def _announce(self, op: int, inputs: StepInputs, greedy: bool, mode: int, logprobs: bool = False,
                  variant: int = 0) -> None:
        """Process 0: hand one call to every other process (their follow() runs it too, with the same
        tuner variant: every process must run the same program)."""
        self.broadcast.send({"call": np.array([op, greedy, mode, logprobs, variant], np.int32), "inputs": inputs})

    def follow(self) -> int:
        """Processes other than 0: run every call process 0 sends, as it runs them, until it stops;
        returns the number of calls run."""
        if self.broadcast is None or multihost.is_leader():
            raise ValueError("Runner.follow runs on the processes other than 0 of a multi-process run "
                             f"(this is process {jax.process_index()} of {jax.process_count()})")
        calls = 0
        while (message := self.broadcast.receive()) is not None:
            op, greedy, mode, logprobs, variant = (int(x) for x in message["call"])
            inputs = message["inputs"]
            if op == _LOGITS:
                self._logits(inputs, variant)
            else:
                if mode == _CONTINUED:
                    inputs = _continued(inputs, self._last)
                elif mode == _FRESH:
                    inputs = self._sampling_on_device(inputs)
                out = self.run_step(op == _DECODE, inputs, greedy=bool(greedy), logprobs=bool(logprobs),
                                    variant=variant)
                tokens = out[0] if logprobs else out  # the logprob variant also returns its (unread) arrays
                self._last = InFlight(None, tokens, inputs, bool(greedy))
            calls += 1
        self.broadcast = None
        return calls

    def stop_followers(self) -> None:
        """Process 0 at shutdown: the other processes' follow() returns (they exit). Idempotent; a no-op on
        one process."""
        if self.broadcast is not None and multihost.is_leader():
            self.broadcast.stop()
            self.broadcast = None


def _continued(inputs: StepInputs, source: InFlight) -> StepInputs:
    """A continuation step's inputs: the previous step's sampled tokens (still on the device) and its
    sampling arrays (same sequences, same order: same parameters, already on the device)."""
    prev = source.inputs
    return dataclasses.replace(inputs, tokens=source.device_tokens, temperature=prev.temperature, top_k=prev.top_k,
                               top_p=prev.top_p, seed=prev.seed)
