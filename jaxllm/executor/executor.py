"""`build_executor`: the executor of one engine, its two parts built over one mesh and handed back as the
ModelRunner the engine core drives.

The executor is the one place that runs jax for an engine, for every mesh: one GPU is the 1 x 1 mesh of
`instance x tensor`; tensor parallelism and lending instances are larger meshes of the same code. Its parts, one
file each:

- `model_runner.ModelRunner`: plans in (the StepRunner, jaxllm.engine.step_runner): the input layout
  (`inputs`, one function for any number of instances), the call a plan is (`calls`), the tuner's variant,
  the bucket counters, what warm-up compiles;
- `worker.Worker`: the devices: the state and the pool placed on the mesh, the jitted programs (`programs`,
  the step functions of `step`), the penalty state, the host tier's store (`host_store`), memory analysis, the
  launcher thread (`launcher`), the follower side of a multi-process run;
- `variants.KernelVariants`: the Kernels each bucket's variants run, which both parts ask;
- `in_flight`: a dispatched step, its outputs still on the devices.
"""

from __future__ import annotations

from jaxllm.executor.host_transfer import HostTransfer
from jaxllm.executor.inputs import InputLayout
from jaxllm.executor.model_runner import ModelRunner
from jaxllm.executor.variants import KernelVariants
from jaxllm.executor.worker import Worker
from jaxllm.model.kv_cache import KVCache
from jaxllm.model.llama import Llama
from jaxllm.tuner.buckets import Buckets
from jaxllm.tuner.fixed import FixedTuner
from jaxllm.tuner.protocol import StepTuner
from pallas_kernels.dispatch import Kernels, default_kernels
from sharding.mesh import make_mesh

__all__ = ["build_executor"]


def build_executor(model: Llama, kv_cache: KVCache, *, max_seqs: int, max_tokens_per_step: int, table_width: int,
                   backend: str = "auto", min_tokens: int = 8, kernels: Kernels | None = None, mesh=None,
                   instances: int = 1, borrowing: bool = False, max_logprobs: int = 0,
                   tuner: StepTuner | None = None, penalties: bool = True, max_logit_bias: int = 64,
                   host_tier: int = 0, host_transfer: HostTransfer | None = None,
                   verify_queries: int = 0) -> ModelRunner:
    """The executor of `model` over the KV pool `kv_cache`, as its ModelRunner (the Worker is its `worker`).

    mesh: the `instance x tensor` mesh the state and the pool are placed on (sharding.rules.shard_params /
    kv_pool_shardings); None: one device, the 1 x 1 mesh of the default device. instances: the mesh's
    instance axis; the pool then holds instances x blocks_per_instance rBlocks (global id = instance *
    blocks_per_instance + local). borrowing: steps may have rBlocks on other instances (lending on), so the
    borrowed variant is compiled at warm-up. max_seqs, max_tokens_per_step, min_tokens, table_width: the buckets
    (jaxllm.tuner.buckets).
    kernels: the backend's Kernels (unwrapped; default from `backend`); tuner: the StepTuner that lists each
    bucket's variants and picks one per step (default FixedTuner(kernels)).
    penalties: keep the penalty state (max_seqs rows of the vocabulary per instance: jaxllm.executor.penalties) and
    apply each row's penalties and logit bias (at most max_logit_bias entries a row); False: steps as without
    them, and plans must carry none.
    host_tier: the slots of each instance's host tier (0: none): plans may carry host copies (one process), so
    the HostStore is built and its copy programs compiled at warm-up; host_transfer: how its runs cross the host
    link (default AsyncHostTransfer: JAX's host memory kinds). verify_queries: tokens a sequence has in a verify step
    (speculative decoding's k + 1; 0: off, no verify programs).
    ValueError for limits that cannot hold (logprobs past the vocabulary, a negative bias width, a pool that does
    not split among the instances).
    """
    if not 0 <= max_logprobs <= model.config.vocab_size:
        raise ValueError(f"max_logprobs {max_logprobs} must be in [0, {model.config.vocab_size}] (the vocabulary)")
    if max_logit_bias < 0:
        raise ValueError(f"max_logit_bias must be >= 0, got {max_logit_bias}")
    if kv_cache.num_blocks % instances:
        raise ValueError(f"the KV pool's {kv_cache.num_blocks} rBlocks do not split among {instances} instances")
    mesh = mesh if mesh is not None else make_mesh(1, 1)
    buckets = Buckets(max_seqs=max_seqs, max_tokens_per_step=max_tokens_per_step, table_width=table_width,
                      min_tokens=min_tokens, verify_queries=verify_queries)
    # Resolved once, here: inside the trace no backend name is read and no device is asked.
    base = kernels or default_kernels(backend, head_dim=model.config.head_dim)
    tuner = tuner if tuner is not None else FixedTuner(base)
    worker = Worker(model, kv_cache, mesh=mesh, instances=instances, variants=KernelVariants(tuner, mesh),
                    max_logprobs=max_logprobs, penalty_rows=max_seqs if penalties else 0, host_tier=host_tier,
                    longest_table=table_width, host_transfer=host_transfer)
    layout = InputLayout(instances=instances, blocks_per_instance=worker.blocks_per_instance,
                         block_size=kv_cache.block_size, buckets=buckets,
                         bias_width=max_logit_bias if penalties else None)
    return ModelRunner(worker, layout, borrowing=borrowing)
