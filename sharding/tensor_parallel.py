"""Single-device kernels run per tensor shard, inside `shard_map`, within a step jitted over the mesh.

XLA partitions the jnp parts of a step from its arrays' shardings (rules.py), but a Pallas kernel is
a custom call it cannot look inside: given sharded operands it would gather them whole onto every device.
Wrapped here, each device runs the kernel on its own KV heads and their query heads, which need nothing
from other devices (a KV-head group is never split: rules.py), so the wrappers add no collective.

`jax.shard_map(..., check_vma=False)` is the same in jax 0.10.2 and 0.11.2 (check_vma off: a Pallas
call declares no varying-axes information for the checker to follow).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from sharding.mesh import TENSOR, tensor_size

# [tokens, heads, ...] and [blocks, kv_heads, ...]: split on axis 1. Tables and lengths: whole everywhere.
_HEADS = P(None, TENSOR)
_WHOLE = P()


def per_tensor_shard(fn: Callable, mesh: Mesh, in_specs, out_specs) -> Callable:
    """`fn` (a single-device function of local shards) as a function of the global arrays on `mesh`.

    Inside an engine step of several instances the step already runs per instance (a shard_map manual over
    `instance`): this one then goes manual over `tensor` only, on the mesh of that context."""
    context = jax.sharding.get_abstract_mesh()
    if not context.empty and context.manual_axes:
        return jax.shard_map(fn, mesh=context, in_specs=in_specs, out_specs=out_specs, axis_names={TENSOR},
                             check_vma=False)
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


def tensor_parallel_attention(attention: Callable, mesh: Mesh) -> Callable:
    """Wrap a single-device ragged attention with `dispatch.ragged_attention`'s signature to run per shard.

    Each device attends with its Hq / N query heads to its Hkv / N KV heads: q [T, Hq, hd] and the
    pool k, v [blocks, Hkv, block, hd] (int8 scales [blocks, Hkv, block]) split on heads, the rBlock
    tables, lengths and query_starts whole; residuals (return_residuals) split on heads like the output. The query heads of KV head h are h*G .. h*G + G - 1, so a contiguous cut of
    both head axes keeps each group together. N must divide Hkv (replicate KV heads first: rules.py).
    Returns [T, Hq, hd] split on heads, as a row-parallel o projection wants it.
    """
    n = tensor_size(mesh)

    def wrapped(q, k_pool, v_pool, block_tables, kv_lens, cu_q_lens, *, single_query: bool, k_scale=None,
                v_scale=None, num_q_heads: int | None = None, query_starts=None, return_residuals: bool = False, **kwargs):
        if q.ndim == 4:
            # Grouped per KV head [T, Hkv, Gh, hd] (the model's rope_write_kv output): the head axis is
            # the KV-head axis, so a split keeps whole groups; each device reads num_q_heads / N of them.
            hq = num_q_heads if num_q_heads is not None else q.shape[1] * q.shape[2]
        else:
            if num_q_heads is not None and q.shape[1] != num_q_heads:
                q = q[:, :num_q_heads]  # a fused q|k|v input keeps its query heads first
            hq = q.shape[1]
        hkv = k_pool.shape[1]
        if hkv % n or hq % n or (q.ndim == 4 and q.shape[1] % n):
            raise ValueError(f"tensor parallel attention over {n} devices needs {hq} query and {hkv} KV heads "
                             f"divisible by {n}; replicate KV heads first (sharding.rules.prepare_tensor_parallel)")
        local_heads = hq // n

        def local(q, k_pool, v_pool, k_scale, v_scale, block_tables, kv_lens, cu_q_lens, query_starts):
            return attention(q, k_pool, v_pool, block_tables, kv_lens, cu_q_lens, single_query=single_query,
                             k_scale=k_scale, v_scale=v_scale, num_q_heads=local_heads, query_starts=query_starts,
                             return_residuals=return_residuals, **kwargs)

        specs = (_HEADS, _HEADS, _HEADS, _HEADS, _HEADS, _WHOLE, _WHOLE, _WHOLE, _WHOLE)
        # Residuals [T, Hq] are split on heads like the output.
        out_specs = (_HEADS, (_HEADS, _HEADS)) if return_residuals else _HEADS
        return per_tensor_shard(local, mesh, specs, out_specs)(q, k_pool, v_pool, k_scale, v_scale, block_tables,
                                                                kv_lens, cu_q_lens, query_starts)

    return wrapped


def tensor_parallel_rope_write_kv(rope_write_kv: Callable, mesh: Mesh) -> Callable:
    """Wrap a single-device RoPE + KV write over the per-KV-head q/k/v layout to run per shard.

    qkv [T, Hkv, G + 2, hd] (never split-K partials: on a mesh dispatch.matmul_unreduced is XLA's matmul), the
    pools and scales split on KV heads, cos/sin and slot_mapping whole. `rope_write_kv(k_pool, v_pool,
    qkv, cos, sin, slot_mapping, k_scale, v_scale, **kwargs)` returns (q, k_pool, v_pool, k_scale, v_scale)
    with q [T, Hkv, ...] per KV head; all outputs stay split on their KV-head axis.
    """

    def wrapped(k_pool, v_pool, qkv, cos, sin, slot_mapping, k_scale=None, v_scale=None, **kwargs):
        if qkv.ndim != 4:
            raise ValueError(f"tensor parallel RoPE + KV write takes qkv [T, Hkv, G + 2, hd], got {qkv.shape}")

        def local(k_pool, v_pool, qkv, cos, sin, slot_mapping, k_scale, v_scale):
            return rope_write_kv(k_pool, v_pool, qkv, cos, sin, slot_mapping, k_scale, v_scale, **kwargs)

        in_specs = (_HEADS, _HEADS, _HEADS, _WHOLE, _WHOLE, _WHOLE, _HEADS, _HEADS)
        out_specs = (_HEADS, _HEADS, _HEADS, _HEADS, _HEADS)
        return per_tensor_shard(local, mesh, in_specs, out_specs)(k_pool, v_pool, qkv, cos, sin, slot_mapping,
                                                                  k_scale, v_scale)

    return wrapped


def replicated_add_rms_norm(add_rms_norm: Callable, mesh: Mesh) -> Callable:
    """Wrap a single-device add + RMSNorm (`dispatch.add_rms_norm`'s signature, delta [T, D] or None) to run on
    every device over the whole rows: x, delta and the weight are replicated (XLA all-reduces a row-parallel
    projection's partials on the way in), and so are both outputs. Every device computes the same rows, as
    XLA's own partitioning of the norm does, in one kernel instead of XLA's three."""

    def wrapped(x, delta, weight):
        if delta is None:
            return per_tensor_shard(lambda x, w: add_rms_norm(x, None, w), mesh, (_WHOLE, _WHOLE),
                                    (_WHOLE, _WHOLE))(x, weight)
        return per_tensor_shard(add_rms_norm, mesh, (_WHOLE, _WHOLE, _WHOLE), (_WHOLE, _WHOLE))(x, delta, weight)

    return wrapped


@dataclasses.dataclass(frozen=True)
class TensorShards:
    """How a step's kernels run on a mesh: `pallas_kernels.dispatch` applies it (Kernels.per_shard) to the
    attention and RoPE + KV-write kernels, which then run per device inside shard_map over `tensor`, and to
    the decode layer's add + RMSNorm, which runs on every device over the replicated rows.

    Frozen and hashable (the mesh is), so the Kernels holding it stay a static jit argument.
    """

    mesh: Mesh

    def attention(self, attention: Callable) -> Callable:
        return tensor_parallel_attention(attention, self.mesh)

    def rope_write_kv(self, rope_write_kv: Callable) -> Callable:
        return tensor_parallel_rope_write_kv(rope_write_kv, self.mesh)

    def add_rms_norm(self, add_rms_norm: Callable) -> Callable:
        return replicated_add_rms_norm(add_rms_norm, self.mesh)


def tensor_parallel_kernels(kernels, mesh: Mesh):
    """`kernels` (a pallas_kernels.dispatch.Kernels) for a step jitted over `mesh`.

    Tensor parallel 1: unchanged. Otherwise the Pallas kernels run per device (per_shard): attention and
    RoPE + KV write on each device's heads, the decode layer's add + RMSNorm on every device over the
    replicated rows; under the pure-jnp reference nothing is wrapped: XLA partitions it from the
    shardings. The matmuls stay XLA's (dispatch.matmul_unreduced): a row-parallel projection's
    partials are also partial over the tensor axis, which only an all-reduce in between can sum, so
    XLA's partitioned matmul (all-reduce included) feeds the norm. At 13B over 4 H200s, XLA's norm was
    three kernels twice a layer (benchmarks/NOTES.md).
    """
    if tensor_size(mesh) == 1:
        return kernels
    pallas = kernels.decode_attention != "reference" or kernels.prefill_attention != "reference" or \
        kernels.rope_kv_write != "reference" or kernels.decode_layer != "reference"
    return dataclasses.replace(kernels, per_shard=TensorShards(mesh) if pallas else None)
