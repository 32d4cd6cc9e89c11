"""The Python generate API: `LLM(model).generate(...)`, `.stream(...)`, `.logits(...)`."""

from __future__ import annotations

import dataclasses
import functools
import sys
import time
from typing import Callable, Iterable, Iterator, Sequence as Seq

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxllm.device_memory import device_free_bytes
from jaxllm.engine.allocator import BlockAllocator
from jaxllm.engine.host_tier import HostTier
from jaxllm.engine.core import EngineCore, EngineInfo, Request, RequestOutput
from jaxllm.engine.instances import InstanceSchedulers
from jaxllm.engine.requests import RequestLimits, prompt_token_ids, sampling_params
from jaxllm.engine.scheduler import Scheduler
from jaxllm.executor.executor import Executor
from jaxllm.executor.host_store import MAX_COPY_BYTES as HOST_COPY_BYTES
from jaxllm.model.kv_cache import init_kv_cache, kv_bytes_per_block, kv_dtype
from jaxllm.model.tokenizer import load_tokenizer
from jaxllm.model.chat import chat_prompt
from jaxllm.model.checkpoints import load_model
from jaxllm.model.generation_config import load_generation_defaults
from jaxllm.model.llama import abstract_model
from jaxllm.tuner.compile_cache import enable_persistent_cache, resolve_cache_dir
from jaxllm.tuner.fixed import FixedTuner
from pallas_kernels import compat
from pallas_kernels.dispatch import BACKENDS, default_kernels
from sharding.mesh import check_tensor_parallel, instance_hosts, make_mesh
from sharding.rules import abstract_kv_pool, kv_pool_shardings, load_sharding, prepare_tensor_parallel, shard_params
from sharding.xla_flags import warn_without_tensor_parallel_flags

TUNERS = ("auto", "fixed")
_CPU_KV_BYTES = 1 << 30  # pool cap on a CPU host, where memory is shared with everything else
# Kept free beside the pool and the largest step's needs (a planned pool, GPU): the allocator's fragmentation, the
# step inputs, the penalty state (allocated after the plan: 41 MB a device for a 32K vocabulary), recall copies, the
# compiled programs' code.
_MEMORY_MARGIN_FRACTION = 0.03
_MEMORY_MARGIN_MIN = 1 << 30


def _blocks_in(budget: int, per_block: int) -> int:
    """rBlocks of per_block bytes in budget bytes (MemoryError below one)."""
    if budget < per_block:
        raise MemoryError(f"no room for a KV pool: one rBlock needs {per_block} bytes a device, {max(budget, 0)} are "
                          f"left for it")
    return budget // per_block


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """How a planned pool was sized (one device's bytes): the free memory after the weights, what each of the
    largest step programs needs while it runs (Executor.step_memory), the margin kept, and the pool's budget."""

    free_bytes: int
    step_bytes: dict[str, int]
    margin_bytes: int
    pool_bytes: int

    def describe(self) -> str:
        largest = max(self.step_bytes, key=self.step_bytes.get)
        return (f"{self.free_bytes / 2**30:.2f} GiB free a device; the largest step ({largest}) needs "
                f"{self.step_bytes[largest] / 2**30:.2f} GiB, margin {self.margin_bytes / 2**30:.2f} GiB: "
                f"{self.pool_bytes / 2**30:.2f} GiB for the KV pool")


def plan_memory(free: int, step_bytes: dict[str, int], *, host_tier: bool = False) -> MemoryPlan:
    """The pool's share of `free` bytes (a device's, after the weights) beside the largest of the step programs'
    needs (`step_bytes`, Executor.step_memory) and the margin: _MEMORY_MARGIN_FRACTION of free, at least
    _MEMORY_MARGIN_MIN, plus the host tier's runs in flight (each way) where it is on."""
    margin = max(_MEMORY_MARGIN_MIN, int(free * _MEMORY_MARGIN_FRACTION)) + (2 * HOST_COPY_BYTES if host_tier else 0)
    largest = max(step_bytes.values(), default=0)
    return MemoryPlan(free_bytes=free, step_bytes=dict(step_bytes), margin_bytes=margin,
                      pool_bytes=max(free - largest - margin, 0))


