"""Ragged decode: one query token per sequence attending to its whole KV in the rBlock pool.

Sequences of any lengths share one call, and one call is one kernel. Every sequence's real KV is
cut into work items of about `split` tokens (the split chosen from the batch's total length, so a
batch of one 500K sequence and a batch of mixed 1K..500K lengths both spread evenly over the GPU
and no program touches padding); the grid runs over `work item x kv_head` (head fastest) and each program
works out its own item from kv_lens. Each program reads its rBlocks straight from the pool through the
block table (nothing is gathered, copied or transposed), processes all query heads of one KV head's
group together (one read of K and V per group; the group's query rows are read in place, from a q
grouped per KV head that may hold more rows a group than it uses: the model's rotated q|k), and either writes the result (a sequence with one item) or a
partial `(out, row_max, row_sum)`; the last program of a sequence and head to finish (an atomic
arrival counter) merges that sequence's partials exactly with `residuals.merge_run` and writes the
output in the layout the output projection reads. A sequence with more items than MERGE_LOADS_PER_RUN
loads of partials is merged in two levels (runs of consecutive items, then the runs), so the serial
merge stays short where few KV heads split each sequence hundreds of ways (a tensor shard of a GQA model).
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
from pallas_kernels.residuals import merge_run, parts_per_merge_load
from pallas_kernels.validation import MIN_DOT_ROWS, check_dot_tile, check_launch, check_ragged_decode_args, is_pow2

# A split sequence's partials are merged in runs of this many merge_run loads (parts_per_merge_load parts
# each) when it has more: a run's last program merges the run, the last run's merger merges the runs.
MERGE_LOADS_PER_RUN = 4

# A sequence is cut into about target_programs / KV heads work items a head, and each (sequence, head)'s
# partials are merged by its last program. With few KV heads a device (a tensor shard of a GQA model: 2 at 70B
# over 4 GPUs) that is hundreds of items a head, whose merge and start-up cost more than their KV: at 2 heads
# and 128K, 55 us at 1024 programs, 49 at 512 (benchmarks/NOTES.md). So at most this many items a head. The cap
# binds only below 8 KV heads for every tuner candidate (targets <= 2048): one-GPU Llama shapes are unchanged.
MAX_ITEMS_PER_HEAD = 256

# Scores of keys past the end: finite, so no exp(-inf - -inf) NaN, and exp(mask - max) is 0.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


@dataclasses.dataclass(frozen=True)
class DecodeBlockSizes:
    """Schedule of the decode kernel.

    block_k: KV tokens per kernel iteration (clipped to the rBlock size's largest power-of-two factor).
    tokens_per_split: about how many KV tokens a work item takes (a power of two, fixed); None (the
      default) picks it on the device from the real lengths of each call: total real KV x KV heads /
      target_programs (>= min_tokens_per_split, see short_target_programs). Sequence s gets
      ceil(len_s / split) items (at least 1) and its tiles are dealt out evenly among them (sizes
      differ by at most one tile). The grid is
      then bounded by target_programs / kv_heads + num_seqs items whatever the table width, so a lone
      sequence still fills the GPU and a ragged batch is cut into equal chunks (benchmarks/NOTES.md).
    target_programs: about how many programs (work items x KV heads) a call aims for; at most
      MAX_ITEMS_PER_HEAD x KV heads (`programs`), and so is short_target_programs.
    min_tokens_per_split: no item shorter than this (a power of two), unless the call is short: then
      items shrink, down to one tile, so that about short_target_programs programs still run.
    short_target_programs: programs a short call (total KV x heads < target_programs x
      min_tokens_per_split, e.g. one sequence under 8K with 32 KV heads) aims for. Short calls are latency-bound:
      more, shorter items win there (sweeps in benchmarks/NOTES.md, ragged_decode).
    num_warps, num_stages: Triton launch parameters (num_stages pipelines the K/V loads).
    int8_via_fp16: int8 KV is turned into float16 with integer ops (x + 128 in the mantissa of
      1024.0, minus 1152: exact) instead of int-to-float conversions, and the dots run in float16.

    The defaults are the best of sweeps on an H200 (scripts/check_ragged_decode_gpu.py; figures in
    benchmarks/NOTES.md, ragged_decode).
    """

    block_k: int = 64
    tokens_per_split: int | None = None
    target_programs: int = 1024
    min_tokens_per_split: int = 256
    short_target_programs: int = 512
    num_warps: int = 4
    num_stages: int = 4
    int8_via_fp16: bool = False

    def __post_init__(self):
        check_dot_tile("block_k", self.block_k)
        if self.tokens_per_split is not None and (not is_pow2(self.tokens_per_split)
                                                  or self.tokens_per_split < self.block_k):
            raise ValueError(f"tokens_per_split {self.tokens_per_split} must be a power of two >= block_k "
                             f"{self.block_k}")
        for name in ("target_programs", "short_target_programs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} {getattr(self, name)} must be >= 1")
        if not is_pow2(self.min_tokens_per_split):
            raise ValueError(f"min_tokens_per_split {self.min_tokens_per_split} must be a power of two")
        check_launch(self.num_warps, self.num_stages)

    def tile(self, block_size: int) -> int:
        """Tokens per kernel iteration: a power of two dividing both block_k and the rBlock size."""
        return math.gcd(self.block_k, block_size)

    def programs(self, num_kv_heads: int) -> tuple[int, int]:
        """(target_programs, short_target_programs) at num_kv_heads KV heads: each at most MAX_ITEMS_PER_HEAD
        items a head."""
        cap = MAX_ITEMS_PER_HEAD * num_kv_heads
        return min(self.target_programs, cap), min(self.short_target_programs, cap)

    def _most_programs(self, num_kv_heads: int) -> int:
        """The larger of the two program targets, which the static item bounds divide among the KV heads."""
        return max(self.programs(num_kv_heads))

    def num_items(self, block_size: int, num_seqs: int, capacity: int, num_kv_heads: int) -> int:
        """Static bound on work items: every chunk of every sequence fits."""
        if self.tokens_per_split is not None:
            return num_seqs * pl.cdiv(capacity, self.tokens_per_split)
        # sum_i max(ceil(len_i / split), 1) <= total / split + num_seqs, and split >= total * heads / target
        # (both targets), and split >= one tile.
        return min(num_seqs * pl.cdiv(capacity, self.tile(block_size)),
                   pl.cdiv(self._most_programs(num_kv_heads), num_kv_heads) + num_seqs)

    def items_per_sequence(self, block_size: int, capacity: int, num_kv_heads: int) -> int:
        """Static bound on one sequence's work items (at most `capacity` tokens): ceil(len / split) with split
        >= one tile, and split >= len * heads / target (len is part of the total)."""
        if self.tokens_per_split is not None:
            return pl.cdiv(capacity, self.tokens_per_split)
        return min(pl.cdiv(capacity, self.tile(block_size)),
                   pl.cdiv(self._most_programs(num_kv_heads), num_kv_heads) + 1)

    def split(self, block_size: int, kv_lens: jax.Array, num_kv_heads: int) -> jax.Array:
        """Most tokens per work item before a sequence takes one more (int32 scalar, >= one tile)."""
        if self.tokens_per_split is not None:
            return jnp.int32(self.tokens_per_split)
        work = jnp.sum(kv_lens.astype(jnp.int32)) * num_kv_heads
        return self.split_for_work(work, self.tile(block_size), num_kv_heads, jnp.maximum, jnp.minimum,
                                   pl.cdiv).astype(jnp.int32)

    def split_for_work(self, work, tile: int, num_kv_heads: int, maximum=max, minimum=min,
                       cdiv=lambda a, b: -(-a // b)):
        """split() from work = total KV tokens x KV heads, the tile (`tile(block_size)`) and the KV heads: a
        traced scalar with jnp.maximum / jnp.minimum / pl.cdiv (what the kernel runs), or a Python int with the
        defaults (the AutoTuner's features compute it on the host, where pl.cdiv's checks cost more than the
        rest)."""
        # Not rounded to a power of two (just past one, 128K + a few tokens, that would halve the
        # programs) nor to the tile (each sequence's tiles are dealt evenly among its items).
        target, short_target = self.programs(num_kv_heads)
        want = cdiv(work, target)
        short = maximum(cdiv(work, short_target), tile)
        floor = minimum(maximum(self.min_tokens_per_split, tile), short)
        return maximum(want, floor)


# int8 KV: larger tiles and the integer int8 -> float16 conversion were the fastest swept on an H200
# (scripts/check_ragged_decode_gpu.py --int8-sweep; figures in benchmarks/NOTES.md, ragged_decode).
# The dots then run in float16: q must fit its range (|q| < 65504), as in any float16 attention.
INT8_BLOCK_SIZES = DecodeBlockSizes(block_k=128, num_stages=4, int8_via_fp16=True)


def default_block_sizes(kv_dtype) -> DecodeBlockSizes:
    """The measured-best schedule for a KV pool dtype."""
    return INT8_BLOCK_SIZES if jnp.dtype(kv_dtype) == jnp.int8 else DecodeBlockSizes()


def _work_item(kv_lens_ref, item, *, num_seqs: int, seqs_pow2: int, block_sizes: DecodeBlockSizes, block_size: int,
               num_kv_heads: int):
    """Which KV tokens work item `item` covers, computed by the program itself from kv_lens.

    Every program recomputes the whole (tiny) work list: the split from the total length, each
    sequence's item count (at least 1, so an empty sequence still gets a program that writes its
    zeros), their prefix sum, its own sequence, and its share of that sequence's tiles (dealt out
    evenly, so a sequence's items differ by at most one tile). Nothing runs outside the kernel: a work
    list built by XLA cost ~4 small kernels per call. The cost is a few vector ops over num_seqs
    values per program: at 64-256 sequences the kernel still ran 2-7% faster than with the XLA work
    list (benchmarks/NOTES.md); thousands of sequences in one call would lengthen every program's
    prologue.

    Returns (seq, start, count, first item of seq, items of seq); seq >= num_seqs past the last item.
    """
    tile = block_sizes.tile(block_size)
    seq_ids = jnp.arange(seqs_pow2, dtype=jnp.int32)
    in_batch = seq_ids < num_seqs
    lens = compat.triton_masked_load(kv_lens_ref.at[pl.ds(0, seqs_pow2)], in_batch, 0)
    split = block_sizes.split(block_size, lens, num_kv_heads)
    chunks = jnp.where(in_batch, jnp.maximum((lens + split - 1) // split, 1), 0)
    ends = jnp.cumsum(chunks)
    # The sequence whose items span this one: the number of sequences ending at or before it.
    seq = jnp.sum((ends <= item).astype(jnp.int32))
    pick = lambda values: jnp.sum(jnp.where(seq_ids == seq, values, 0))
    seq_items = pick(chunks)
    first_item = pick(ends) - seq_items
    length = pick(lens)
    tiles = (length + tile - 1) // tile
    i, n = item - first_item, jnp.maximum(seq_items, 1)  # n is 0 only past the batch, where nothing runs
    start = (i * tiles // n) * tile
    count = jnp.minimum(((i + 1) * tiles // n) * tile, length) - start
    return seq, start, count, first_item, seq_items


def _int8_to_float16(x: jax.Array) -> jax.Array:
    """int8 -> float16, exactly, with an integer add and a bitcast: 0x6400 is 1024.0 in float16 and
    x + 128 (0..255) fills its mantissa, so the bits read as 1024 + x + 128."""
    bits = x.astype(jnp.int16) + jnp.int16(0x6400 + 128)
    return jax.lax.bitcast_convert_type(bits, jnp.float16) - jnp.float16(1152.0)


def _decode_kernel(
    kv_lens_ref,  # [num_seqs] int32
    block_tables_ref,  # [num_seqs, max_blocks]
    q_ref,  # [num_seqs * num_kv_heads * group_held, head_dim] (the first `group` rows of each KV head's are used)
    k_ref,  # [num_blocks, num_kv_heads, block_size, head_dim]
    v_ref,  # [num_blocks, num_kv_heads, block_size, head_dim]
    *refs,  # (k_scale_ref, v_scale_ref [num_blocks, num_kv_heads, block_size])?, counters_in_ref (aliased),
    #         parts_o_ref [items, Hkv, group_rows, D], parts_m_ref, parts_l_ref [items, Hkv, group_rows],
    #         (runs_o_ref, runs_m_ref, runs_l_ref: the same shapes, with fan_in)?,
    #         out_ref [num_seqs * num_q_heads, head_dim], out_m_ref, out_l_ref [num_seqs * num_q_heads],
    #         counters_ref [num_seqs (+ items with fan_in), num_kv_heads] int32
    sm_scale: float,
    tile: int,
    block_size: int,
    quantized: bool,
    compute_dtype,
    group: int,
    group_rows: int,
    merged_rows: int,
    num_seqs: int,
    seqs_pow2: int,
    group_held: int,
    block_sizes: DecodeBlockSizes,
    fan_in: int | None,
    interpret: bool,
):
    if quantized:
        k_scale_ref, v_scale_ref, *refs = refs
    parts_refs, refs = refs[1:4], refs[4:]
    if fan_in is not None:
        runs_refs, refs = refs[:3], refs[3:]
    out_ref, out_m_ref, out_l_ref, counters_ref = refs
    num_kv_heads = k_ref.shape[1]
    # One grid axis, KV head fastest: program p works on item p // Hkv of head p % Hkv, so every head's
    # first items are dispatched before any head's last, and the items the static grid bound holds
    # beyond the real ones (they exit at once) come after all the real work instead of between heads.
    item, head = pl.program_id(0) // num_kv_heads, pl.program_id(0) % num_kv_heads
    head_dim = q_ref.shape[-1]
    precision = jax.lax.Precision.HIGHEST if compute_dtype == jnp.float32 else None
    seq, start, count, first_item, seq_items = _work_item(
        kv_lens_ref, item, num_seqs=num_seqs, seqs_pow2=seqs_pow2, block_sizes=block_sizes, block_size=block_size,
        num_kv_heads=num_kv_heads)
    rows = jnp.arange(group_rows, dtype=jnp.int32)
    real = rows < group
    # This group's query rows of q: tl.dot needs >= 16 rows, the rest are masked (never read).
    first_q_row = (seq * num_kv_heads + head) * group_held
    first_row = (seq * num_kv_heads + head) * group  # of the outputs [S * Hq, ...]

    def write_final(out, m, l, n_rows):  # out normalised [n_rows, D]; rows >= group are not this group's
        out_rows = pl.ds(first_row, n_rows)
        keep = jnp.arange(n_rows, dtype=jnp.int32) < group
        compat.triton_masked_store(out_ref.at[out_rows, :], out.astype(out_ref.dtype), keep[:, None])
        compat.triton_masked_store(out_m_ref.at[out_rows], m, keep)
        compat.triton_masked_store(out_l_ref.at[out_rows], l, keep)

    @pl.when(seq < num_seqs)
    def _():
        q = compat.triton_masked_load(q_ref.at[pl.ds(first_q_row, group_rows), :], real[:, None], 0)
        q = q.astype(compute_dtype)  # [group_rows, head_dim]
        offsets = jnp.arange(tile, dtype=jnp.int32)
        fast_int8 = quantized and block_sizes.int8_via_fp16
        to_compute = _int8_to_float16 if fast_int8 else (lambda x: x.astype(compute_dtype))

        def body(j, carry):
            o, m, l = carry
            pos = start + j * tile
            block = block_tables_ref[seq, pos // block_size]
            kv_rows = pl.ds(pos % block_size, tile)
            valid = j * tile + offsets < count  # [tile]
            k = to_compute(k_ref[block, head, kv_rows, :])  # [tile, head_dim]
            s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                                    preferred_element_type=jnp.float32)  # [group_rows, tile]
            if quantized:
                s = s * k_scale_ref[block, head, kv_rows][None, :]
            s = jnp.where(valid[None, :], s * sm_scale, MASK_VALUE)
            m_new = jnp.maximum(m, jnp.max(s, axis=1))
            correction = jnp.exp(m - m_new)
            p = jnp.exp(s - m_new[:, None])  # [group_rows, tile]
            l = correction * l + jnp.sum(p, axis=1)
            # Rows past the end may hold anything (NaN included): 0 * NaN must not reach the sum.
            v = to_compute(jnp.where(valid[:, None], v_ref[block, head, kv_rows, :], 0))  # [tile, head_dim]
            if quantized:
                p = p * jnp.where(valid, v_scale_ref[block, head, kv_rows], 0.0)[None, :]
            pv = jax.lax.dot_general(p.astype(compute_dtype), v, (((1,), (0,)), ((), ())), precision=precision,
                                     preferred_element_type=jnp.float32)  # [group_rows, head_dim]
            return correction[:, None] * o + pv, m_new, l

        init = (jnp.zeros((group_rows, head_dim), jnp.float32),
                jnp.full((group_rows,), -jnp.inf, jnp.float32),
                jnp.zeros((group_rows,), jnp.float32))
        o, m, l = jax.lax.fori_loop(0, pl.cdiv(count, tile), body, init)

        @pl.when(seq_items == 1)
        def _():  # the whole sequence in one program (or none of it: kv_len 0 gives out 0, max -inf, sum 0)
            write_final(o / jnp.where(l > 0, l, 1.0)[:, None], m, l, group_rows)

        @pl.when(seq_items > 1)
        def _():
            def store_part(refs, at, out, m, l, n_rows):  # a normalised partial (out, row max, row sum)
                o_ref, m_ref, l_ref = refs
                keep = jnp.arange(n_rows, dtype=jnp.int32) < group
                compat.triton_masked_store(o_ref.at[at, head, pl.ds(0, n_rows)], out, keep[:, None])
                compat.triton_masked_store(m_ref.at[at, head, pl.ds(0, n_rows)], m, keep)
                compat.triton_masked_store(l_ref.at[at, head, pl.ds(0, n_rows)], l, keep)

            def last_merges(counter, arrivals, refs, first, num, then):
                # Every thread's stores before the release; the program that arrives last at `counter`
                # sees all of them after its acquire, merges parts first .. first + num - 1 of `refs`,
                # re-arms the counter and hands the result to then(out, row_max, row_sum).
                compat.triton_barrier(interpret)
                arrived = compat.triton_atomic_add(counters_ref, (counter, head), 1)

                @pl.when(arrived == arrivals - 1)
                def _():
                    merged = merge_run(*refs, first, num, head, rows=merged_rows, real_rows=group, coherent=True)
                    counters_ref[counter, head] = jnp.int32(0)
                    then(*merged)

            # Only the group's real rows: the padding rows of tl.dot would be 16x the bytes for MHA.
            store_part(parts_refs, item, o / l[:, None], m, l, group_rows)
            final = lambda out, m, l: write_final(out, m, l, merged_rows)  # noqa: E731
            one_level = lambda: last_merges(seq, seq_items, parts_refs, first_item, seq_items, final)  # noqa: E731
            if fan_in is None:
                one_level()
            else:
                # Two levels: a run of fan_in consecutive items is merged by its last to arrive, into
                # runs[first_item + run]; the sequence's runs by the last run merger. One merger reading
                # hundreds of partials one load after another (a few KV heads, GQA groups of 8: 4 parts
                # a load) took longer than reading the KV.
                runs = (seq_items + fan_in - 1) // fan_in
                run = (item - first_item) // fan_in
                run_first = first_item + run * fan_in
                run_items = jnp.minimum(fan_in, seq_items - run * fan_in)

                pl.when(runs == 1)(one_level)

                def merged_run(out, m, l):
                    store_part(runs_refs, first_item + run, out, m, l, merged_rows)
                    last_merges(seq, runs, runs_refs, first_item, runs, final)

                @pl.when(runs > 1)
                def _():
                    last_merges(num_seqs + first_item + run, run_items, parts_refs, run_first, run_items,
                                merged_run)


@functools.partial(jax.jit, static_argnames=("num_q_heads", "sm_scale", "return_residuals", "block_sizes",
                                             "interpret"))
def _ragged_decode(q, k_pool, v_pool, block_tables, kv_lens, k_scale, v_scale, *, num_q_heads, sm_scale,
                   return_residuals, block_sizes, interpret):
    num_seqs, num_kv_heads, group_held, head_dim = q.shape
    block_size = k_pool.shape[2]
    group = num_q_heads // num_kv_heads
    group_rows = max(MIN_DOT_ROWS, 1 << (group - 1).bit_length())
    merged_rows = 1 << (group - 1).bit_length()  # Triton loads power-of-two shapes
    quantized = k_pool.dtype == jnp.int8
    compute_dtype = q.dtype if quantized else jnp.promote_types(q.dtype, k_pool.dtype)
    if quantized and block_sizes.int8_via_fp16:
        compute_dtype = jnp.float16
    tile = block_sizes.tile(block_size)
    capacity = block_tables.shape[1] * block_size
    num_items = block_sizes.num_items(block_size, num_seqs, capacity, num_kv_heads)
    fan_in = parts_per_merge_load(merged_rows) * MERGE_LOADS_PER_RUN
    # None where no sequence can have more items than one run holds (then the kernel is the one-level one).
    fan_in = fan_in if block_sizes.items_per_sequence(block_size, capacity, num_kv_heads) > fan_in else None

    kernel = functools.partial(_decode_kernel, sm_scale=sm_scale, tile=tile, block_size=block_size,
                               quantized=quantized, compute_dtype=compute_dtype, group=group, group_rows=group_rows,
                               merged_rows=merged_rows, num_seqs=num_seqs,
                               seqs_pow2=1 << (num_seqs - 1).bit_length(), group_held=group_held,
                               block_sizes=block_sizes, fan_in=fan_in,
                               interpret=interpret)
    scales = (k_scale.astype(jnp.float32), v_scale.astype(jnp.float32)) if quantized else ()
    # Arrivals per (sequence, kv head), then (fan_in) per run of items: zero on entry, and the kernel leaves
    # them zero.
    counters = jnp.zeros((num_seqs + (num_items if fan_in else 0), num_kv_heads), jnp.int32)
    rows = num_seqs * num_q_heads
    whole = pl.no_block_spec  # everything is indexed inside the kernel, never sliced by a BlockSpec
    # Split sequences' partials (only the group's real rows are written), and (fan_in) the runs' merges.
    partials = [jax.ShapeDtypeStruct((num_items, num_kv_heads, group_rows, head_dim), jnp.float32),
                jax.ShapeDtypeStruct((num_items, num_kv_heads, group_rows), jnp.float32),
                jax.ShapeDtypeStruct((num_items, num_kv_heads, group_rows), jnp.float32)]
    out_shape = [*partials, *(partials if fan_in else []),
                 jax.ShapeDtypeStruct((rows, head_dim), q.dtype),
                 jax.ShapeDtypeStruct((rows,), jnp.float32),
                 jax.ShapeDtypeStruct((rows,), jnp.float32),
                 jax.ShapeDtypeStruct(counters.shape, jnp.int32)]
    *_, out, row_max, row_sum, _ = pl.pallas_call(
        kernel,
        grid=(num_items * num_kv_heads,),
        in_specs=[whole] * (6 + len(scales)),
        out_specs=[whole] * len(out_shape),
        out_shape=out_shape,
        input_output_aliases={5 + len(scales): len(out_shape) - 1},
        compiler_params=compat.triton_compiler_params(block_sizes.num_warps, block_sizes.num_stages),
        interpret=interpret,
        name="ragged_decode",
    )(kv_lens.astype(jnp.int32), block_tables.astype(jnp.int32), q.reshape(-1, head_dim), k_pool,
      v_pool, *scales, counters)

    out = out.reshape(num_seqs, num_q_heads, head_dim)
    if return_residuals:
        return out, (row_max.reshape(num_seqs, num_q_heads), row_sum.reshape(num_seqs, num_q_heads))
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
    num_q_heads: int | None = None,
    interpret: bool | None = None,
):
    """Decode attention of one query token per sequence over its KV in the rBlock pool.

    Args:
      q: [num_seqs, num_q_heads, head_dim] (float32, bfloat16 or float16), or grouped per KV head
        [num_seqs, num_kv_heads, group_held, head_dim] of which the first num_q_heads // num_kv_heads
        of each group are the queries (the model's rotated q|k, read in place: no slice, no copy).
      k_pool, v_pool: [num_blocks, num_kv_heads, block_size, head_dim] (float, or int8 with scales);
        block_size a multiple of 16; num_q_heads a multiple of num_kv_heads (MHA, GQA, MQA).
      block_tables: [num_seqs, max_blocks_per_seq] int32 rBlock ids.
      kv_lens: [num_seqs] int32, KV tokens of each sequence (the new token's included); 0 gives out 0.
      k_scale, v_scale: [num_blocks, num_kv_heads, block_size] float32 for int8 pools.
      sm_scale: softmax scale, default 1/sqrt(head_dim).
      return_residuals: also return the row max and row sum of exponentials.
      block_sizes: kernel schedule (default: default_block_sizes(k_pool.dtype)).
      num_q_heads: query heads (default all of q's: num_kv_heads x group_held for a grouped q).
      interpret: run the kernel in the Pallas interpreter; None means on unless on a GPU.

    Returns:
      out [num_seqs, num_q_heads, head_dim] in q.dtype (head h = kv_head * group + g), and with residuals
      `(out, (row_max, row_sum))`, each [num_seqs, num_q_heads] float32 (-inf and 0 where kv_len is 0).
    """
    num_kv_heads = k_pool.shape[1] if k_pool.ndim == 4 else None
    if q.ndim == 4:
        if q.shape[1] != num_kv_heads:
            raise ValueError(f"grouped q {q.shape} must be [num_seqs, num_kv_heads, group_held, head_dim] with the "
                             f"pool's {num_kv_heads} KV heads")
        held = q.shape[1] * q.shape[2]
        if num_q_heads is None:
            num_q_heads = held
        elif not (1 <= num_q_heads <= held and num_q_heads % num_kv_heads == 0):
            raise ValueError(f"num_q_heads {num_q_heads} must be a multiple of the {num_kv_heads} KV heads, at "
                             f"most the {held} rows of q {q.shape}")
        # The checks see only the heads used (an eager slice would copy q).
        used = jax.ShapeDtypeStruct((q.shape[0], num_q_heads, q.shape[3]), q.dtype)
    else:
        if num_q_heads is not None and (q.ndim != 3 or num_q_heads != q.shape[1]):
            raise ValueError(f"num_q_heads {num_q_heads} != the heads of q {q.shape}")
        used = q
    check_ragged_decode_args(used, k_pool, v_pool, block_tables, kv_lens, k_scale, v_scale)
    num_q_heads = used.shape[1]
    if q.ndim == 3:  # [S, Hq, D] is [S, Hkv, G, D]: a free reshape
        q = q.reshape(q.shape[0], num_kv_heads, num_q_heads // num_kv_heads, q.shape[2])
    interpret = compat.default_interpret(interpret)
    if sm_scale is None:
        sm_scale = q.shape[-1] ** -0.5
    block_sizes = block_sizes or default_block_sizes(k_pool.dtype)
    return _ragged_decode(q, k_pool, v_pool, block_tables, kv_lens, k_scale, v_scale, num_q_heads=num_q_heads,
                          sm_scale=float(sm_scale),
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
