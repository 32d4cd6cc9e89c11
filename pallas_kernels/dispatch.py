"""The one place that maps an op onto a kernel: `Kernels` names the implementation and schedule of each.

Callers name what they want computed (ragged attention over the rBlock pool, RoPE + the KV write, a decode
layer's add + RMSNorm and unreduced output projections) and hand over a `Kernels`; this module reads its
fields and nothing else: no backend string is resolved and no device is queried inside a trace.
`default_kernels` resolves a backend name ("auto" included) once, outside any trace; a tuner or
`sharding/` supplies other `Kernels` (it is frozen and hashable, a static argument of the jitted step).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Literal

import jax
import jax.numpy as jnp

from pallas_kernels import compat, validation
from pallas_kernels.ragged_decode import DecodeBlockSizes
from pallas_kernels.ragged_prefill import PrefillBlockSizes, ragged_prefill_reference
from pallas_kernels.ragged_prefill_mgpu import MosaicPrefillConfig
from pallas_kernels.rms_norm import RmsNormBlockSizes
from pallas_kernels.skinny_matmul import MAX_ROWS as SKINNY_MAX_ROWS, SkinnyBlockSizes

Backend = Literal["auto", "reference", "triton", "mosaic"]
BACKENDS = ("auto", "reference", "triton", "mosaic")
DECODE_ATTENTION = ("reference", "triton")
PREFILL_ATTENTION = ("reference", "triton", "mosaic")
VERIFY_ATTENTION = ("decode", "prefill")
ROPE_KV_WRITE = ("reference", "pallas")
DECODE_LAYER = ("reference", "pallas")
# Prefill steps shorter than one Mosaic CTA tile (2 x 64 query rows) stay on the Triton kernel: they
# are cheap either way, and the Mosaic kernel was checked on the GPU from 180 tokens up.
MOSAIC_MIN_TOKENS = 128
# Steps up to this many tokens (decode) take the one-kernel add + RMSNorm and the weight-streaming
# matmul: as many rows as the skinny matmul takes.
FUSED_NORM_MAX_TOKENS = SKINNY_MAX_ROWS


def kernels_support(head_dim: int) -> bool:
    return head_dim in validation.SUPPORTED_HEAD_DIMS


@dataclasses.dataclass(frozen=True)
class Kernels:
    """Which implementation and schedule every op of a step uses (frozen, hashable: a jit static argument).

    decode_attention: "reference" | "triton" (one query token per sequence, `ragged_decode`).
    prefill_attention: "reference" | "triton" | "mosaic" (Mosaic where its shapes apply and the step has
      at least mosaic_min_tokens tokens, Triton otherwise: int8 KV, short steps, rBlocks below its tile).
    rope_kv_write: "reference" (RoPE as an XLA fusion, then scatters) | "pallas" (one kernel; float pools
      only, int8 pools take the reference).
    decode_layer: "reference" | "pallas": steps of at most fused_norm_max_tokens tokens take the one-pass
      add + RMSNorm kernel and the skinny matmul's unreduced split-K partials (the next kernel sums them).
    verify_attention: "decode" | "prefill": a verify step's attention (Q query tokens a sequence) as a decode over
      the earlier keys with the decode_attention implementation plus a causal part among the Q
      (pallas_kernels.verify_attention), or as a prefill step through prefill_attention.
    *_block_sizes / mosaic_prefill: each kernel's schedule; None is the kernel's own default.
    interpret: run the Pallas kernels in the interpreter (the CPU, tests).
    per_shard: None (one device, or a mesh where XLA partitions the reference ops), or a hashable
      object with `attention(fn)`, `rope_write_kv(fn)` and `add_rms_norm(fn)` returning those functions run
      per device (sharding.tensor_parallel.TensorShards, set by the executor on a mesh): Pallas kernels are
      custom calls XLA cannot partition. Under it matmul_unreduced is XLA's matmul (see there).
    distributed: None, or a hashable object with `attention(qkv, cos, sin, k_pool, v_pool, k_scale, v_scale,
      batch, *, num_q_heads, dtype, kernels)` that runs `paged_attention` for a step whose rBlocks lie on
      several instances (batch.parts; sharding.dist_attention.DistAttention, set by the executor on a step with
      borrowed rBlocks; it calls back into this module's ops for its per-part work).
    """

    decode_attention: str = "reference"
    prefill_attention: str = "reference"
    rope_kv_write: str = "reference"
    decode_layer: str = "reference"
    verify_attention: str = "decode"
    decode_block_sizes: DecodeBlockSizes | None = None
    prefill_block_sizes: PrefillBlockSizes | None = None
    mosaic_prefill: MosaicPrefillConfig | None = None
    skinny_block_sizes: SkinnyBlockSizes | None = None
    rms_norm_block_sizes: RmsNormBlockSizes | None = None
    mosaic_min_tokens: int = MOSAIC_MIN_TOKENS
    fused_norm_max_tokens: int = FUSED_NORM_MAX_TOKENS
    interpret: bool = False
    per_shard: Any = None
    distributed: Any = None

    def __post_init__(self):
        for name, allowed in (("decode_attention", DECODE_ATTENTION), ("prefill_attention", PREFILL_ATTENTION),
                              ("rope_kv_write", ROPE_KV_WRITE), ("decode_layer", DECODE_LAYER),
                              ("verify_attention", VERIFY_ATTENTION)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"Kernels.{name} {getattr(self, name)!r} is not one of {allowed}")
        if self.mosaic_min_tokens < 1:
            raise ValueError(f"Kernels.mosaic_min_tokens {self.mosaic_min_tokens} must be >= 1")
        if not 0 <= self.fused_norm_max_tokens <= SKINNY_MAX_ROWS:
            raise ValueError(f"Kernels.fused_norm_max_tokens {self.fused_norm_max_tokens} must be in "
                             f"[0, {SKINNY_MAX_ROWS}] (the skinny matmul's row limit)")


REFERENCE = Kernels()


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class AttentionBatch:
    """Where a step's tokens go in the rBlock pool and what they attend to.

    block_tables [num_seqs, max_blocks] int32, kv_lens [num_seqs] int32 (after this step's tokens are
    written), cu_q_lens [num_seqs + 1] int32 (packed query tokens per sequence), slot_mapping [num_tokens]
    int32 (block * block_size + row; -1 for padding tokens). `single_query` (static) marks steps where every
    sequence has exactly one query token (a decode step); `verify_queries` (static) those where every sequence has
    exactly that many, packed in sequence order (a verify step: pallas_kernels.verify_attention; 0 otherwise).
    parts: None, or the arrays of a step whose rBlocks lie on several instances, read only by
    `Kernels.distributed` (sharding.dist_attention.DistParts).
    """

    block_tables: jax.Array
    kv_lens: jax.Array
    cu_q_lens: jax.Array
    slot_mapping: jax.Array
    parts: Any = None
    single_query: bool = dataclasses.field(default=False, metadata=dict(static=True))
    verify_queries: int = dataclasses.field(default=0, metadata=dict(static=True))


def default_kernels(backend: Backend | None = "auto", *, head_dim: int | None = None, on_gpu: bool | None = None,
                    compute_capability: tuple[int, int] | None = None) -> Kernels:
    """Today's defaults for a backend name, resolved once, outside any trace.

    'auto' is the Pallas kernels on a GPU (decode on Triton, prefill on Mosaic on Hopper, else Triton)
    and the pure-jnp reference elsewhere: on the CPU the kernels run only in interpret mode, far slower
    than the reference, so the CPU uses them in kernel tests, not in the model. A head_dim outside
    SUPPORTED_HEAD_DIMS takes the reference attention and RoPE under 'auto'. 'triton' is every kernel with Triton
    prefill; 'mosaic' is 'triton' with the Mosaic prefill where the GPU is a Hopper. on_gpu and
    compute_capability default to the device found.
    """
    backend = backend or "auto"
    if backend not in BACKENDS:
        raise ValueError(f"attention backend {backend!r} is not one of {BACKENDS}")
    if on_gpu is None:
        on_gpu = compat.on_gpu()
    if backend == "reference" or (backend == "auto" and not on_gpu):
        return REFERENCE
    if backend == "auto" and head_dim is not None and not kernels_support(head_dim):
        # No attention or RoPE kernel for this head_dim; the decode-layer kernels take any width.
        return Kernels(decode_layer="pallas")
    if on_gpu and compute_capability is None:
        compute_capability = compat.gpu_compute_capability()
    hopper = compute_capability is not None and compute_capability[0] == 9
    prefill = "mosaic" if backend in ("auto", "mosaic") and on_gpu and hopper else "triton"
    return Kernels(decode_attention="triton", prefill_attention=prefill, rope_kv_write="pallas",
                   decode_layer="pallas", interpret=not on_gpu)


def prefill_kernel(q: jax.Array, k_pool: jax.Array, kernels: Kernels, *, parts: bool = False) -> str:
    """'reference', 'triton' or 'mosaic': the implementation a prefill step of these shapes takes.

    Mosaic only where kernels name it and it applies (bf16/fp16 q and KV of one dtype, rBlocks a
    multiple of its KV tile: `mgpu_shapes_supported`) on steps of at least mosaic_min_tokens tokens, and
    not for parts of sequences (`parts`: query_starts or residuals asked for, which the Triton kernel takes).
    """
    if kernels.prefill_attention != "mosaic":
        return kernels.prefill_attention
    if parts:
        return "triton"
    from pallas_kernels.ragged_prefill_mgpu import mgpu_shapes_supported

    if q.shape[0] >= kernels.mosaic_min_tokens and mgpu_shapes_supported(q, k_pool, kernels.mosaic_prefill):
        return "mosaic"
    return "triton"


def ragged_attention(
    q: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array,
    block_tables: jax.Array,
    kv_lens: jax.Array,
    cu_q_lens: jax.Array,
    *,
    single_query: bool,
    kernels: Kernels = REFERENCE,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
    num_q_heads: int | None = None,
    query_starts: jax.Array | None = None,
    return_residuals: bool = False,
    verify_queries: int = 0,
):
    """Causal attention of packed query tokens to their sequences' KV in the pool.

    q: [T, Hq, D], or grouped per KV head [T, Hkv, Gh, D] of which the first num_q_heads // Hkv of each
    group are the queries (rope_write_kv's q: the decode kernel reads them in place, the others get a
    slice). `single_query` (static) promises one query token per sequence (T == num_seqs, cu_q_lens ==
    arange), which lets the decode kernel split long KV across programs. query_starts: optional [num_seqs],
    where each row's first query sits relative to its first key (a part of a sequence: DistAttention's
    prefill rows); return_residuals: also return (row max, row sum of exponentials) [T, Hq] float32, for
    an exact merge with other parts (pallas_kernels.residuals). verify_queries (static): every sequence has
    exactly this many query tokens, packed in sequence order (T == num_seqs x verify_queries, kv_lens >= it or 0):
    under verify_attention "decode" they take pallas_kernels.verify_attention. Returns [T, Hq, D] (heads in group
    order, h = kv_head * G + g), or (out, (row_max, row_sum)). Semantics are ragged_prefill_reference's.
    """
    extra = dict(query_starts=query_starts, return_residuals=return_residuals)
    if kernels.per_shard is not None:
        local = dataclasses.replace(kernels, per_shard=None)
        return kernels.per_shard.attention(functools.partial(ragged_attention, kernels=local))(
            q, k_pool, v_pool, block_tables, kv_lens, cu_q_lens, single_query=single_query, k_scale=k_scale,
            v_scale=v_scale, num_q_heads=num_q_heads, verify_queries=verify_queries, **extra)
    if single_query and query_starts is not None:
        raise ValueError("query_starts places prefill rows; a decode step's one query token sees every key")
    if verify_queries > 1 and kernels.verify_attention == "decode" and query_starts is None:
        from pallas_kernels.verify_attention import verify_attention

        return verify_attention(q, k_pool, v_pool, block_tables, kv_lens, queries=verify_queries,
                                past=functools.partial(_decode_attention, kernels=kernels), k_scale=k_scale,
                                v_scale=v_scale, num_q_heads=num_q_heads, return_residuals=return_residuals)
    if single_query and kernels.decode_attention == "triton":
        return _decode_attention(q, k_pool, v_pool, block_tables, kv_lens, kernels=kernels, k_scale=k_scale,
                                 v_scale=v_scale, num_q_heads=num_q_heads, return_residuals=return_residuals)
    if q.ndim == 4:
        group = q.shape[2] if num_q_heads is None else num_q_heads // q.shape[1]
        q = q[:, :, :group].reshape(q.shape[0], -1, q.shape[-1])  # [T, Hq, D]
    elif num_q_heads is not None and num_q_heads != q.shape[1]:
        raise ValueError(f"num_q_heads {num_q_heads} != the {q.shape[1]} heads of q {q.shape}")
    parts = query_starts is not None or return_residuals
    impl = "reference" if single_query else prefill_kernel(q, k_pool, kernels, parts=parts)
    if impl == "mosaic":
        from pallas_kernels.ragged_prefill_mgpu import ragged_prefill_mgpu

        return ragged_prefill_mgpu(q, k_pool, v_pool, block_tables, kv_lens, cu_q_lens,
                                   config=kernels.mosaic_prefill, interpret=kernels.interpret)
    if impl == "triton":
        from pallas_kernels.ragged_prefill import ragged_prefill

        return ragged_prefill(q, k_pool, v_pool, block_tables, kv_lens, cu_q_lens, k_scale=k_scale, v_scale=v_scale,
                              block_sizes=kernels.prefill_block_sizes, interpret=kernels.interpret, **extra)
    return ragged_prefill_reference(q, k_pool, v_pool, block_tables, kv_lens, cu_q_lens,
                                    k_scale=k_scale, v_scale=v_scale, **extra)


def _decode_attention(q, k_pool, v_pool, block_tables, kv_lens, *, kernels: Kernels, k_scale=None, v_scale=None,
                      num_q_heads: int | None = None, return_residuals: bool = False):
    """Decode attention (one query position a sequence, q grouped [S, Hkv, Gh, D]) by decode_attention's kernel."""
    if kernels.decode_attention == "triton":
        from pallas_kernels.ragged_decode import ragged_decode

        return ragged_decode(q, k_pool, v_pool, block_tables, kv_lens, k_scale=k_scale, v_scale=v_scale,
                             num_q_heads=num_q_heads, block_sizes=kernels.decode_block_sizes,
                             return_residuals=return_residuals, interpret=kernels.interpret)
    from pallas_kernels.ragged_decode import ragged_decode_reference

    group = (q.shape[1] * q.shape[2] if num_q_heads is None else num_q_heads) // q.shape[1]
    q = q[:, :, :group].reshape(q.shape[0], -1, q.shape[-1])  # [S, Hq, D]
    return ragged_decode_reference(q, k_pool, v_pool, block_tables, kv_lens, k_scale=k_scale, v_scale=v_scale,
                                   return_residuals=return_residuals)