@dataclasses.dataclass(frozen=True)
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS or a stop string), "length" (max_new_tokens or context limit)
    # None unless generate(logprobs=k): per token id, (its logprob, ((id, logprob), ...) the k most likely).
    logprobs: list[tuple[float, tuple[tuple[int, float], ...]]] | None = None
    # None unless generate(prompt_logprobs=k): per prompt token, None for the first, then the same given the
    # tokens before it.
    prompt_logprobs: list[tuple[float, tuple[tuple[int, float], ...]] | None] | None = None


@dataclasses.dataclass(frozen=True)
class EngineOptions:
    """KV pool and batching limits; defaults suit the device found at start-up."""

    kv_dtype: str | None = None  # default: the model's dtype
    block_size: int | None = None  # tokens per rBlock
    num_blocks: int | None = None  # rBlocks per layer; default: planned (GPU), see kv_memory_fraction
    # GPU: the pool takes this fraction of the device memory left after the weights. None (the default): planned,
    # the memory left after the weights less what the largest step programs need while they run (XLA's memory
    # analysis of them) and a margin, so admitted steps never run out of memory (LLM.memory_plan says how).
    kv_memory_fraction: float | None = None
    max_tokens_per_step: int | None = None
    max_seqs: int = 256
    attention_backend: str = "auto"
    # Queue the next decode step before reading this one's tokens, so host dispatch overlaps device
    # work; the tokens are the same either way. False waits for every step (for A/B timing).
    pipeline: bool = True
    # Reuse the KV of full rBlocks of identical prompt prefixes (shared system prompts, resumed
    # preemptions). Greedy tokens are the same either way up to rounding: cached KV was computed in
    # another step, whose batch shape may round the matmuls differently.
    prefix_caching: bool = True
    # The mesh (docs/ARCHITECTURE.md, decision 7): the model split tensor_parallel ways (KV-head groups,
    # MLP columns), times `instances` (the instance axis: serving instances with a scheduler and an rBlock
    # pool each, num_blocks rBlocks apiece, running their own rows side by side in every step; requests go
    # to the least-loaded). 1 x 1 in one process: one device, no mesh at all.
    tensor_parallel: int = 1
    instances: int = 1
    # Instances lend each other rBlocks (DistKV-LLM): a sequence longer than one instance's pool borrows
    # from the others and its attention runs where its KV lives (DistAttention). False: each instance lives
    # within its own pool (preempting or queueing), for comparison.
    lending: bool = True
    # Top tokens a request may ask log-probabilities of (SamplingParams.logprobs); 0: none, and no
    # logprob step variants are compiled.
    max_logprobs: int = 0
    # frequency / presence / repetition penalties and logit_bias (vLLM's semantics: jaxllm.contract.sampling_params).
    # On, each instance keeps max_seqs rows of penalty state on the device, 5 bytes a vocabulary entry (41 MB
    # for a 32K vocabulary at max_seqs 256, 164 MB for 128K: jaxllm.executor.penalties); sampling steps read
    # their rows, greedy steps without penalties do not. False: no state, and requests using any of the four
    # are refused. max_logit_bias: logit_bias entries one request may give (a fixed width of every step's inputs).
    penalties: bool = True
    max_logit_bias: int = 64
    # The host tier (docs/ARCHITECTURE.md, decision 12): bytes of pinned host memory for each instance's rBlocks, so
    # a preempted sequence swaps out and back in instead of recomputing, and the prefix cache spills there instead
    # of forgetting. None or 0: off (the default, for now: on an H200 the multi-turn workload of
    # scripts/bench_host_tier.py took 8.6x longer to its first tokens with the tier on, README "Host memory as a KV
    # tier"). One process (a multi-process run: refused).
    host_kv_bytes: int | None = None
    # Which kernels each step runs: "auto" (the learned tuner if a cost model was trained for this
    # device kind, else "fixed", said once) or "fixed" (the backend's defaults for every bucket).
    tuner: str = "auto"
    # JAX's persistent compilation cache in this directory (created if missing), so a restart compiles
    # nothing; None: $JAXLLM_COMPILE_CACHE if set, else off.
    compile_cache_dir: str | None = None
    # What one request may ask for (jaxllm.engine.requests.RequestLimits, built once from these; every
    # front end reads that one object): max_tokens of a request that sets none (capped at the room its
    # prompt leaves), stop strings per request, characters per stop string.
    default_max_tokens: int = 256
    max_stop_strings: int = 16
    max_stop_length: int = 256

    def __post_init__(self):
        for name in ("tensor_parallel", "instances", "default_max_tokens", "max_stop_strings", "max_stop_length"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.host_kv_bytes is not None and (isinstance(self.host_kv_bytes, bool)
                                               or not isinstance(self.host_kv_bytes, int) or self.host_kv_bytes < 0):
            raise ValueError(f"host_kv_bytes must be an integer >= 0 (0 turns the host tier off) or None (the "
                             f"default), got {self.host_kv_bytes!r}")
        for name in ("max_logprobs", "max_logit_bias"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if not isinstance(self.penalties, bool):
            raise ValueError(f"penalties must be True or False, got {self.penalties!r}")
        if self.kv_memory_fraction is not None and not (0.0 < self.kv_memory_fraction <= 1.0):
            raise ValueError(f"kv_memory_fraction must be in (0, 1], got {self.kv_memory_fraction}")
        for name in ("block_size", "num_blocks", "max_tokens_per_step"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.max_seqs <= 0:
            raise ValueError(f"max_seqs must be positive, got {self.max_seqs}")
        if self.attention_backend not in BACKENDS:
            raise ValueError(f"attention_backend {self.attention_backend!r} is not one of {BACKENDS}")
        if self.tuner not in TUNERS:
            raise ValueError(f"tuner {self.tuner!r} is not one of {TUNERS}")
        if self.compile_cache_dir is not None and (not isinstance(self.compile_cache_dir, str)
                                                   or not self.compile_cache_dir):
            raise ValueError(f"compile_cache_dir must be a non-empty path or None, got {self.compile_cache_dir!r}")


class LLM:
    """A Llama-2 family model ready to generate.

    Args:
      model: a preset name ("tiny", "llama2-7b", ...), a HuggingFace directory or an Orbax directory.
      dtype: parameter/activation dtype ("float32", "bfloat16", "float16"); default the checkpoint's.
      max_context: longest sequence (prompt + generated) accepted; default the model's window
        (`config.max_context`: max_position_embeddings, or what its RoPE scaling extends it to). More is a
        ValueError naming the window, unless allow_long_context.
      allow_long_context: accept a max_context past the model's window (positions it was never trained on:
        for random-weight benchmarks of long contexts, not for a checkpoint's quality).
      options: KV pool and batching limits (EngineOptions).
    """

    def __init__(self, model: str, *, dtype=None, max_context: int | None = None, allow_long_context: bool = False,
                 options: EngineOptions | None = None, progress: bool = True):
        self.options = options or EngineOptions()
        self.memory_plan: MemoryPlan | None = None  # set where the pool was planned (GPU, the default)
        cache_dir = resolve_cache_dir(self.options.compile_cache_dir)
        if cache_dir is not None:  # before anything compiles, so loading's small programs are cached too
            self.compile_cache_dir = enable_persistent_cache(cache_dir)
        else:
            self.compile_cache_dir = None
        tp, instances = self.options.tensor_parallel, self.options.instances
        # Every engine runs on a mesh of instances x tensor devices; one device is the 1 x 1 mesh, whose
        # model and pool load onto that device as they are (nothing to shard).
        self.mesh = make_mesh(tp, instances)
        if compat.on_gpu():
            warn_without_tensor_parallel_flags(tp, host_tier=bool(self.options.host_kv_bytes))
        sharded = tp * instances > 1 or jax.process_count() > 1
        if jax.process_count() > 1 and tp * instances != jax.device_count():
            # Every process runs every step; one whose devices the mesh left out could take no part.
            raise ValueError(f"a {jax.process_count()}-process run needs the mesh to span all {jax.device_count()} "
                             f"devices; tensor_parallel {tp} x instances {instances} = {tp * instances}")
        self.model, tokenizer_dir = load_model(
            model, dtype=dtype, progress=progress,
            sharding=functools.partial(load_sharding, mesh=self.mesh) if sharded else None)
        self.config = self.model.config  # the checkpoint's (KV heads as trained, whatever the mesh)
        if sharded:
            self.model = self._placed_model()  # its config has the KV heads the mesh needs
        step_model = self.model
        self.tokenizer = load_tokenizer(tokenizer_dir)
        self.generation_defaults = load_generation_defaults(tokenizer_dir)  # used where a request gives none
        if max_context is None:
            max_context = self.config.max_context
        if isinstance(max_context, bool) or not isinstance(max_context, int) or max_context <= 0:
            raise ValueError(f"max_context must be a positive integer, got {max_context!r}")
        window = self.config.max_context
        if max_context > window and not allow_long_context:
            # Refused, not clamped: a silent clamp would change what the caller asked for, and going past
            # the window both allocates for it and runs positions the model never saw.
            raise ValueError(f"max_context {max_context} is over the model's context window of {window} tokens "
                             f"({self.config.describe_max_context()}): use at most {window}, or allow_long_context "
                             f"(--allow-long-context) to run positions the model was not trained on")
        self.max_context = max_context
        on_gpu = jax.default_backend() == "gpu"
        block_size = self.options.block_size or (256 if on_gpu else 16)
        pool_dtype = self.options.kv_dtype or jnp.dtype(self.model.embedding[...].dtype).name
        max_step = self.options.max_tokens_per_step or (4096 if on_gpu else 512)
        base = default_kernels(self.options.attention_backend, head_dim=step_model.config.head_dim)
        pool_dtype = jnp.dtype(kv_dtype(pool_dtype)).name
        lending = self.options.lending and instances > 1
        per_block = kv_bytes_per_block(step_model.config, block_size, pool_dtype)
        self.host_blocks = self._host_blocks(per_block)

        def reach_blocks(num_blocks: int) -> int:
            """rBlocks one sequence may fill: every pool it can reach (the whole mesh's when instances lend)."""
            return num_blocks * (instances if self.options.lending else 1)

        def executor(kv_cache, num_blocks: int, tuner, host_tier: int) -> Executor:
            # The table is as wide as the longest sequence the pool and context limit allow.
            longest = min(self.max_context + 1, reach_blocks(num_blocks) * block_size)
            return Executor(step_model, kv_cache, max_seqs=self.options.max_seqs, max_tokens_per_step=max_step,
                            table_width=-(-longest // block_size), kernels=base, mesh=self.mesh, instances=instances,
                            borrowing=lending, max_logprobs=self.options.max_logprobs, tuner=tuner,
                            penalties=self.options.penalties, max_logit_bias=self.options.max_logit_bias,
                            host_tier=host_tier)

        # Each instance's pool (one device's memory, or one tensor-parallel group's).
        num_blocks = self.options.num_blocks or self._default_num_blocks(
            step_model.config, block_size, pool_dtype,
            probe=lambda blocks: executor(self._kv_pool(step_model.config, blocks * instances, block_size,
                                                        kv_dtype(pool_dtype), abstract=True), blocks, None, 0),
            progress=progress)
        kv_cache = self._kv_pool(step_model.config, num_blocks * instances, block_size, kv_dtype(pool_dtype))
        self.executor = executor(kv_cache, num_blocks,
                                 self._tuner(base, step_model.config, pool_dtype, block_size, progress),
                                 self.host_blocks)
        reach = reach_blocks(num_blocks)
        if instances > 1:
            self.scheduler = InstanceSchedulers(instances, num_blocks, block_size, max_tokens_per_step=max_step,
                                                max_seqs=self.options.max_seqs, lending=self.options.lending,
                                                prefix_caching=self.options.prefix_caching,
                                                hosts=instance_hosts(self.mesh), host_blocks=self.host_blocks)
        else:
            host = HostTier(self.host_blocks) if self.host_blocks else None
            # The device prefix cache spills what it evicts to the host tier (kept there, least recently spilled
            # evicted first); a sequence swapped out keeps its slots until it resumes.
            allocator = BlockAllocator(num_blocks, on_evict=None if host is None else host.spill)
            self.scheduler = Scheduler(allocator, block_size, max_tokens_per_step=max_step,
                                       max_seqs=self.options.max_seqs, prefix_caching=self.options.prefix_caching,
                                       host_tier=host)
        self.model_name = model
        self.pool_dtype = pool_dtype
        self.num_blocks = num_blocks * instances  # every instance's pool
        # The one RequestLimits: the core checks against it, and every front end reads it from there.
        self.limits = RequestLimits(context_limit=min(self.max_context, reach * block_size),
                                    vocab_size=self.config.vocab_size, max_logprobs=self.options.max_logprobs,
                                    default_max_tokens=self.options.default_max_tokens,
                                    max_stop_strings=self.options.max_stop_strings,
                                    max_stop_length=self.options.max_stop_length,
                                    penalties=self.options.penalties, max_logit_bias=self.options.max_logit_bias)
        self.core = EngineCore(self.scheduler, self.executor, self.tokenizer, self.limits,
                               pipeline=self.options.pipeline)

    def _tuner(self, base, config, pool_dtype, block_size: int, progress: bool):
        """The StepTuner EngineOptions.tuner names, over the backend's default kernels `base`."""
        if self.options.tuner == "fixed":
            return FixedTuner(base)
        from jaxllm.tuner import load_tuner  # tunerml's: FixedTuner(base) where no model was trained

        device_kind = jax.devices()[0].device_kind
        tuner = load_tuner(base, device_kind=device_kind, config=config, kv_dtype=pool_dtype, block_size=block_size,
                           tensor_parallel=self.options.tensor_parallel, max_context=self.max_context)
        if isinstance(tuner, FixedTuner) and progress:
            print(f"[jaxllm] tuner: every step runs the default kernels on {device_kind!r}: {tuner.reason}",
                  file=sys.stderr, flush=True)
        return tuner

    def _placed_model(self):
        """The loaded model ready for the mesh: KV heads replicated where the tensor axis exceeds them
        (the step model's graphdef is built from that config), every Param in its shards."""
        tp = self.options.tensor_parallel
        check_tensor_parallel(self.config, tp)
        graphdef, state = nnx.split(self.model)
        config, state = prepare_tensor_parallel(self.config, state, tp)
        if config != self.config:
            graphdef = nnx.graphdef(abstract_model(config, dtype=self.model.embedding[...].dtype))
        return nnx.merge(graphdef, shard_params(state, self.mesh))

    def _kv_pool(self, config, num_blocks: int, block_size: int, dtype, *, abstract: bool = False):
        """The zeroed KV pool, created in its shards on a mesh (never whole on one device); abstract: its shapes,
        dtypes and shardings only (jax.ShapeDtypeStruct leaves; nothing allocated)."""
        make = functools.partial(init_kv_cache, config, num_blocks, block_size, dtype)
        if abstract:
            return abstract_kv_pool(jax.eval_shape(make), self.mesh)
        if self.mesh.devices.size == 1 and jax.process_count() == 1:
            return init_kv_cache(config, num_blocks, block_size, dtype)
        return jax.jit(make, out_shardings=kv_pool_shardings(jax.eval_shape(make), self.mesh))()

    def _default_num_blocks(self, config, block_size: int, pool_dtype: str, *, probe, progress: bool) -> int:
        """rBlocks of each instance's pool when EngineOptions.num_blocks is not set. GPU: kv_memory_fraction of
        the free memory if set; else (the default) planned: the free memory less what the largest step programs
        need while they run, as XLA's memory analysis of them reports it (probe(num_blocks): an executor over an
        abstract pool of that size, whose step_memory() compiles them), less a margin
        (_MEMORY_MARGIN_FRACTION of the free memory, at least _MEMORY_MARGIN_MIN, plus the host tier's copies in
        flight), so a step the engine admits never runs out of memory."""
        # Per device: a tensor-parallel device holds 1 / tensor_parallel of every rBlock (its KV heads).
        per_block = kv_bytes_per_block(config, block_size, pool_dtype) // self.options.tensor_parallel
        free = device_free_bytes([d for d in self.mesh.devices.flat if d.process_index == jax.process_index()])
        if free is None:  # a CPU host: no allocator limit to plan against
            # Enough for a few full-length sequences, within a modest share of host memory.
            budget = min(_CPU_KV_BYTES, 4 * self.max_context * per_block // block_size)
            return _blocks_in(budget, per_block)
        if self.options.kv_memory_fraction is not None:
            budget = int(free * self.options.kv_memory_fraction)
        else:
            # The largest pool the free memory could hold sizes the probe: its tables are the widest the planned
            # pool can have, so the programs' needs measured are an upper bound of the planned pool's.
            started = time.perf_counter()
            plan = plan_memory(free, probe(_blocks_in(free, per_block)).step_memory(), host_tier=bool(self.host_blocks))
            self.memory_plan, budget = plan, plan.pool_bytes
            if progress:
                print(f"[jaxllm] memory: {plan.describe()} (planned in {time.perf_counter() - started:.1f} s)",
                      file=sys.stderr, flush=True)
        if jax.process_count() > 1:  # every process must build the same pool: process 0's figure
            from jax.experimental import multihost_utils

            budget = int(multihost_utils.broadcast_one_to_all(np.float32(budget)))
        return _blocks_in(budget, per_block)

    def _host_blocks(self, per_block: int) -> int:
        """rBlocks each instance's host tier holds (0: no tier): EngineOptions.host_kv_bytes over one rBlock's
        bytes."""
        wanted = self.options.host_kv_bytes or 0
        processes = jax.process_count()
        if wanted and processes > 1:
            raise ValueError(f"host_kv_bytes {wanted}: a host tier serves the instances of one process; this run has "
                             f"{processes} processes (set host_kv_bytes=0 / --host-kv-gib 0)")
        if wanted and wanted < per_block:
            raise ValueError(f"host_kv_bytes {wanted} is less than one rBlock ({per_block} bytes): use 0 to turn "
                             f"the host tier off, or at least {per_block}")
        limit = compat.pinned_host_limit_bytes(jax.devices()[0]) if wanted else None
        needed = self.options.instances * wanted + HOST_COPY_BYTES  # every instance's tier + the copies in flight
        if limit is not None and needed > limit:
            raise ValueError(f"host_kv_bytes {wanted} x {self.options.instances} instance(s) + {HOST_COPY_BYTES >> 20} "
                             f"MiB of copies in flight exceeds the backend's pinned host memory, {limit >> 30} GiB: "
                             f"lower --host-kv-gib, or raise the cap with {compat.PINNED_HOST_LIMIT_VAR}=<GiB> in "
                             f"the environment before the process starts")
        return wanted // per_block

    def close(self) -> None:
        """End a multi-process run: the other processes' runners stop following and their programs exit.
        Call it on process 0 when done (entry points do, also on errors and SIGTERM); idempotent; nothing
        to do on one process."""
        self.executor.stop_followers()

    # ----- what it is -----

    def warm_up(self, progress: bool = True) -> None:
        """Compile every step shape up front (servers do this before reporting ready)."""
        self.executor.warm_up(progress=progress)

    @property
    def compile_count(self) -> int:
        """Step functions compiled so far (the metric that must stay flat after warm-up)."""
        return self.executor.compile_count

    @property
    def pool_tokens(self) -> int:
        """Tokens the KV pool holds (all rBlocks)."""
        return self.num_blocks * self.executor.block_size

    @property
    def context_limit(self) -> int:
        """The most tokens (prompt + generated) one sequence can reach: max_context, or the pool if smaller.
        A prompt may have at most context_limit - 1 tokens (one new token must fit)."""
        return self.limits.context_limit

    def info(self) -> EngineInfo:
        """A frozen description of the loaded model and engine."""
        cfg = self.config
        return EngineInfo(
            model=self.model_name, architecture=cfg.name, dtype=jnp.dtype(self.model.embedding[...].dtype).name,
            kv_dtype=self.pool_dtype, context_limit=self.context_limit, vocab_size=cfg.vocab_size,
            num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, num_heads=cfg.num_heads,
            num_kv_heads=cfg.num_kv_heads, block_size=self.executor.block_size, num_blocks=self.num_blocks,
            max_seqs=self.scheduler.max_seqs, max_tokens_per_step=self.scheduler.max_tokens_per_step,
            tensor_parallel=self.options.tensor_parallel, instances=self.options.instances,
            processes=jax.process_count(), devices=self.mesh.devices.size,
            max_logprobs=self.limits.max_logprobs)

    # ----- generation -----

    def _requests(self, prompts: Seq, sampling: dict) -> list[Request]:
        """Check every prompt and its sampling settings before any is queued."""
        requests = []
        for i, prompt in enumerate(prompts):
            ids = prompt_token_ids(prompt, self.tokenizer, self.limits, what=f"prompt {i}")
            requests.append(Request(ids, sampling_params(self.limits, len(ids), **sampling), checked=self.limits))
        return requests

    def run(self, requests: Iterable[Request],
            on_step: Callable[[list[RequestOutput]], None] | None = None) -> dict[int, list[RequestOutput]]:
        """Run requests (already built) to their ends; returns every output by request id, in order.

        on_step(outputs) is called after each recorded step (benchmarks time the gaps). Returns with no
        step in flight; on an error (or KeyboardInterrupt) every request is cancelled first.
        """
        ids = [self.core.add(r) for r in requests]
        outputs: dict[int, list[RequestOutput]] = {i: [] for i in ids}
        pending = set(ids)
        try:
            while pending:
                step_outputs = self.core.step()
                self._record(step_outputs, outputs, pending)
                if on_step is not None:
                    on_step(step_outputs)
            if self.core.has_step_in_flight():
                step_outputs = self.core.drain()
                if on_step is not None:
                    on_step(step_outputs)
        except BaseException:
            self.core.drop_in_flight()  # dropped unrecorded: harmless (EngineCore says why)
            for i in pending:
                self.core.cancel(i)
            raise
        return outputs

    @staticmethod
    def _record(step_outputs, outputs, pending) -> None:
        for out in step_outputs:
            if out.request_id in outputs:
                outputs[out.request_id].append(out)
                if out.finished:
                    pending.discard(out.request_id)

    def generate(self, prompts: str | Seq[str] | Seq[int] | Seq[Seq[int]], *, max_new_tokens: int,
                 temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
                 seed: int = 0, stop: str | Seq[str] | None = None, stop_token_ids: Seq[int] | None = None,
                 ignore_eos: bool = False, logprobs: int | None = None,
                 prompt_logprobs: int | None = None, frequency_penalty: float = 0.0, presence_penalty: float = 0.0,
                 repetition_penalty: float = 1.0, logit_bias: dict[int, float] | None = None) -> list[Completion]:
        """Complete each prompt (text, or a list of token ids); all prompts run together, continuously batched.

        A prompt may have at most context_limit - 1 tokens, and max_new_tokens may be at most the room
        left (context_limit minus the prompt's tokens): more is a ValueError, never capped silently.
        temperature, top_k, top_p: None takes the checkpoint's generation_config.json default (greedy,
        no top-k, top_p 1 without one).
        ignore_eos: keep generating past the tokenizer's EOS ids (benchmarks); stop strings and
        stop_token_ids still stop.
        logprobs: None, or k <= EngineOptions.max_logprobs: each Completion carries every token's
        log-probability and the k most likely tokens' (before temperature, top-k and top-p).
        prompt_logprobs: None, or k <= EngineOptions.max_logprobs: each Completion carries every prompt token's
        log-probability given the tokens before it (None for the first) and the k most likely there, computed
        in the prefill steps (such a prompt takes nothing from the prefix cache); max_new_tokens may then be 0.
        frequency_penalty, presence_penalty (in [-2, 2], 0 off), repetition_penalty (> 0, 1 off), logit_bias
        ({token id: bias in [-100, 100]}, at most EngineOptions.max_logit_bias entries): vLLM's semantics
        (jaxllm.contract.sampling_params), applied before temperature / top-k / top-p and the greedy argmax;
        log-probabilities stay the model's raw ones.
        """
        temperature, top_k, top_p = self.generation_defaults.resolve(temperature, top_k, top_p)
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not prompts:
            raise ValueError("prompts is empty")
        sampling = dict(max_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                        stop=stop, stop_token_ids=stop_token_ids, ignore_eos=ignore_eos, logprobs=logprobs,
                        prompt_logprobs=prompt_logprobs, frequency_penalty=frequency_penalty,
                        presence_penalty=presence_penalty, repetition_penalty=repetition_penalty,
                        logit_bias=logit_bias, max_tokens_name="max_new_tokens")
        outputs = self.run(self._requests(prompts, sampling))
        completions = []
        for outs in outputs.values():
            scored = next((o.prompt_logprobs for o in outs if o.prompt_logprobs is not None), None)
            completions.append(Completion("".join(o.text for o in outs), [t for o in outs for t in o.token_ids],
                                          outs[-1].finish_reason,
                                          None if logprobs is None else [lp for o in outs for lp in o.logprobs],
                                          None if scored is None else list(scored)))
        return completions

    def stream(self, prompt: str | Seq[int], *, max_new_tokens: int, temperature: float | None = None,
               top_k: int | None = None, top_p: float | None = None, seed: int = 0,
               stop: str | Seq[str] | None = None, stop_token_ids: Seq[int] | None = None,
               ignore_eos: bool = False, frequency_penalty: float = 0.0, presence_penalty: float = 0.0,
               repetition_penalty: float = 1.0, logit_bias: dict[int, float] | None = None) -> Iterator[str]:
        """Yield text pieces of one completion as its tokens are produced (arguments as generate's).

        Text that could still grow into a stop string is held back until it cannot.
        """
        temperature, top_k, top_p = self.generation_defaults.resolve(temperature, top_k, top_p)
        sampling = dict(max_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                        stop=stop, stop_token_ids=stop_token_ids, ignore_eos=ignore_eos,
                        frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
                        repetition_penalty=repetition_penalty, logit_bias=logit_bias,
                        max_tokens_name="max_new_tokens")
        # Checked now, so a bad argument raises here rather than at the first next(); queued when iterated.
        return self._stream(self._requests([prompt], sampling)[0])

    def _stream(self, request: Request) -> Iterator[str]:
        request_id = self.core.add(request)
        finished = False
        try:
            # Between yields at most one step is in flight: the stream runs at most one step ahead of
            # its reader.
            while not finished:
                for out in self.core.step():
                    if out.request_id == request_id:
                        finished = out.finished
                        if finished:
                            self.core.drain()
                        if out.text:
                            yield out.text
        finally:
            # A caller that stops iterating early (or an error) frees the sequence's rBlocks; a step it
            # left in flight is dropped unrecorded, which is harmless (EngineCore says why).
            if not finished:
                self.core.drop_in_flight()
                self.core.cancel(request_id)

    def logits(self, token_ids: Seq[int]) -> np.ndarray:
        """Teacher-forced logits [len(token_ids), vocab] (float32), prefilled in chunks."""
        return self.core.logits(token_ids)

    def chat(self, messages: Seq[dict], **kwargs) -> Completion:
        """Complete a conversation ([{"role": ..., "content": ...}, ...]) under the checkpoint's chat
        template (Llama-2's [INST] format without one); kwargs as generate's."""
        return self.generate(chat_prompt(self.tokenizer, messages), **kwargs)[0]
