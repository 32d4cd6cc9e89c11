"""The one place that builds an engine: `build_engine(EngineConfig) -> BuiltEngine`.

It assembles the parts in the order each needs the last (docs/ARCHITECTURE.md, "Who builds what"): the persistent
compile cache, the mesh, the model and its placement on the mesh, the tokenizer and the checkpoint's generation
defaults, the context limit, the memory plan (the pool's rBlocks: jaxllm.memory_plan, through a probe executor over
an abstract pool) and the host tier's, the tuner, the executor, the scheduler (one instance's, or the instance set),
the request limits and the core. `LLM`, the servers (`python -m jaxllm.serve`), `python -m jaxllm.generate` and a
follower process all call it; none assembles anything itself.
"""

from __future__ import annotations

import dataclasses
import functools
import sys

import jax
import jax.numpy as jnp
from flax import nnx

from jaxllm.device_memory import device_free_bytes
from jaxllm.engine.allocator import BlockAllocator
from jaxllm.engine.core import EngineCore, EngineInfo
from jaxllm.engine.host_tier import HostTier
from jaxllm.engine.instances import InstanceSchedulers
from jaxllm.engine.requests import RequestLimits
from jaxllm.engine.scheduler import Scheduler
from jaxllm.engine.scheduling import StepScheduler
from jaxllm.engine.speculative import DraftModelProposer, NgramProposer, Proposer, Speculation
from jaxllm.engine_config import EngineConfig, EngineOptions
from jaxllm.executor.executor import build_executor
from jaxllm.executor.model_runner import ModelRunner
from jaxllm.memory_plan import MemoryPlan, host_tier_blocks, pool_blocks
from jaxllm.model.checkpoints import load_model
from jaxllm.model.config import LlamaConfig
from jaxllm.model.generation_config import GenerationDefaults, load_generation_defaults
from jaxllm.model.kv_cache import init_kv_cache, kv_bytes_per_block, kv_dtype
from jaxllm.model.llama import Llama, abstract_model
from jaxllm.model.tokenizer_files import load_tokenizer
from jaxllm.tuner.compile_cache import enable_persistent_cache, resolve_cache_dir
from jaxllm.tuner.fixed import FixedTuner
from jaxllm.tuner.protocol import StepTuner
from pallas_kernels import compat
from pallas_kernels.dispatch import Kernels, default_kernels
from sharding.mesh import check_tensor_parallel, instance_hosts, make_mesh
from sharding.rules import abstract_kv_pool, kv_pool_shardings, load_sharding, prepare_tensor_parallel, shard_params
from sharding.xla_flags import warn_without_tensor_parallel_flags

__all__ = ["BuiltEngine", "build_engine"]


@dataclasses.dataclass(frozen=True, eq=False)
class BuiltEngine:
    """One engine's parts, built and wired (build_engine). Front ends drive `core` (process 0) or `follow()` (the
    other processes of a multi-process run) and read the rest.

    model_config: the checkpoint's (KV heads as trained, whatever the mesh; `model.config` is the placed model's).
    max_context: the longest sequence accepted (EngineConfig.max_context, resolved against the window).
    num_blocks: rBlocks of every instance's pool together; host_blocks: each instance's host tier (0: none).
    memory_plan: how the pool was planned (GPU with the default options), else None.
    draft: the draft model's own engine (EngineOptions.speculative_model), else None.
    compile_cache_dir: the persistent compilation cache in use, else None.
    """

    config: EngineConfig
    model_config: LlamaConfig
    model: Llama
    mesh: jax.sharding.Mesh
    tokenizer: object
    generation_defaults: GenerationDefaults
    max_context: int
    pool_dtype: str
    num_blocks: int
    host_blocks: int
    memory_plan: MemoryPlan | None
    compile_cache_dir: str | None
    executor: ModelRunner
    scheduler: StepScheduler
    limits: RequestLimits
    core: EngineCore
    draft: "BuiltEngine | None" = None

    @property
    def options(self) -> EngineOptions:
        return self.config.options

    @property
    def compile_count(self) -> int:
        """Step functions compiled so far, the draft model's included (the metric that must stay flat after
        warm-up)."""
        return self.executor.compile_count + (self.draft.compile_count if self.draft is not None else 0)

    def info(self) -> EngineInfo:
        """A frozen description of the loaded model and engine."""
        cfg, options = self.model_config, self.options
        return EngineInfo(
            model=self.config.model, architecture=cfg.name, dtype=jnp.dtype(self.model.embedding[...].dtype).name,
            kv_dtype=self.pool_dtype, context_limit=self.limits.context_limit, vocab_size=cfg.vocab_size,
            num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, num_heads=cfg.num_heads,
            num_kv_heads=cfg.num_kv_heads, block_size=self.executor.block_size, num_blocks=self.num_blocks,
            max_seqs=self.scheduler.max_seqs, max_tokens_per_step=self.scheduler.max_tokens_per_step,
            tensor_parallel=options.tensor_parallel, instances=options.instances, processes=jax.process_count(),
            devices=self.mesh.devices.size, max_logprobs=self.limits.max_logprobs)

    def warm_up(self, progress: bool = True) -> None:
        """Compile every step shape up front (servers do this before reporting ready; followers compile as process
        0's warm-up calls reach them)."""
        if self.draft is not None:
            self.draft.warm_up(progress=progress)
        self.executor.warm_up(progress=progress)

    def follow(self) -> int:
        """A process other than 0 of a multi-process run: run every step process 0 sends, on this process's
        devices, until process 0 closes; returns the number of calls run. ValueError on process 0 or on one
        process."""
        return self.executor.worker.follow()

    def close(self) -> None:
        """Process 0 at the end of a multi-process run: the other processes stop following and exit. Idempotent;
        nothing to do on one process."""
        self.executor.worker.stop_followers()