def paged_attention(k_pool, v_pool, k_scale, v_scale, qkv, cos, sin, batch: AttentionBatch, *, num_q_heads: int,
                    dtype, kernels: Kernels = REFERENCE):
    """One layer's attention over the rBlock pool: RoPE on the step's q and k, its K/V written into the pool
    (`rope_write_kv`), then ragged attention (`ragged_attention`).

    qkv: the fused projection [T, Hkv, G + 2, hd] (or its [S, T, ...] float32 split-K partials); cos, sin:
    the RoPE tables of the step's tokens. A batch with `parts` (rBlocks on several instances) runs through
    `kernels.distributed`, which calls these same ops per part. Returns (out [T, Hq, hd], k_pool, v_pool,
    k_scale, v_scale).
    """
    if batch.parts is not None:
        if kernels.distributed is None:
            raise ValueError("an attention batch with parts (rBlocks on several instances) needs "
                             "Kernels.distributed (sharding.dist_attention.DistAttention)")
        local = dataclasses.replace(kernels, distributed=None)
        return kernels.distributed.attention(qkv, cos, sin, k_pool, v_pool, k_scale, v_scale, batch,
                                             num_q_heads=num_q_heads, dtype=dtype, kernels=local)
    q, k_pool, v_pool, k_scale, v_scale = rope_write_kv(k_pool, v_pool, qkv, cos, sin, batch.slot_mapping, k_scale,
                                                        v_scale, dtype=dtype, kernels=kernels)
    out = ragged_attention(q, k_pool, v_pool, batch.block_tables, batch.kv_lens, batch.cu_q_lens,
                           single_query=batch.single_query, verify_queries=batch.verify_queries,
                           k_scale=k_scale, v_scale=v_scale, num_q_heads=num_q_heads, kernels=kernels)
    return out, k_pool, v_pool, k_scale, v_scale


