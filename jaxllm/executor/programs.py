"""The jitted programs of one engine over its mesh (one device being the 1 x 1 mesh), and their compile counters.

Each step function of step.py becomes one jitted program, jitted with the model's graphdef bound (not passed:
as a static argument it would be hashed on every call, ~0.7 ms for a 32-layer model), the KV pool and the
penalty state (jaxllm.executor.penalties) donated (updated in place: out sharding == in sharding) and its inputs
stacked on a leading instance axis [I, ...]:
  - one instance: the step runs on instance 0's rows, no shard_map;
  - several: the step runs per instance inside a `shard_map` manual over `instance` (the `tensor` axis stays
    with XLA; the tensor wrappers of sharding/ go manual over `tensor` only inside it), each instance on its
    own rows and its own pool and penalty-state shards. Inputs and outputs are split over `instance`, so a step
    in which nothing is borrowed moves nothing between devices: no collective, on one process or several (a
    mesh over processes takes the packed host inputs whole on every device, the sampling arrays split as placed
    by the worker, and process 0 reads the rows of the instances on other processes' devices from the results
    channel: sharding.step_results).
The recall copy (`copy_blocks`) moves rBlocks between instances' pools; `gather_blocks` and `scatter_blocks`
take a run of rBlocks out of the pool into a compact array and put one back (the host tier's copies:
jaxllm.executor.host_store), a run's length a power of two; on several instances the run (global ids, any
instance's rBlocks) is whole on every instance, each instance putting in the rows it holds (a psum) and writing
back the rows it holds. Every trace of a program is counted
(`compile_count`), and the XLA compiles and persistent-cache reads behind them (`xla_compiles`,
`persistent_cache_hits`).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxllm.executor.packed_inputs import pack, unpack
from jaxllm.executor.step import StepInputs, decode_step, logits_step, prefill_step, verify_step
from jaxllm.tuner.compile_cache import compile_events
from sharding.mesh import INSTANCE

__all__ = ["StepPrograms"]


def _jit_on_mesh(fn, *, static_argnames: tuple[str, ...], in_shardings, out_shardings, donate: tuple[int, ...]):
    """fn(*arrays, **statics) jitted with shardings and the arguments `donate` donated (a step's pool and penalty
    state), called as jax.jit's result is. jit takes no keyword arguments alongside in_shardings, so the static
    ones travel positionally (a keyword left out takes fn's default)."""
    defaults = {name: p.default for name, p in inspect.signature(fn).parameters.items() if name in static_argnames}
    first = len(in_shardings)

    def positional(*args):
        return fn(*args[:first], **dict(zip(static_argnames, args[first:])))

    jitted = jax.jit(positional, static_argnums=tuple(range(first, first + len(static_argnames))),
                     donate_argnums=donate, in_shardings=in_shardings, out_shardings=out_shardings)

    def call(*args, **statics):
        return jitted(*args, *(statics.get(name, defaults.get(name)) for name in static_argnames))

    def compiled(*args, **statics):
        """The XLA executable a call with these arguments runs (jax.ShapeDtypeStruct leaves allowed), compiled
        again: for its HLO text and memory analysis."""
        return jitted.lower(*args, *(statics.get(name, defaults.get(name)) for name in static_argnames)).compile()

    call.compiled = compiled
    return call


class StepPrograms:
    """The step programs of one engine (see the module docstring).

    graphdef: the model's (nnx.split); state, pool, penalty_state: placed on `mesh` already (their shardings are
    the programs'; penalty_state None: penalties off); instances: the mesh's instance axis (inputs and outputs are
    split over it, on every device of it where there is none).
    """

    def __init__(self, graphdef, state, pool, mesh, *, instances: int, penalty_state=None):
        self.graphdef = graphdef
        self.mesh = mesh
        self.instances = instances
        self.compile_count = 0
        self.xla_compiles = 0  # executables XLA compiled for these programs (compile_cache.CompileEvents)
        self.persistent_cache_hits = 0  # ... and those read from the persistent compilation cache instead
        self.io_sharding = NamedSharding(mesh, P(INSTANCE) if instances > 1 else P())
        # The host inputs a step takes as they are (the packed integers, a borrowed step's DistParts) go in whole to
        # every device of a mesh over processes (each program's first op then slices its instance's rows, on the
        # device): jit takes no host array for a split over processes, and placing one by hand (multihost.put)
        # cost the launch thread ~0.3 ms a step more than jit's own copy.
        host = NamedSharding(mesh, P()) if not self.io_sharding.is_fully_addressable else self.io_sharding
        io = StepInputs(**{f.name: self.io_sharding for f in dataclasses.fields(StepInputs)})
        self._input_shardings = dataclasses.replace(io, packed=host, parts=host)
        self.pool_shardings = jax.tree.map(lambda x: x.sharding, pool)
        penalty_shardings = jax.tree.map(lambda x: x.sharding, penalty_state)
        # The state travels as its flat list of leaves: flattening an nnx State (a Python call per Variable, ~200
        # for a 32-layer model) on every step costs host time a step cannot spare; the program rebuilds it.
        leaves, self.state_treedef = jax.tree.flatten(state)
        shardings = ([x.sharding for x in leaves], self.pool_shardings, self._input_shardings, penalty_shardings)
        jit = functools.partial(_jit_on_mesh, in_shardings=shardings, donate=(1, 3),
                                out_shardings=(self.io_sharding, self.pool_shardings, penalty_shardings))
        self._decode = jit(self._per_instance(decode_step), static_argnames=("kernels", "greedy", "logprobs"))
        self._prefill = jit(self._per_instance(prefill_step), static_argnames=("kernels", "logprobs"))
        self._verify = jit(self._per_instance(verify_step), static_argnames=("kernels", "greedy", "logprobs"))
        self._logits = jit(self._per_instance(logits_step), static_argnames=("kernels",))
        self._copy = None if instances == 1 else _jit_on_mesh(
            self._counted(self._copy_local), static_argnames=(),
            in_shardings=(self.pool_shardings, NamedSharding(mesh, P()), NamedSharding(mesh, P())),
            out_shardings=self.pool_shardings, donate=(0,))
        ids = NamedSharding(mesh, P())
        # A run of rBlocks: the pool's layout without the instance split (whole on every instance).
        self.run_shardings = self.pool_shardings if instances == 1 else jax.tree.map(
            lambda s: NamedSharding(mesh, P(None, *s.spec[1:])), self.pool_shardings)
        gather, scatter = (_gather_rows, _scatter_rows) if instances == 1 else (self._gather_across,
                                                                                self._scatter_across)
        self._gather = _jit_on_mesh(self._counted(gather), static_argnames=(),
                                    in_shardings=(self.pool_shardings, ids), out_shardings=self.run_shardings,
                                    donate=())
        self._scatter = _jit_on_mesh(self._counted(scatter), static_argnames=(),
                                     in_shardings=(self.pool_shardings, self.run_shardings, ids),
                                     out_shardings=self.pool_shardings, donate=(0,))

    # ----- the steps -----

    @property
    def _programs(self) -> dict:
        return {"decode": self._decode, "prefill": self._prefill, "verify": self._verify, "logits": self._logits}

    def _counted(self, fn):
        """fn, counting its traces (each a cache miss, hence a compile) in compile_count."""
        @functools.wraps(fn)
        def traced(*args, **kwargs):
            self.compile_count += 1
            return fn(*args, **kwargs)
        return traced

    def _per_instance(self, fn):
        """fn (a step function of step.py) with the graphdef bound, on inputs [I, ...] -> outputs [I, ...]; the pool
        and the penalty state go in and come back."""
        graphdef, mesh, treedef = self.graphdef, self.mesh, self.state_treedef

        def local(state_leaves, pool, inputs, penalty_state, **statics):
            state = jax.tree.unflatten(treedef, state_leaves)
            inputs = jax.tree.map(lambda x: x[0], unpack(inputs))
            out, pool, penalty_state = fn(graphdef, state, pool, inputs, penalty_state, **statics)
            return jax.tree.map(lambda x: x[None], out), pool, penalty_state

        if self.instances == 1:
            return self._counted(functools.wraps(fn)(local))

        def per_instance(state, pool, inputs, penalty_state, **statics):
            split = P(INSTANCE)
            return jax.shard_map(functools.partial(local, **statics), mesh=mesh, in_specs=(P(), split, split, split),
                                 out_specs=(split, split, split), axis_names={INSTANCE},
                                 check_vma=False)(state, pool, inputs, penalty_state)

        return self._counted(functools.wraps(fn)(per_instance))

    def run(self, op: str, state_leaves: list, pool, inputs: StepInputs, penalty_state, **statics):
        """Run program `op` ("decode", "prefill", "verify" or "logits") on the state's leaves (jax.tree.leaves of the state
        the programs were built for) with its statics (kernels, greedy, logprobs); returns (outputs [I, ...],
        pool, penalty state). The inputs' integer host arrays travel packed in one array a step
        (jaxllm.executor.packed_inputs). Counts the XLA compiles behind the call."""
        program = self._programs[op]
        before = compile_events()
        out = program(state_leaves, pool, pack(inputs), penalty_state, **statics)
        self._count(before)
        return out

    def compiled(self, op: str, state_leaves: list, pool, inputs: StepInputs, penalty_state, **statics):
        """The executable of program `op` for these arguments, as `run` would call it, lowered and compiled again
        (runs nothing): its `as_text()` is XLA's optimized HLO (profiling scripts: which collectives and copies the
        partitioner put in), its `memory_analysis()` the device memory it needs. The pool may be abstract
        (jax.ShapeDtypeStruct leaves with their shardings): memory planning compiles before a pool exists."""
        program = self._programs[op]
        return program.compiled(state_leaves, pool, pack(inputs), penalty_state, **statics)

    def _count(self, before) -> None:
        """Add the XLA compiles and persistent-cache reads since `before` (a compile happens inside the call
        that needs it, on this thread)."""
        delta = compile_events() - before
        self.xla_compiles += delta.xla_compiles
        self.persistent_cache_hits += delta.cache_hits

    # ----- recalls -----

    def copy_blocks(self, pool, src: np.ndarray, dst: np.ndarray):
        """The pool with rBlocks src[m] copied to dst[m] (global ids; -1: padding), across instances; every
        read before any write, so a swap is two copies."""
        if self._copy is None:
            raise ValueError("rBlock copies move KV between instances; this engine has one")
        before = compile_events()
        pool = self._copy(pool, src, dst)
        self._count(before)
        return pool

    # ----- the host tier's runs -----

    def gather_blocks(self, pool, blocks: np.ndarray):
        """rBlocks `blocks` [R] int32 (global ids) of the pool as a compact run (the pool's pytree, [R, ...] leaves,
        whole on every instance); the pool is read, not donated (device work runs in dispatch order: a later
        step's writes land after this read)."""
        before = compile_events()
        run = self._gather(pool, blocks)
        self._count(before)
        return run

    def scatter_blocks(self, pool, run, blocks: np.ndarray):
        """The pool (donated) with run's rows written into rBlocks `blocks` [R] int32 (-1: the row is skipped)."""
        before = compile_events()
        pool = self._scatter(pool, run, blocks)
        self._count(before)
        return pool

    def _gather_across(self, pool, blocks):
        nb = jax.tree.leaves(pool)[0].shape[0] // self.instances

        def local(pool, blocks):
            me = jax.lax.axis_index(INSTANCE)
            mine = (blocks >= 0) & (blocks // nb == me)

            def take(x):
                taken = jnp.where(mine.reshape((-1,) + (1,) * (x.ndim - 1)), x[jnp.where(mine, blocks % nb, 0)], 0)
                # float32 whatever the pool's dtype, as in _copy_local (exact: one instance puts in each row).
                return jax.lax.psum(taken.astype(jnp.float32), INSTANCE).astype(x.dtype)

            return jax.tree.map(take, pool)

        return jax.shard_map(local, mesh=self.mesh, in_specs=(P(INSTANCE), P()), out_specs=P(),
                             axis_names={INSTANCE}, check_vma=False)(pool, blocks)

    def _scatter_across(self, pool, run, blocks):
        nb = jax.tree.leaves(pool)[0].shape[0] // self.instances

        def local(pool, run, blocks):
            me = jax.lax.axis_index(INSTANCE)
            target = jnp.where((blocks >= 0) & (blocks // nb == me), blocks % nb, nb)  # out of range: dropped
            return jax.tree.map(lambda x, r: x.at[target].set(r, mode="drop"), pool, run)

        return jax.shard_map(local, mesh=self.mesh, in_specs=(P(INSTANCE), P(), P()), out_specs=P(INSTANCE),
                             axis_names={INSTANCE}, check_vma=False)(pool, run, blocks)

    def _copy_local(self, pool, src, dst):
        nb = jax.tree.leaves(pool)[0].shape[0] // self.instances

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


def _gather_rows(pool, blocks):
    return jax.tree.map(lambda x: x[blocks], pool)


def _scatter_rows(pool, run, blocks):
    n = jax.tree.leaves(pool)[0].shape[0]
    target = jnp.where(blocks >= 0, blocks, n)  # out of range: dropped (a negative index would wrap around)
    return jax.tree.map(lambda x, r: x.at[target].set(r, mode="drop"), pool, run)