def build_engine(config: EngineConfig, *, progress: bool = True, proposer: Proposer | None = None) -> BuiltEngine:
    """Build every part of the engine `config` describes (see the module docstring); ValueError for a model, an
    option or a mesh this run cannot serve, MemoryError where no pool fits. proposer: speculative decoding's draft
    source in place of the one EngineOptions.speculative names (benchmarks' and tests' own), drafting up to
    EngineOptions.num_speculative_tokens tokens a step."""
    options = config.options
    proposer = _proposer(options, proposer)
    cache_dir = resolve_cache_dir(options.compile_cache_dir)
    # Before anything compiles, so loading's small programs are cached too.
    compile_cache_dir = enable_persistent_cache(cache_dir) if cache_dir is not None else None
    tp, instances = options.tensor_parallel, options.instances
    # Every engine runs on a mesh of instances x tensor devices; one device is the 1 x 1 mesh, whose model and pool
    # load onto that device as they are (nothing to shard).
    mesh = make_mesh(tp, instances)
    if compat.on_gpu():
        warn_without_tensor_parallel_flags(tp, host_tier=bool(options.host_kv_bytes))
    sharded = tp * instances > 1 or jax.process_count() > 1
    if jax.process_count() > 1 and tp * instances != jax.device_count():
        # Every process runs every step; one whose devices the mesh left out could take no part.
        raise ValueError(f"a {jax.process_count()}-process run needs the mesh to span all {jax.device_count()} "
                         f"devices; tensor_parallel {tp} x instances {instances} = {tp * instances}")
    model, tokenizer_dir = load_model(config.model, dtype=config.dtype, progress=progress,
                                      sharding=functools.partial(load_sharding, mesh=mesh) if sharded else None)
    model_config = model.config
    step_model = _placed_model(model, mesh, tp) if sharded else model  # its config has the KV heads the mesh needs
    max_context = _max_context(config, model_config)

    on_gpu = jax.default_backend() == "gpu"
    block_size = options.block_size or (256 if on_gpu else 16)
    pool_dtype = jnp.dtype(kv_dtype(options.kv_dtype or jnp.dtype(model.embedding[...].dtype).name)).name
    max_step = options.max_tokens_per_step or (4096 if on_gpu else 512)
    draft = None
    if options.speculative_model is not None:
        # Before the memory plan, so the target's pool is planned in what the draft leaves.
        draft = _draft_engine(config, max_context, block_size, max_step, progress)
        proposer = DraftModelProposer(draft.core, vocab_size=model_config.vocab_size)
    base = default_kernels(options.attention_backend, head_dim=step_model.config.head_dim)
    per_block = kv_bytes_per_block(step_model.config, block_size, pool_dtype)
    host_blocks = host_tier_blocks(options.host_kv_bytes or 0, per_block, instances)
    reach = instances if options.lending else 1  # pools one sequence may fill (the whole mesh's when lending)

    def executor(num_blocks: int, tuner: StepTuner | None, host_tier: int, *, abstract: bool = False) -> ModelRunner:
        pool = _kv_pool(mesh, step_model.config, num_blocks * instances, block_size, kv_dtype(pool_dtype),
                        abstract=abstract)
        longest = min(max_context + 1, num_blocks * reach * block_size)  # the table holds the longest sequence
        return build_executor(step_model, pool, max_seqs=options.max_seqs, max_tokens_per_step=max_step,
                        table_width=-(-longest // block_size), kernels=base, mesh=mesh, instances=instances,
                        borrowing=options.lending and instances > 1, max_logprobs=options.max_logprobs, tuner=tuner,
                        penalties=options.penalties, max_logit_bias=options.max_logit_bias, host_tier=host_tier,
                        verify_queries=options.speculative_tokens + 1 if proposer is not None else 0)

    memory_plan = None
    num_blocks = options.num_blocks
    if num_blocks is None:
        free = device_free_bytes([d for d in mesh.devices.flat if d.process_index == jax.process_index()])
        # A tensor-parallel device holds 1 / tensor_parallel of every rBlock (its KV heads).
        num_blocks, memory_plan = pool_blocks(
            per_block=per_block // tp, free=free, max_context=max_context, block_size=block_size,
            kv_memory_fraction=options.kv_memory_fraction, host_tier=bool(host_blocks), progress=progress,
            step_memory=lambda blocks: executor(blocks, None, 0, abstract=True).step_memory())
    tuner = _tuner(options, base, step_model.config, pool_dtype, block_size, max_context, progress)
    runner = executor(num_blocks, tuner, host_blocks)
    scheduler = _scheduler(options, mesh, num_blocks, block_size, max_step, host_blocks, proposer)
    # The one RequestLimits: the core checks against it, and every front end reads it from there.
    limits = RequestLimits(context_limit=min(max_context, num_blocks * reach * block_size),
                           vocab_size=model_config.vocab_size, max_logprobs=options.max_logprobs,
                           default_max_tokens=options.default_max_tokens, max_stop_strings=options.max_stop_strings,
                           max_stop_length=options.max_stop_length, penalties=options.penalties,
                           max_logit_bias=options.max_logit_bias,
                           max_speculative_tokens=options.speculative_tokens if proposer is not None else 0)
    tokenizer = load_tokenizer(tokenizer_dir)
    if draft is not None and draft.tokenizer.vocab_size != tokenizer.vocab_size:
        raise ValueError(f"speculative_model {options.speculative_model!r} has a tokenizer of "
                         f"{draft.tokenizer.vocab_size} tokens, the model {config.model!r} one of "
                         f"{tokenizer.vocab_size}: a draft model must share the target's tokenizer")
    core = EngineCore(scheduler, runner, tokenizer, limits, pipeline=options.pipeline)
    return BuiltEngine(config=config, model_config=model_config, model=step_model, mesh=mesh, tokenizer=tokenizer,
                       generation_defaults=load_generation_defaults(tokenizer_dir), max_context=max_context,
                       pool_dtype=pool_dtype, num_blocks=num_blocks * instances, host_blocks=host_blocks,
                       memory_plan=memory_plan, compile_cache_dir=compile_cache_dir, executor=runner,
                       scheduler=scheduler, limits=limits, core=core, draft=draft)


def _draft_engine(config: EngineConfig, max_context: int, block_size: int, max_step: int,
                  progress: bool) -> BuiltEngine:
    """The draft model's engine (EngineOptions.speculative_model): one device (the mesh's first), the target's
    context limit, rBlock size and step budget, a pool of draft_pool_seqs sequences of max_context, greedy only
    (no penalties, no logprobs, no speculation of its own)."""
    options = config.options
    if jax.process_count() > 1:
        raise ValueError(f"speculative_model {options.speculative_model!r} runs in one process; this run has "
                         f"{jax.process_count()} (use speculative 'ngram:K' there)")
    per_seq = -(-(max_context + 1) // block_size)
    draft_options = EngineOptions(
        block_size=block_size, num_blocks=options.draft_pool_seqs * per_seq, max_seqs=options.draft_pool_seqs,
        max_tokens_per_step=max_step, attention_backend=options.attention_backend, tuner=options.tuner,
        compile_cache_dir=options.compile_cache_dir, penalties=False, max_logit_bias=0, pipeline=options.pipeline)
    draft_config = EngineConfig(model=options.speculative_model, dtype=config.dtype, max_context=max_context,
                                allow_long_context=config.allow_long_context, options=draft_options)
    if progress:
        print(f"[jaxllm] draft model {options.speculative_model!r}: {draft_options.num_blocks} rBlocks of "
              f"{block_size} tokens ({options.draft_pool_seqs} sequences of {max_context})", file=sys.stderr,
              flush=True)
    try:
        return build_engine(draft_config, progress=progress)
    except ValueError as err:
        raise ValueError(f"speculative_model {options.speculative_model!r}: {err}") from err


def _max_context(config: EngineConfig, model_config: LlamaConfig) -> int:
    """EngineConfig.max_context against the checkpoint's window (its default)."""
    window = model_config.max_context
    if config.max_context is None:
        return window
    if config.max_context > window and not config.allow_long_context:
        # Refused, not clamped: a silent clamp would change what the caller asked for, and going past the window
        # both allocates for it and runs positions the model never saw.
        raise ValueError(f"max_context {config.max_context} is over the model's context window of {window} tokens "
                         f"({model_config.describe_max_context()}): use at most {window}, or allow_long_context "
                         f"(--allow-long-context) to run positions the model was not trained on")
    return config.max_context


def _placed_model(model: Llama, mesh, tp: int) -> Llama:
    """The loaded model ready for the mesh: KV heads replicated where the tensor axis exceeds them (the step
    model's graphdef is built from that config), every Param in its shards."""
    check_tensor_parallel(model.config, tp)
    graphdef, state = nnx.split(model)
    config, state = prepare_tensor_parallel(model.config, state, tp)
    if config != model.config:
        graphdef = nnx.graphdef(abstract_model(config, dtype=model.embedding[...].dtype))
    return nnx.merge(graphdef, shard_params(state, mesh))


def _kv_pool(mesh, config: LlamaConfig, num_blocks: int, block_size: int, dtype, *, abstract: bool = False):
    """The zeroed KV pool, created in its shards on a mesh (never whole on one device); abstract: its shapes,
    dtypes and shardings only (jax.ShapeDtypeStruct leaves; nothing allocated)."""
    make = functools.partial(init_kv_cache, config, num_blocks, block_size, dtype)
    if abstract:
        return abstract_kv_pool(jax.eval_shape(make), mesh)
    if mesh.devices.size == 1 and jax.process_count() == 1:
        return make()
    return jax.jit(make, out_shardings=kv_pool_shardings(jax.eval_shape(make), mesh))()


def _tuner(options: EngineOptions, base: Kernels, config: LlamaConfig, pool_dtype: str, block_size: int,
           max_context: int, progress: bool) -> StepTuner:
    """The StepTuner EngineOptions.tuner names, over the backend's default kernels `base`."""
    if options.tuner == "fixed":
        return FixedTuner(base)
    from jaxllm.tuner import load_tuner  # tunerml's: FixedTuner(base) where no model was trained

    device_kind = jax.devices()[0].device_kind
    tuner = load_tuner(base, device_kind=device_kind, config=config, kv_dtype=pool_dtype, block_size=block_size,
                       tensor_parallel=options.tensor_parallel, max_context=max_context)
    if isinstance(tuner, FixedTuner) and progress:
        print(f"[jaxllm] tuner: every step runs the default kernels on {device_kind!r}: {tuner.reason}",
              file=sys.stderr, flush=True)
    return tuner


def _proposer(options: EngineOptions, given: Proposer | None) -> Proposer | None:
    """Speculative decoding's draft source: the one given, else the one EngineOptions.speculative names; None: off.
    ValueError where a k has no source or a source no k."""
    if given is not None:
        if not isinstance(given, Proposer):
            raise TypeError(f"proposer must implement jaxllm.engine.speculative.Proposer, got {type(given).__name__}")
        if options.speculative is not None or options.num_speculative_tokens is None:
            raise ValueError("a proposer handed to the builder drafts EngineOptions.num_speculative_tokens tokens a "
                             "step, with EngineOptions.speculative unset")
        return given
    if options.speculative is not None:
        return NgramProposer()
    if options.num_speculative_tokens is not None and options.speculative_model is None:
        raise ValueError(f"num_speculative_tokens {options.num_speculative_tokens} needs a draft source: "
                         "EngineOptions.speculative ('ngram') or a proposer handed to the builder")
    return None


def _scheduler(options: EngineOptions, mesh, num_blocks: int, block_size: int, max_step: int,
               host_blocks: int, proposer: Proposer | None) -> StepScheduler:
    """One instance's Scheduler, or the InstanceSchedulers of several (num_blocks rBlocks each)."""
    k = options.speculative_tokens
    if options.instances > 1:
        return InstanceSchedulers(options.instances, num_blocks, block_size, max_tokens_per_step=max_step,
                                  max_seqs=options.max_seqs, lending=options.lending,
                                  prefix_caching=options.prefix_caching, hosts=instance_hosts(mesh),
                                  host_blocks=host_blocks, proposer=proposer, speculative_tokens=k,
                                  spread_prompts=options.spread_prompts)
    host = HostTier(host_blocks) if host_blocks else None
    # The device prefix cache spills what it evicts to the host tier (kept there, least recently spilled evicted
    # first); a sequence swapped out keeps its slots until it resumes.
    allocator = BlockAllocator(num_blocks, on_evict=None if host is None else host.spill)
    return Scheduler(allocator, block_size, max_tokens_per_step=max_step, max_seqs=options.max_seqs,
                     prefix_caching=options.prefix_caching, host_tier=host,
                     speculation=None if proposer is None else Speculation(proposer, k))
