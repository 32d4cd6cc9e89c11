"""Ragged decode: one query token per sequence attending to its whole KV in the rBlock pool.

Sequences of any lengths share one call. The wrapper cuts every sequence's real KV into chunks of
`tokens_per_split` tokens and lists them as work items `(sequence, first token, token count)`;
the kernel grid runs over `(work item, kv_head)`, so a batch of one 500K sequence and a batch of
mixed 1K..500K lengths both spread evenly over the GPU, and no program touches padding. Each
program reads its rBlocks straight from the pool through the block table (nothing is gathered,
copied or transposed), processes all query heads of one KV head's group together (one read of
K and V per group), and writes a partial `(out, row_max, row_sum)`; `residuals.merge_partial_runs`
(one more small kernel) then merges each sequence's consecutive partials exactly and writes the
output in the layout the output projection reads. Nothing else runs per call but a few tiny
fusions building the work list from kv_lens, which XLA computes once for all layers of a step.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import compat
from pallas_kernels.ragged_prefill import ragged_prefill_reference
from pallas_kernels.residuals import merge_partial_runs, parts_per_merge_load
# check_ragged_decode_args is re-exported: callers import it from here.
from pallas_kernels.validation import MIN_DOT_ROWS, check_dot_tile, check_launch, check_ragged_decode_args, is_pow2

# Scores of keys past the end: finite, so no exp(-inf - -inf) NaN, and exp(mask - max) is 0.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


@dataclasses.dataclass(frozen=True)
class DecodeBlockSizes:
    """Schedule of the decode kernel.

    block_k: KV tokens per kernel iteration (clipped to the rBlock size's largest power-of-two factor).
    tokens_per_split: KV tokens per work item (a power of two, fixed); None (the default) picks it on the
      device from the real lengths of each call: the smallest power of two (>= min_tokens_per_split)
      that cuts the batch's real KV into at most about `target_programs` programs (work items x KV
      heads). The grid is then bounded by target_programs / kv_heads + num_seqs items whatever the
      table width, a lone 32K sequence still gets ~target_programs programs (a split fixed by the
      table's capacity gave it 2 per head when the table was sized for 128K), and a ragged batch is
      cut into equal chunks. On an H200 a ragged batch of 16 (1K..256K) read 4.05 TB/s with ~1000
      programs and 2.90 with ~256 (benchmarks/results/nvidia-h200-2026-11-22-attention*.json).
    num_warps, num_stages: Triton launch parameters (num_stages pipelines the K/V loads).

    Defaults from an H200 sweep (scripts/check_ragged_decode_gpu.py --sweep, 2026-11-22): block_k 64
    with 4 stages matched or beat 128 x 2 stages at 32K / 128K / batch 8 (137 vs 141 us at 32K); a
    minimum split of 128 tokens gives a 1K sequence 8 programs per head instead of 2 (512), which
    were too few to fill the GPU.
    """

    block_k: int = 64
    tokens_per_split: int | None = None
    target_programs: int = 1024
    min_tokens_per_split: int = 128
    num_warps: int = 4
    num_stages: int = 4

    def __post_init__(self):
        check_dot_tile("block_k", self.block_k)
        if self.tokens_per_split is not None and (not is_pow2(self.tokens_per_split)
                                                  or self.tokens_per_split < self.block_k):
            raise ValueError(f"tokens_per_split {self.tokens_per_split} must be a power of two >= block_k "
                             f"{self.block_k}")
        if self.target_programs < 1:
            raise ValueError(f"target_programs {self.target_programs} must be >= 1")
        if not is_pow2(self.min_tokens_per_split):
            raise ValueError(f"min_tokens_per_split {self.min_tokens_per_split} must be a power of two")
        check_launch(self.num_warps, self.num_stages)

    def tile(self, block_size: int) -> int:
        """Tokens per kernel iteration: a power of two dividing both block_k and the rBlock size."""
        return math.gcd(self.block_k, block_size)

    def num_items(self, block_size: int, num_seqs: int, capacity: int, num_kv_heads: int) -> int:
        """Static bound on work items: every chunk of every sequence fits."""
        if self.tokens_per_split is not None:
            return num_seqs * pl.cdiv(capacity, self.tokens_per_split)
        # sum_i ceil(len_i / split) <= total / split + num_seqs, and split >= total * heads / target.
        return min(num_seqs * pl.cdiv(capacity, self._min_split(block_size)),
                   pl.cdiv(self.target_programs, num_kv_heads) + num_seqs)

    def _min_split(self, block_size: int) -> int:
        return max(self.tile(block_size), self.min_tokens_per_split)

    def split(self, block_size: int, kv_lens: jax.Array, num_kv_heads: int) -> jax.Array:
        """Tokens per work item (int32 scalar, a multiple of the tile)."""
        if self.tokens_per_split is not None:
            return jnp.int32(self.tokens_per_split)
        tile = self.tile(block_size)
        total = jnp.sum(kv_lens.astype(jnp.int32))
        # Not rounded to a power of two: just past one (128K + a few tokens) that would halve the programs.
        want = pl.cdiv(total * num_kv_heads, self.target_programs)
        split = pl.cdiv(want, tile) * tile
        return jnp.maximum(split, self._min_split(block_size)).astype(jnp.int32)


# int8 KV at 128K on an H200 (scripts/check_ragged_decode_gpu.py --int8-sweep,
# benchmarks/results/nvidia-h200-2026-11-22-0236-ragged-decode-int8-sweep.json): 128-token tiles x 3
# stages 497 us, the bf16 default (64 x 4) 535, 256-token tiles 740-764, 8 warps 605. The int8 kernel
# is bound by dequantising, not by bytes (2.2 TB/s of int8 KV + scales).
INT8_BLOCK_SIZES = DecodeBlockSizes(block_k=128, num_stages=3)


def default_block_sizes(kv_dtype) -> DecodeBlockSizes:
    """The measured-best schedule for a KV pool dtype."""
    return INT8_BLOCK_SIZES if jnp.dtype(kv_dtype) == jnp.int8 else DecodeBlockSizes()


def _decode_kernel(
    work_seq_ref,  # [num_items] int32
    work_start_ref,  # [num_items] int32
    work_count_ref,  # [num_items] int32, 0 for padding items
    block_tables_ref,  # [num_seqs, max_blocks]
    q_ref,  # [num_seqs, num_kv_heads, group_rows, head_dim]
    k_ref,  # [num_blocks, num_kv_heads, block_size, head_dim]
    v_ref,  # [num_blocks, num_kv_heads, block_size, head_dim]
    *refs,  # (k_scale_ref, v_scale_ref [num_blocks, num_kv_heads, block_size])?, o_ref [group_rows, head_dim],
    #         m_ref [group_rows], l_ref [group_rows]
    sm_scale: float,
    tile: int,
    block_size: int,
    quantized: bool,
    compute_dtype,
    group: int,
):
    if quantized:
        k_scale_ref, v_scale_ref, o_ref, m_ref, l_ref = refs
    else:
        o_ref, m_ref, l_ref = refs
    item, head = pl.program_id(0), pl.program_id(1)
    count = work_count_ref[item]
    group_rows, head_dim = o_ref.shape
    precision = jax.lax.Precision.HIGHEST if compute_dtype == jnp.float32 else None

    @pl.when(count > 0)
    def _():
        seq = work_seq_ref[item]
        start = work_start_ref[item]
        q = q_ref[seq, head]  # [group_rows, head_dim]
        offsets = jnp.arange(tile, dtype=jnp.int32)

        def body(j, carry):
            o, m, l = carry
            pos = start + j * tile
            block = block_tables_ref[seq, pos // block_size]
            rows = pl.ds(pos % block_size, tile)
            valid = j * tile + offsets < count  # [tile]
            k = k_ref[block, head, rows, :].astype(compute_dtype)  # [tile, head_dim]
            s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                                    preferred_element_type=jnp.float32)  # [group_rows, tile]
            if quantized:
                s = s * k_scale_ref[block, head, rows][None, :]
            s = jnp.where(valid[None, :], s * sm_scale, MASK_VALUE)
            m_new = jnp.maximum(m, jnp.max(s, axis=1))
            correction = jnp.exp(m - m_new)
            p = jnp.exp(s - m_new[:, None])  # [group_rows, tile]
            l = correction * l + jnp.sum(p, axis=1)
            # Rows past the end may hold anything (NaN included): 0 * NaN must not reach the sum.
            v = jnp.where(valid[:, None], v_ref[block, head, rows, :], 0).astype(compute_dtype)  # [tile, head_dim]
            if quantized:
                p = p * jnp.where(valid, v_scale_ref[block, head, rows], 0.0)[None, :]
            pv = jax.lax.dot_general(p.astype(compute_dtype), v, (((1,), (0,)), ((), ())), precision=precision,
                                     preferred_element_type=jnp.float32)  # [group_rows, head_dim]
            return correction[:, None] * o + pv, m_new, l

        init = (jnp.zeros((group_rows, head_dim), jnp.float32),
                jnp.full((group_rows,), -jnp.inf, jnp.float32),
                jnp.zeros((group_rows,), jnp.float32))
        o, m, l = jax.lax.fori_loop(0, pl.cdiv(count, tile), body, init)
        # Only the group's real rows: the padding rows of tl.dot would be 16x the bytes for MHA.
        real = jnp.arange(group_rows, dtype=jnp.int32) < group
        compat.triton_masked_store(o_ref, o / l[:, None], real[:, None])
        compat.triton_masked_store(m_ref, m, real)
        compat.triton_masked_store(l_ref, l, real)


def _work_list(kv_lens: jax.Array, num_items: int, split: jax.Array):
    """Chunks of `split` tokens over each sequence's real KV, in sequence order, padded to num_items.

    Returns (sequence [N], first token [N], token count [N] (0 past the real items), first item of
    each sequence [S], items of each sequence [S]).
    """
    num_seqs = kv_lens.shape[0]
    chunks = (kv_lens + split - 1) // split  # [S]
    ends = jnp.cumsum(chunks)
    j = jnp.arange(num_items, dtype=jnp.int32)
    # Item j belongs to the sequence whose chunks span it: the number of sequences ending at or
    # before j. A scatter and a prefix sum (searchsorted would be a loop on the device).
    seq = jnp.cumsum(jnp.zeros(num_items, jnp.int32).at[ends].add(1, mode="drop"))
    seq = jnp.minimum(seq, num_seqs - 1).astype(jnp.int32)
    real = j < ends[-1]
    start = (j - (ends[seq] - chunks[seq])) * split
    count = jnp.where(real, jnp.minimum(split, kv_lens[seq] - start), 0).astype(jnp.int32)
    start = jnp.where(real, start, 0).astype(jnp.int32)
    return seq, start, count, (ends - chunks).astype(jnp.int32), chunks.astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("sm_scale", "return_residuals", "block_sizes", "interpret"))
def _ragged_decode(q, k_pool, v_pool, block_tables, kv_lens, k_scale, v_scale, *, sm_scale, return_residuals,
                   block_sizes, interpret):
    num_seqs, num_q_heads, head_dim = q.shape
    _, num_kv_heads, block_size, _ = k_pool.shape
    group = num_q_heads // num_kv_heads
    group_rows = max(MIN_DOT_ROWS, 1 << (group - 1).bit_length())
    quantized = k_pool.dtype == jnp.int8
    compute_dtype = q.dtype if quantized else jnp.promote_types(q.dtype, k_pool.dtype)
    tile = block_sizes.tile(block_size)
    num_items = block_sizes.num_items(block_size, num_seqs, block_tables.shape[1] * block_size, num_kv_heads)
    split = block_sizes.split(block_size, kv_lens, num_kv_heads)

    kv_lens = kv_lens.astype(jnp.int32)
    seq, start, count, first_item, seq_items = _work_list(kv_lens, num_items, split)
    q_groups = q.astype(compute_dtype).reshape(num_seqs, num_kv_heads, group, head_dim)
    q_groups = jnp.pad(q_groups, ((0, 0), (0, 0), (0, group_rows - group), (0, 0)))  # [S, Hkv, rows, D]

    kernel = functools.partial(_decode_kernel, sm_scale=sm_scale, tile=tile, block_size=block_size,
                               quantized=quantized, compute_dtype=compute_dtype, group=group)
    scales = (k_scale.astype(jnp.float32), v_scale.astype(jnp.float32)) if quantized else ()
    merged_rows = 1 << (group - 1).bit_length()  # Triton loads power-of-two shapes
    # Room past the last item for the merge's whole-chunk loads (never written, never used).
    num_parts = num_items + parts_per_merge_load(merged_rows)
    whole = pl.no_block_spec  # pools and tables are indexed inside the kernel, never sliced by a BlockSpec
    o, m, l = pl.pallas_call(
        kernel,
        grid=(num_items, num_kv_heads),
        in_specs=[whole] * (7 + len(scales)),
        out_specs=[
            pl.BlockSpec((None, None, group_rows, head_dim), lambda i, h: (i, h, 0, 0)),
            pl.BlockSpec((None, None, group_rows), lambda i, h: (i, h, 0)),
            pl.BlockSpec((None, None, group_rows), lambda i, h: (i, h, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((num_parts, num_kv_heads, group_rows, head_dim), jnp.float32),
            jax.ShapeDtypeStruct((num_parts, num_kv_heads, group_rows), jnp.float32),
            jax.ShapeDtypeStruct((num_parts, num_kv_heads, group_rows), jnp.float32),
        ],
        compiler_params=compat.triton_compiler_params(block_sizes.num_warps, block_sizes.num_stages),
        interpret=interpret,
        name="ragged_decode",
    )(seq, start, count, block_tables.astype(jnp.int32), q_groups, k_pool, v_pool, *scales)

    # Padding items and padding rows were never written; the merge reads neither.
    out, row_max, row_sum = merge_partial_runs(o, m, l, first_item, seq_items, rows=merged_rows, out_dtype=q.dtype,
                                               interpret=interpret)
    if merged_rows != group:
        out, row_max, row_sum = out[:, :, :group], row_max[:, :, :group], row_sum[:, :, :group]
    out = out.reshape(num_seqs, num_q_heads, head_dim)
    row_max = row_max.reshape(num_seqs, num_q_heads)
    row_sum = row_sum.reshape(num_seqs, num_q_heads)
    if return_residuals:
        return out, (row_max, row_sum)
    return out


def ragged_decode(
    q: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array,
    block_tables: jax.Array,
    kv_lens: jax.Array,
    *,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
    sm_scale: float | None = None,
    return_residuals: bool = False,
    block_sizes: DecodeBlockSizes | None = None,
    interpret: bool | None = None,
):
    """Decode attention of one query token per sequence over its KV in the rBlock pool.

    Args:
      q: [num_seqs, num_q_heads, head_dim] (float32, bfloat16 or float16).
      k_pool, v_pool: [num_blocks, num_kv_heads, block_size, head_dim] (float, or int8 with scales);
        block_size a multiple of 16; num_q_heads a multiple of num_kv_heads (MHA, GQA, MQA).
      block_tables: [num_seqs, max_blocks_per_seq] int32 rBlock ids.
      kv_lens: [num_seqs] int32, KV tokens of each sequence (the new token's included); 0 gives out 0.
      k_scale, v_scale: [num_blocks, num_kv_heads, block_size] float32 for int8 pools.
      sm_scale: softmax scale, default 1/sqrt(head_dim).
      return_residuals: also return the row max and row sum of exponentials.
      block_sizes: kernel schedule (default: default_block_sizes(k_pool.dtype)).
      interpret: run the kernel in the Pallas interpreter; None means on unless on a GPU.

    Returns:
      out [num_seqs, num_q_heads, head_dim] in q.dtype, and with residuals
      `(out, (row_max, row_sum))`, each [num_seqs, num_q_heads] float32 (-inf and 0 where kv_len is 0).
    """
    check_ragged_decode_args(q, k_pool, v_pool, block_tables, kv_lens, k_scale, v_scale)
    interpret = compat.default_interpret(interpret)
    if sm_scale is None:
        sm_scale = q.shape[-1] ** -0.5
    block_sizes = block_sizes or default_block_sizes(k_pool.dtype)
    return _ragged_decode(q, k_pool, v_pool, block_tables, kv_lens, k_scale, v_scale, sm_scale=float(sm_scale),
                          return_residuals=return_residuals, block_sizes=block_sizes, interpret=interpret)


def ragged_decode_reference(
    q: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array,
    block_tables: jax.Array,
    kv_lens: jax.Array,
    *,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
    sm_scale: float | None = None,
    return_residuals: bool = False,
):
    """Pure-jnp decode attention (float32): ragged prefill with one query token per sequence.

    Same arguments and results as `ragged_decode`.
    """
    num_seqs = q.shape[0]
    cu_q_lens = jnp.arange(num_seqs + 1, dtype=jnp.int32)
    # A sequence with kv_len 0 has no key for its token: the prefill reference would place it at
    # position -1; a masked-out row gives the same out 0, max -inf, sum 0.
    return ragged_prefill_reference(q, k_pool, v_pool, block_tables, kv_lens, cu_q_lens, k_scale=k_scale,
                                    v_scale=v_scale, sm_scale=sm_scale, return_residuals=return_residuals)
