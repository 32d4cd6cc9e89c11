"""The one place that chooses an attention backend (reference, Triton-lowered Pallas, Mosaic GPU).

Callers name what they want computed (ragged attention over the rBlock pool); this module picks
the implementation for the device. Nothing else branches on backends.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

from pallas_kernels import compat, validation
from pallas_kernels.ragged_prefill import ragged_prefill_reference

Backend = Literal["auto", "reference", "triton"]
BACKENDS = ("auto", "reference", "triton")


def kernels_support(head_dim: int) -> bool:
    return head_dim in validation.SUPPORTED_HEAD_DIMS


def resolve_backend(backend: Backend | None = "auto", head_dim: int | None = None) -> str:
    """'auto' is the Triton-lowered kernels on a GPU and the pure-jnp reference elsewhere.

    On the CPU the Pallas kernels run only in interpret mode, far slower than the reference,
    so the CPU uses them in kernel tests, not in the model. Shapes the kernels do not support
    (head_dim outside SUPPORTED_HEAD_DIMS) also take the reference under 'auto'; naming
    'triton' for them raises.
    """
    backend = backend or "auto"
    if backend not in BACKENDS:
        raise ValueError(f"attention backend {backend!r} is not one of {BACKENDS}")
    if backend == "auto":
        supported = head_dim is None or kernels_support(head_dim)
        return "triton" if compat.on_gpu() and supported else "reference"
    return backend


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
    backend: Backend | None = "auto",
) -> jax.Array:
    """Causal attention of packed query tokens [T, Hq, D] to their sequences' KV in the pool.

    `decode` (static) promises one query token per sequence (T == num_seqs,
    cu_q_lens == arange), which lets the decode kernel split long KV across programs.
    Semantics are ragged_prefill_reference's.
    """
    backend = resolve_backend(backend, q.shape[-1])
    if backend == "triton":
        if decode:
            from pallas_kernels.ragged_decode import ragged_decode

            return ragged_decode(q, k_pool, v_pool, block_tables, kv_lens, k_scale=k_scale, v_scale=v_scale)
        from pallas_kernels.ragged_prefill import ragged_prefill

        return ragged_prefill(q, k_pool, v_pool, block_tables, kv_lens, cu_q_lens, k_scale=k_scale, v_scale=v_scale)
    return ragged_prefill_reference(q, k_pool, v_pool, block_tables, kv_lens, cu_q_lens,
                                    k_scale=k_scale, v_scale=v_scale)


def write_kv(k_pool, v_pool, k_new, v_new, slot_mapping, k_scale=None, v_scale=None, *,
             backend: Backend | None = "auto"):
    """Append new tokens' K/V to the pool: `kv_write.write_kv`'s meaning and results.

    Float pools on the Triton backend take the one-kernel writer; int8 pools and the reference
    backend take XLA scatters.
    """
    from pallas_kernels import kv_write

    backend = resolve_backend(backend, k_pool.shape[-1])
    if backend == "triton" and k_pool.dtype != jnp.int8:
        k_pool, v_pool = kv_write.write_kv_kernel(k_pool, v_pool, k_new, v_new, slot_mapping)
        return k_pool, v_pool, None, None
    return kv_write.write_kv(k_pool, v_pool, k_new, v_new, slot_mapping, k_scale, v_scale)