def rope_write_kv(k_pool, v_pool, qkv, cos, sin, slot_mapping, k_scale=None, v_scale=None, *, dtype=None,
                  kernels: Kernels = REFERENCE):
    """RoPE on the step's q and k, and its K/V appended to the pool: `kv_write.rope_write_kv`'s meaning.

    qkv: [tokens, kv_heads, G + 2, head_dim], the model's fused projection grouped per KV head (G
    query heads, then k, then v), or matmul_unreduced's [S, tokens, ...] float32 partials of it (then
    `dtype`, the projection's dtype, is required: the partials' sum is rounded to it). Returns (q,
    k_pool, v_pool, k_scale, v_scale), q [tokens, kv_heads, Gh, head_dim] holding the rotated queries
    in the first G of each group (pass num_q_heads to ragged_attention). Float pools under
    rope_kv_write "pallas" take the one-kernel `rope_write_kv_kernel`; int8 pools and the reference
    take RoPE as a fusion and XLA scatters.
    """
    from pallas_kernels import kv_write

    if kernels.per_shard is not None:
        local = dataclasses.replace(kernels, per_shard=None)
        return kernels.per_shard.rope_write_kv(functools.partial(rope_write_kv, dtype=dtype, kernels=local))(
            k_pool, v_pool, qkv, cos, sin, slot_mapping, k_scale, v_scale)
    if kernels.rope_kv_write == "pallas" and k_pool.dtype != jnp.int8:
        q, k_pool, v_pool = kv_write.rope_write_kv_kernel(k_pool, v_pool, qkv, cos, sin, slot_mapping, dtype=dtype,
                                                          interpret=kernels.interpret)
        return q, k_pool, v_pool, None, None
    return kv_write.rope_write_kv(k_pool, v_pool, qkv, cos, sin, slot_mapping, k_scale, v_scale, dtype=dtype)


