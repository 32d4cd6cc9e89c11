"""The one place that chooses a kernel backend (reference, Triton-lowered Pallas, Mosaic GPU).

Callers name what they want computed (ragged attention over the rBlock pool, RoPE + the KV write, a decode
layer's add + RMSNorm and unreduced output projections); this module picks the implementation for
the device and the step's size. Nothing else branches on backends.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

from pallas_kernels import compat, validation
from pallas_kernels.ragged_prefill import ragged_prefill_reference
from pallas_kernels.skinny_matmul import MAX_ROWS as SKINNY_MAX_ROWS

Backend = Literal["auto", "reference", "triton", "mosaic"]
BACKENDS = ("auto", "reference", "triton", "mosaic")
# Prefill steps shorter than one Mosaic CTA tile (2 x 64 query rows) stay on the Triton kernel: they
# are cheap either way, and the Mosaic kernel was checked on the GPU from 180 tokens up.
MOSAIC_MIN_TOKENS = 128


def kernels_support(head_dim: int) -> bool:
    return head_dim in validation.SUPPORTED_HEAD_DIMS


def resolve_backend(backend: Backend | None = "auto", head_dim: int | None = None) -> str:
    """'auto' is the Pallas kernels on a GPU and the pure-jnp reference elsewhere.

    On the CPU the Pallas kernels run only in interpret mode, far slower than the reference,
    so the CPU uses them in kernel tests, not in the model. Shapes the kernels do not support
    (head_dim outside SUPPORTED_HEAD_DIMS) also take the reference under 'auto'; naming
    'triton' or 'mosaic' for them raises. Which kernel a GPU prefill takes ('mosaic' on Hopper where it
    applies, else 'triton') is `prefill_kernel`'s choice; decode is always the Triton kernel.
    """
    backend = backend or "auto"
    if backend not in BACKENDS:
        raise ValueError(f"attention backend {backend!r} is not one of {BACKENDS}")
    if backend == "auto":
        supported = head_dim is None or kernels_support(head_dim)
        return "mosaic" if compat.on_gpu() and supported else "reference"
    return backend


def prefill_kernel(q: jax.Array, k_pool: jax.Array, backend: str) -> str:
    """'mosaic' or 'triton' for a GPU prefill step of these shapes under a resolved kernel backend.

    'triton' always takes the Triton kernel. 'mosaic' takes the Mosaic GPU kernel where it applies
    (Hopper, bf16/fp16 q and KV of one dtype, rBlocks a multiple of its KV tile: see mgpu_supported)
    and steps of at least MOSAIC_MIN_TOKENS tokens, and the Triton kernel otherwise (int8 KV, other
    GPUs, short steps). On the H200 it ran 1.02-1.04x cuDNN and 1.29-1.37x the Triton kernel
    (benchmarks/results/nvidia-h200-2026-11-22-0215-mosaic-prefill.json).
    """
    if backend != "mosaic" or q.shape[0] < MOSAIC_MIN_TOKENS:
        return "triton"
    from pallas_kernels.ragged_prefill_mgpu import mgpu_supported

    return "mosaic" if mgpu_supported(q, k_pool) else "triton"


def ragged_attention(
    q: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array,
    block_tables: jax.Array,
    kv_lens: jax.Array,
    cu_q_lens: jax.Array,
    *,
    decode: bool,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
    num_q_heads: int | None = None,
    backend: Backend | None = "auto",
) -> jax.Array:
    """Causal attention of packed query tokens [T, Hq, D] to their sequences' KV in the pool.

    `decode` (static) promises one query token per sequence (T == num_seqs,
    cu_q_lens == arange), which lets the decode kernel split long KV across programs.
    num_q_heads: attend with only the first num_q_heads heads of q (the model passes its fused
    q|k projection after RoPE; the decode kernel reads them in place, the others get a slice).
    Returns [T, num_q_heads, D]. Semantics are ragged_prefill_reference's.
    """
    backend = resolve_backend(backend, q.shape[-1])
    if backend in ("triton", "mosaic") and decode:
        from pallas_kernels.ragged_decode import ragged_decode

        return ragged_decode(q, k_pool, v_pool, block_tables, kv_lens, k_scale=k_scale, v_scale=v_scale,
                             num_q_heads=num_q_heads)
    if num_q_heads is not None:
        q = q[:, :num_q_heads]
    if backend in ("triton", "mosaic"):
        if prefill_kernel(q, k_pool, backend) == "mosaic":
            from pallas_kernels.ragged_prefill_mgpu import ragged_prefill_mgpu

            return ragged_prefill_mgpu(q, k_pool, v_pool, block_tables, kv_lens, cu_q_lens)
        from pallas_kernels.ragged_prefill import ragged_prefill

        return ragged_prefill(q, k_pool, v_pool, block_tables, kv_lens, cu_q_lens, k_scale=k_scale, v_scale=v_scale)
    return ragged_prefill_reference(q, k_pool, v_pool, block_tables, kv_lens, cu_q_lens,
                                    k_scale=k_scale, v_scale=v_scale)


def rope_write_kv(k_pool, v_pool, qkv, cos, sin, slot_mapping, k_scale=None, v_scale=None, *, num_q_heads: int,
                  dtype=None, backend: Backend | None = "auto"):
    """RoPE on the step's q and k, and its K/V appended to the pool: `kv_write.rope_write_kv`'s meaning.

    qkv: [tokens, num_q_heads + 2 kv_heads, head_dim], the model's fused projection, or
    matmul_unreduced's [S, tokens, ...] float32 partials of it (then `dtype`, the projection's dtype,
    is required: the partials' sum is rounded to it). Returns (q, k_pool, v_pool, k_scale, v_scale),
    where q holds the rotated queries in its first num_q_heads heads (pass num_q_heads to
    ragged_attention). Float pools on the kernel backends ('triton', 'mosaic') take
    the one-kernel `rope_write_kv_kernel`; int8 pools and the reference backend take RoPE as a fusion and
    XLA scatters.
    """
    from pallas_kernels import kv_write

    backend = resolve_backend(backend, k_pool.shape[-1])
    if backend in ("triton", "mosaic") and k_pool.dtype != jnp.int8:
        q, k_pool, v_pool = kv_write.rope_write_kv_kernel(k_pool, v_pool, qkv, cos, sin, slot_mapping,
                                                          num_q_heads=num_q_heads, dtype=dtype)
        return q, k_pool, v_pool, None, None
    return kv_write.rope_write_kv(k_pool, v_pool, qkv, cos, sin, slot_mapping, k_scale, v_scale,
                                  num_q_heads=num_q_heads, dtype=dtype)


# Steps up to this many tokens (decode) take the one-kernel add + RMSNorm and the weight-streaming
# matmul on the kernel backends: as many rows as the skinny matmul takes.
FUSED_NORM_MAX_TOKENS = SKINNY_MAX_ROWS


def _decode_sized_kernel_step(backend: Backend | None, tokens: int) -> bool:
    """Whether a step of `tokens` rows takes the decode-layer kernels (add + norm, unreduced matmul)."""
    return resolve_backend(backend) in ("triton", "mosaic") and tokens <= FUSED_NORM_MAX_TOKENS


def matmul_unreduced(x: jax.Array, w: jax.Array, *, backend: Backend | None = "auto") -> jax.Array:
    """x [T, K] @ w [K, N] for a consumer that sums split-K partials itself: add_rms_norm (the o and
    down projections, added to the residual stream next) or rope_write_kv (the q/k/v projection).

    Decode steps (T <= FUSED_NORM_MAX_TOKENS) on the kernel backends return the skinny matmul's
    unreduced split-K partials [S, T, N] float32: the consumer sums them in its one pass, so the sum
    costs no kernel of its own (XLA's own split-K GEMM runs its sum as a separate ~1.3 us kernel).
    Otherwise XLA's matmul: [T, N] in x.dtype.
    """
    if _decode_sized_kernel_step(backend, x.shape[0]):
        from pallas_kernels.rms_norm import MAX_PARTS
        from pallas_kernels.skinny_matmul import default_block_sizes, skinny_matmul_partials

        # No more partials than the norm kernel sums: a narrow model's defaults split K finer (the
        # tiny preset's 688 x 256 down projection: 43 splits of 16 rows).
        sizes = default_block_sizes(x.shape[0], x.shape[1], w.shape[1], max_splits=MAX_PARTS)
        return skinny_matmul_partials(x, w, block_sizes=sizes)
    return jnp.dot(x, w)


def add_rms_norm(x: jax.Array, delta: jax.Array | None, weight: jax.Array, *, eps: float,
                 backend: Backend | None = "auto") -> tuple[jax.Array, jax.Array]:
    """(RMSNorm(x + delta) * weight, x + delta) for x, delta [T, D] (delta None: x itself, not added;
    delta [S, T, D] float32: matmul_unreduced's partials, summed first).

    `rms_norm.add_rms_norm`'s meaning (HF Llama's rounding points). Decode steps (T <=
    FUSED_NORM_MAX_TOKENS) on the kernel backends take the one-pass Pallas kernel, one launch where
    XLA runs three (the add, the reduction and the scale, each ~1.4 us on an H200 at batch 1); longer
    steps and the CPU take the reference, which XLA fuses.
    """
    from pallas_kernels import rms_norm

    if _decode_sized_kernel_step(backend, x.shape[0]):
        if delta is None:
            return rms_norm.rms_norm(x, weight, eps=eps), x
        return rms_norm.add_rms_norm(x, delta, weight, eps=eps)
    if delta is None:
        return rms_norm.rms_norm_reference(x, weight, eps=eps), x
    return rms_norm.add_rms_norm_reference(x, delta, weight, eps=eps)