def _decode_sized_kernel_step(kernels: Kernels, tokens: int) -> bool:
    """Whether a step of `tokens` rows takes the decode-layer kernels (add + norm, unreduced matmul)."""
    return kernels.decode_layer == "pallas" and tokens <= kernels.fused_norm_max_tokens


def matmul_unreduced(x: jax.Array, w: jax.Array, *, kernels: Kernels = REFERENCE) -> jax.Array:
    """x [T, K] @ w [K, N] for a consumer that sums split-K partials itself: add_rms_norm (the o and
    down projections, added to the residual stream next) or rope_write_kv (the q/k/v projection).

    Decode-sized steps under decode_layer "pallas" return the skinny matmul's unreduced split-K
    partials [S, T, N] float32: the consumer sums them in its one pass, so the sum costs no kernel of
    its own (XLA's split-K GEMM runs its sum as a separate kernel). Otherwise, and on a mesh
    (kernels.per_shard), XLA's matmul: [T, N] in x.dtype. On a mesh a row-parallel projection's output
    is also partial over the tensor axis, which only an all-reduce can sum: XLA partitions the dot and
    places that all-reduce, and the norm after it gets the sum.
    """
    if kernels.per_shard is None and _decode_sized_kernel_step(kernels, x.shape[0]):
        from pallas_kernels.rms_norm import MAX_PARTS
        from pallas_kernels.skinny_matmul import default_block_sizes, skinny_matmul_partials

        # No more partials than the norm kernel sums: a narrow model's defaults split K finer (the
        # tiny preset's 688 x 256 down projection: 43 splits of 16 rows).
        sizes = kernels.skinny_block_sizes or default_block_sizes(x.shape[0], x.shape[1], w.shape[1],
                                                                  max_splits=MAX_PARTS)
        return skinny_matmul_partials(x, w, block_sizes=sizes, interpret=kernels.interpret)
    return jnp.dot(x, w)


def add_rms_norm(x: jax.Array, delta: jax.Array | None, weight: jax.Array, *, eps: float,
                 kernels: Kernels = REFERENCE) -> tuple[jax.Array, jax.Array]:
    """(RMSNorm(x + delta) * weight, x + delta) for x, delta [T, D] (delta None: x itself, not added;
    delta [S, T, D] float32: matmul_unreduced's partials, summed first).

    `rms_norm.add_rms_norm`'s meaning (HF Llama's rounding points). Decode-sized steps under
    decode_layer "pallas" take the one-pass Pallas kernel, one launch where XLA runs three (the add,
    the reduction, the scale); other steps take the reference, which XLA fuses. On a mesh
    (kernels.per_shard) the kernel runs on every device over the whole (replicated) rows.
    """
    from pallas_kernels import rms_norm

    if kernels.per_shard is not None and _decode_sized_kernel_step(kernels, x.shape[0]):
        local = dataclasses.replace(kernels, per_shard=None)
        return kernels.per_shard.add_rms_norm(functools.partial(add_rms_norm, eps=eps, kernels=local))(
            x, delta, weight)
    if _decode_sized_kernel_step(kernels, x.shape[0]):
        sizes, interpret = kernels.rms_norm_block_sizes, kernels.interpret
        if delta is None:
            return rms_norm.rms_norm(x, weight, eps=eps, block_sizes=sizes, interpret=interpret), x
        return rms_norm.add_rms_norm(x, delta, weight, eps=eps, block_sizes=sizes, interpret=interpret)
    if delta is None:
        return rms_norm.rms_norm_reference(x, weight, eps=eps), x
    return rms_norm.add_rms_norm_reference(x, delta, weight, eps=eps)
