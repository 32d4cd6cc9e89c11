"""Ragged prefill: packed query tokens of many sequences attending causally to their KV in the rBlock pool.

Sequence `s` owns query tokens `cu_q_lens[s]:cu_q_lens[s+1]` of the packed batch. Its KV
(already written, these tokens included) has `kv_lens[s]` tokens, so its `i`-th query token sits
at position `kv_lens[s] - q_len[s] + i` and attends to keys `0..position`. KV cached before this
chunk (chunked prefill, shared prefixes) is simply the part of the KV before the first query
position. Decode is the case `q_len == 1`. Tokens past `cu_q_lens[-1]` are padding: output 0.

Parts (DistAttention): a table row may hold only one part of a sequence's KV, its keys `j` at
absolute positions `part_start + j`. `query_starts[s]` then gives the first query token's position
relative to key 0 of the row (`first query position - part_start`): the `i`-th query token sees keys
`j <= query_starts[s] + i` with `j < kv_lens[s]`. A relative position may be negative (the token
sees nothing of this part: out 0, row_max -inf, row_sum 0) or past the part (it sees all of it);
`merge_partials` joins the parts' residuals exactly. Without query_starts, query_starts =
kv_lens - q_lens: the whole sequence, the rule above.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import compat, kv_layout
from pallas_kernels.validation import (MIN_DOT_ROWS, check_cu_q_lens, check_dot_tile, check_launch, check_pool,
                                       check_ragged_prefill_args, check_tables)

# Fewer token rows at a time keeps the reference's memory at O(chunk * context) on long prompts.
_REFERENCE_TOKEN_CHUNK = 64


def token_positions(cu_q_lens: jax.Array, kv_lens: jax.Array, num_tokens: int, query_starts: jax.Array | None = None):
    """Per packed token: (sequence index [T], position relative to key 0 of its table row [T],
    is-real-token [T]). query_starts [S]: see the module docstring; None: kv_lens - q_lens."""
    num_seqs = kv_lens.shape[0]
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(cu_q_lens, t, side="right") - 1, 0, num_seqs - 1).astype(jnp.int32)
    starts = _query_starts(cu_q_lens, kv_lens, query_starts)
    position = starts[seq] + (t - cu_q_lens[seq])
    real = t < cu_q_lens[num_seqs]
    return seq, position, real


def _query_starts(cu_q_lens, kv_lens, query_starts):
    """Each sequence's first query position relative to key 0 of its row, int32 [S]."""
    if query_starts is not None:
        return query_starts.astype(jnp.int32)
    return (kv_lens - (cu_q_lens[1:] - cu_q_lens[:-1])).astype(jnp.int32)


def owner_rows(cu_q_lens: jax.Array, num_tokens: int) -> jax.Array:
    """Query tokens of each owner, int32 [S + 1]: the S sequences, then the padding past cu_q_lens[-1]."""
    cu_q_lens = cu_q_lens.astype(jnp.int32)
    return jnp.concatenate([cu_q_lens[1:] - cu_q_lens[:-1], (num_tokens - cu_q_lens[-1])[None]])


class QueryTiles(NamedTuple):
    """Per query tile, each int32 [num_tiles] (is_seq bool): see `query_tiles`."""

    owner: jax.Array  # sequence index, S for the padding tokens' tiles (unused tiles too)
    seq: jax.Array  # owner where is_seq, else 0
    is_seq: jax.Array  # a used tile of a real sequence
    q_start: jax.Array  # packed index of the tile's first query token
    rows: jax.Array  # query tokens in the tile, 0 for unused tiles
    pos0: jax.Array  # position of the tile's first query token relative to key 0 of its row (may be < 0)
    kv_len: jax.Array  # kv_lens[seq] where is_seq, else 0


def query_tiles(cu_q_lens, kv_lens, num_tokens: int, tile_q: int, query_starts=None) -> QueryTiles:
    """The batch's query tokens cut into tiles of at most tile_q tokens of one owner, in packed order.

    Each sequence's query tokens are cut into tiles from its first token on; the padding tokens past
    cu_q_lens[-1] form tiles of their own (owner S, no keys). The count is bounded statically by
    cdiv(T, tile_q) + S + 1; unused tiles have 0 rows. Shared by the Triton and Mosaic kernels'
    work lists, which add their own fields. query_starts [S] (parts; see the module docstring) sets
    pos0; None: kv_lens - q_lens.
    """
    num_seqs = kv_lens.shape[0]
    num_tiles = pl.cdiv(num_tokens, tile_q) + num_seqs + 1
    cu_q_lens = cu_q_lens.astype(jnp.int32)
    kv_lens = kv_lens.astype(jnp.int32)
    starts = _query_starts(cu_q_lens, kv_lens, query_starts)  # [S]
    rows_of_owner = owner_rows(cu_q_lens, num_tokens)  # [S + 1], last = padding
    tiles = (rows_of_owner + tile_q - 1) // tile_q
    ends = jnp.cumsum(tiles)
    i = jnp.arange(num_tiles, dtype=jnp.int32)
    # "compare_all" is one fused kernel; the default binary search is a loop of small launches.
    owner = jnp.searchsorted(ends, i, side="right", method="compare_all").astype(jnp.int32)  # S = padding
    used = owner <= num_seqs  # S + 1 = unused
    owner = jnp.minimum(owner, num_seqs)
    first_row = (i - (ends - tiles)[owner]) * tile_q  # of the owner's query tokens
    rows = jnp.where(used, jnp.clip(rows_of_owner[owner] - first_row, 0, tile_q), 0)
    is_seq = used & (owner < num_seqs)
    seq = jnp.where(is_seq, owner, 0)
    pos0 = starts[seq] + first_row
    kv_len = jnp.where(is_seq, kv_lens[seq], 0)
    return QueryTiles(owner=owner, seq=seq, is_seq=is_seq, q_start=cu_q_lens[owner] + first_row, rows=rows,
                      pos0=pos0, kv_len=kv_len)


# Rows of the packed work list that `_ragged_prefill_kernel` reads per query tile; _LAST only with
# query_starts (parts), where a tile's last visible key is also capped by its row's kv_len.
_SEQ, _Q_START, _ROWS, _POS0, _FULL_BLOCKS, _KV_BLOCKS, _LAST = range(7)
_WORK_FIELDS = 6
_LOG2E = math.log2(math.e)
# Three stages of 128 x 128 K/V tiles need 224 KiB of shared memory: Hopper has 227 KiB a block,
# Ampere 163 KiB, which still holds two stages (JAX's `mha` default, 160 KiB).
_THREE_STAGE_MIN_CC = (9, 0)


@dataclasses.dataclass(frozen=True)
class PrefillBlockSizes:
    """Tile sizes of the ragged prefill kernel.

    block_q: query tokens per tile (one sequence per tile); block_k: keys per inner step, capped at
    the largest power of two dividing the rBlock size so a step never straddles two rBlocks.
    num_stages: K/V tiles in flight + 1. The defaults (one program of 8 warps per SM, 3 stages)
    measured fastest on an H200 in bf16 at 4K and 16K tokens (benchmarks/NOTES.md, ragged_prefill).
    """

    block_q: int = 128
    block_k: int = 128
    num_warps: int = 8
    num_stages: int = 3

    def __post_init__(self):
        for name in ("block_q", "block_k"):
            check_dot_tile(name, getattr(self, name))
        check_launch(self.num_warps, self.num_stages, max_warps=32)


def _compute_dtype(q_dtype, kv_dtype):
    """dtype of the dot operands: int8 KV is dequantized by scaling scores and probabilities instead."""
    return jnp.dtype(q_dtype) if jnp.dtype(kv_dtype) == jnp.int8 else jnp.promote_types(q_dtype, kv_dtype)


def default_block_sizes(compute_dtype) -> PrefillBlockSizes:
    """Best of a sweep on an H200 (bf16, causal 4K and 16K tokens, packed and single, 32 x 128 heads,
    rBlocks of 256): 128 x 128 tiles, 8 warps, 3 stages at every length measured. float32 tiles are
    smaller so that the pipelined K and V tiles still fit in shared memory; before Hopper, two stages fit."""
    if jnp.dtype(compute_dtype).itemsize >= 4:
        return PrefillBlockSizes(block_q=64, block_k=32, num_warps=4, num_stages=2)
    cc = compat.gpu_compute_capability()
    if cc is not None and cc < _THREE_STAGE_MIN_CC:
        return PrefillBlockSizes(num_stages=2)
    return PrefillBlockSizes()


def _effective_block_k(block_k: int, block_size: int) -> int:
    """Largest power of two <= block_k that divides the rBlock size."""
    step = min(block_k, block_size & -block_size)
    if step < MIN_DOT_ROWS:
        raise ValueError(f"rBlock size {block_size} must be a multiple of {MIN_DOT_ROWS} for the prefill kernel")
    return step


def _work_list(cu_q_lens, kv_lens, num_tokens: int, block_q: int, block_k: int, query_starts=None) -> jax.Array:
    """Query tiles of the batch in packed order, as int32 [_WORK_FIELDS, num_tiles] ([_WORK_FIELDS + 1,
    num_tiles] with query_starts: the _LAST row).

    The tiles of `query_tiles`: padding tiles have no keys (they write zeros), unused tiles 0 rows
    (they exit at once). Packed order is JAX's `mha` order (each sequence's tiles from its first
    token on); launching the heaviest tiles first measured no faster on an H200 and costs a sort.
    """
    t = query_tiles(cu_q_lens, kv_lens, num_tokens, block_q, query_starts)
    if query_starts is None:
        # Key blocks entirely at or before pos0 are visible to every row: no mask needed there.
        full_blocks = jnp.where(t.is_seq, (t.pos0 + 1) // block_k, 0)
        kv_blocks = jnp.where(t.is_seq, (t.pos0 + t.rows + block_k - 1) // block_k, 0)
        return jnp.stack([t.seq, t.q_start, t.rows, t.pos0, full_blocks, kv_blocks]).astype(jnp.int32)
    # A part: keys stop at kv_len too, and pos0 may be negative (floor division keeps full_blocks <= 0
    # there) or past kv_len. last = -1 where no row of the tile sees a key: no steps run.
    last = jnp.where(t.is_seq & (t.rows > 0), jnp.minimum(t.pos0 + t.rows, t.kv_len) - 1, -1)
    kv_blocks = jnp.maximum((last + block_k) // block_k, 0)
    full_blocks = jnp.clip(jnp.minimum(t.pos0 + 1, t.kv_len) // block_k, 0, kv_blocks)
    return jnp.stack([t.seq, t.q_start, t.rows, t.pos0, full_blocks, kv_blocks, last]).astype(jnp.int32)


def _ragged_prefill_kernel(
    work_ref,  # [_WORK_FIELDS, num_tiles] int32
    tables_ref,  # [S, W] int32
    q_ref,  # [T, Hq, D]
    k_ref,  # [num_blocks, Hkv, block_size, D]
    v_ref,  # [num_blocks, Hkv, block_size, D]
    *refs,  # (k_scale_ref, v_scale_ref [num_blocks, Hkv, block_size] f32 if int8), out_ref [T, Hq, D],
            # (row_max_ref, row_sum_ref [T, Hq] f32 if residuals)
    sm_scale: float,
    block_q: int,
    block_k: int,
    group: int,
    quantized: bool,
    compute_dtype,
    parts: bool = False,
):
    if quantized:
        k_scale_ref, v_scale_ref, out_ref, *residual_refs = refs
    else:
        k_scale_ref = v_scale_ref = None
        out_ref, *residual_refs = refs
    tile, head = pl.program_id(0), pl.program_id(1)
    kv_head = lax.div(head, jnp.int32(group))
    block_size, head_dim = k_ref.shape[2], k_ref.shape[3]
    table_width = tables_ref.shape[1]
    rows = work_ref[_ROWS, tile]
    # Scores go through exp2; with a positive scale it is folded into exp2's argument (one FMA per
    # score), and the running max is taken on raw scores.
    qk_scale = sm_scale * _LOG2E
    score_scale, exp_scale = (1.0, qk_scale) if qk_scale > 0 else (qk_scale, 1.0)
    # A float32 dot would run in TF32 by default: keep the float32 path exact.
    precision = lax.Precision.HIGHEST if jnp.dtype(compute_dtype) == jnp.float32 else None

    # Empty tiles (rows 0) need no guard: every load and store is masked off and no KV step runs
    # (a pl.when around the body measured no faster).
    seq = work_ref[_SEQ, tile]
    q_start = work_ref[_Q_START, tile]
    pos0 = work_ref[_POS0, tile]
    full_blocks = work_ref[_FULL_BLOCKS, tile]
    kv_blocks = work_ref[_KV_BLOCKS, tile]
    # Last key any real row of the tile sees; a part's rows may also end at its kv_len, before pos0 + rows.
    last = work_ref[_LAST, tile] if parts else pos0 + rows - 1
    row_mask = jnp.arange(block_q, dtype=jnp.int32) < rows  # [block_q]
    q = plgpu.load(q_ref.at[pl.ds(q_start, block_q), head, :], mask=row_mask[:, None], other=0.0)
    q = q.astype(compute_dtype)  # [block_q, D]

    def kv_step(carry, start, rblock, row, masked: bool):
        """Keys start..start+block_k, at rows row.. of pool block rblock."""
        acc, m_prev, l_prev = carry  # [block_q, D], [block_q], [block_q] f32
        keys = pl.ds(pl.multiple_of(row, block_k), block_k)
        k = plgpu.load(k_ref.at[rblock, kv_head, keys, :])  # [block_k, D]
        s = plgpu.dot(q, k.astype(compute_dtype), trans_b=True, precision=precision)  # [block_q, block_k] f32
        if score_scale != 1.0:
            s = s * score_scale
        if quantized:
            s = s * plgpu.load(k_scale_ref.at[rblock, kv_head, keys])[None, :]
        if masked:
            # Built here, not before the loops: a per-row vector live across the unmasked loop costs
            # registers there (see the note at the store).
            limit = jnp.minimum(pos0 + jnp.arange(block_q, dtype=jnp.int32), last)  # [block_q] last key per row
            key_pos = start + jnp.arange(block_k, dtype=jnp.int32)
            s = jnp.where(key_pos[None, :] <= limit[:, None], s, -jnp.inf)
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
        # Without parts every row sees key 0 in step 0, so m_next is finite from then on: no inf - inf.
        # A part's row may see nothing yet (its position before the part, or past a short tail): a finite
        # stand-in for its max keeps alpha and p at 0 instead of NaN. Unmasked steps need no guard.
        m_use = jnp.where(m_next == -jnp.inf, 0.0, m_next) if (parts and masked) else m_next
        if exp_scale != 1.0:
            alpha = jnp.exp2((m_prev - m_use) * exp_scale)
            p = jnp.exp2(s * exp_scale - (m_use * exp_scale)[:, None])
        else:
            alpha = jnp.exp2(m_prev - m_use)
            p = jnp.exp2(s - m_use[:, None])
        l_next = l_prev * alpha + jnp.sum(p, axis=1)
        # Keys past the tile's last position hold stale (maybe NaN) values or scales; p is 0 there,
        # but 0 * NaN would poison the sum, so the masked steps load zeros instead (a masked load
        # stays an asynchronous copy to shared memory; a select after it would not).
        if masked:
            v = plgpu.load(v_ref.at[rblock, kv_head, keys, :], mask=(key_pos <= last)[:, None], other=0)
        else:
            v = plgpu.load(v_ref.at[rblock, kv_head, keys, :])  # [block_k, D]
        if quantized:
            v_scale = plgpu.load(v_scale_ref.at[rblock, kv_head, keys])  # [block_k]
            if masked:
                v_scale = jnp.where(key_pos <= last, v_scale, 0.0)
            p = p * v_scale[None, :]
        pv = plgpu.dot(p.astype(compute_dtype), v.astype(compute_dtype), precision=precision)
        return acc * alpha[:, None] + pv, m_next, l_next

    def kv_loop(lo, hi, carry, masked: bool):
        """KV steps lo..hi (of block_k keys each). Each step looks up the next step's rBlock, so no
        K/V address waits on a load issued in the same step and Triton's pipeliner can issue the
        next K/V tiles early (3% faster on an H200 than looking up the step's own rBlock)."""
        size = jnp.int32(block_size)

        def step(j, carry):
            *state, rblock = carry
            start = j * block_k
            # lax.div, not // or %: the Triton lowering mistypes jnp's floor-division helpers.
            index = lax.div(start, size)
            following = jnp.minimum(lax.div(start + block_k, size), table_width - 1)
            state = kv_step(tuple(state), start, rblock, start - index * block_size, masked)
            return (*state, tables_ref[seq, following])

        first = tables_ref[seq, jnp.minimum(lax.div(lo * block_k, size), table_width - 1)]
        *carry, _ = lax.fori_loop(lo, hi, step, (*carry, first))
        return tuple(carry)

    carry = (jnp.zeros((block_q, head_dim), jnp.float32),
             jnp.full((block_q,), -jnp.inf, jnp.float32),
             jnp.zeros((block_q,), jnp.float32))
    # Steps wholly at or before the tile's first position need no causal mask: their own loop.
    carry = kv_loop(0, full_blocks, carry, masked=False)
    acc, m, l = kv_loop(full_blocks, kv_blocks, carry, masked=True)
    out = acc / jnp.where(l > 0, l, 1.0)[:, None]
    # The store mask is rebuilt from token indices rather than reusing row_mask: the compiler would
    # keep that one live across the loops (a predicate per stored element), and with it ptxas stops
    # overlapping the exp2s with the P @ V wgmmas (offline SASS, H200 config 128/128/8 warps).
    tokens = q_start + jnp.arange(block_q, dtype=jnp.int32)
    store_mask = tokens < q_start + rows  # [block_q], == row_mask
    plgpu.store(out_ref.at[pl.ds(q_start, block_q), head, :], out.astype(out_ref.dtype), mask=store_mask[:, None])
    if residual_refs:
        row_max_ref, row_sum_ref = residual_refs
        plgpu.store(row_max_ref.at[pl.ds(q_start, block_q), head], m * (exp_scale / _LOG2E), mask=store_mask)
        plgpu.store(row_sum_ref.at[pl.ds(q_start, block_q), head], l, mask=store_mask)


def _check_args(q, k_pool, v_pool, block_tables, kv_lens, cu_q_lens, query_starts, k_scale, v_scale) -> None:
    """check_ragged_prefill_args; with query_starts a row's kv_len may be below its query count."""
    if query_starts is None:
        check_ragged_prefill_args(q, k_pool, v_pool, block_tables, kv_lens, cu_q_lens, k_scale, v_scale)
        return
    if q.ndim != 3:
        raise ValueError(f"q must be [num_tokens, num_q_heads, head_dim], got shape {q.shape}")
    check_pool(q, k_pool, v_pool, k_scale, v_scale)
    check_tables(block_tables, kv_lens, k_pool.shape[0], k_pool.shape[2])
    check_cu_q_lens(cu_q_lens, block_tables.shape[0], q.shape[0])
    if query_starts.shape != kv_lens.shape or not jnp.issubdtype(query_starts.dtype, jnp.integer):
        raise ValueError(f"query_starts must be integer [num_seqs] = {kv_lens.shape}; got {query_starts.dtype} "
                         f"{query_starts.shape}")


def ragged_prefill(
    q: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array,
    block_tables: jax.Array,
    kv_lens: jax.Array,
    cu_q_lens: jax.Array,
    *,
    query_starts: jax.Array | None = None,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
    sm_scale: float | None = None,
    return_residuals: bool = False,
    block_sizes: PrefillBlockSizes | None = None,
    interpret: bool | None = None,
):
    """Ragged causal attention of packed query tokens over the rBlock pool (Pallas, Triton lowering).

    Flash attention over query tiles of one sequence each; a tile reads its sequence's K/V rBlocks
    through the block table (no gather, no copy), from position 0 to its last query's position.
    With query_starts a row of the table may be one part of a sequence (module docstring).

    Args:
      q: [num_tokens, num_q_heads, head_dim] packed query tokens.
      k_pool, v_pool: [num_blocks, num_kv_heads, block_size, head_dim] (bf16/fp16/f32, or int8 with scales).
      block_tables: [num_seqs, max_blocks_per_seq] int32.
      kv_lens: [num_seqs] int32, KV tokens of each sequence including this chunk's (with query_starts:
        the keys of each row's part).
      cu_q_lens: [num_seqs + 1] int32 cumulative query-token counts; tokens past the end are padding.
      query_starts: optional [num_seqs] int32, each sequence's first query position relative to key 0 of
        its row (any integer; default kv_lens - q_lens). kv_lens may then be less than the query count.
      k_scale, v_scale: [num_blocks, num_kv_heads, block_size] float32 for int8 pools.
      sm_scale: softmax scale, default 1/sqrt(head_dim).
      return_residuals: also return the row max and row sum of exponentials.
      block_sizes: tile sizes; default tuned per compute dtype and GPU (`default_block_sizes`).
      interpret: run the Pallas interpreter; default True unless on a GPU.

    Returns:
      out [num_tokens, num_q_heads, head_dim] in q.dtype (0 for padding tokens and rows that see no key),
      and with residuals `(out, (row_max, row_sum))`, each [num_tokens, num_q_heads] float32 (-inf and 0
      for padding and rows that see no key).
    """
    _check_args(q, k_pool, v_pool, block_tables, kv_lens, cu_q_lens, query_starts, k_scale, v_scale)
    if block_sizes is None:
        block_sizes = default_block_sizes(_compute_dtype(q.dtype, k_pool.dtype))
    _effective_block_k(block_sizes.block_k, k_pool.shape[2])  # raise here, not inside jit
    interpret = compat.default_interpret(interpret)
    scale = float(sm_scale) if sm_scale is not None else q.shape[-1] ** -0.5
    return _ragged_prefill(q, k_pool, v_pool, block_tables, kv_lens, cu_q_lens, query_starts, k_scale, v_scale,
                           sm_scale=scale, return_residuals=return_residuals, block_sizes=block_sizes,
                           interpret=interpret)


@functools.partial(jax.jit, static_argnames=("sm_scale", "return_residuals", "block_sizes", "interpret"))
def _ragged_prefill(q, k_pool, v_pool, block_tables, kv_lens, cu_q_lens, query_starts, k_scale, v_scale, *,
                    sm_scale, return_residuals, block_sizes, interpret):
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, block_size = k_pool.shape[1], k_pool.shape[2]
    block_q = block_sizes.block_q
    block_k = _effective_block_k(block_sizes.block_k, block_size)
    quantized = k_pool.dtype == jnp.int8
    compute_dtype = _compute_dtype(q.dtype, k_pool.dtype)
    work = _work_list(cu_q_lens, kv_lens, num_tokens, block_q, block_k, query_starts)
    kernel = functools.partial(
        _ragged_prefill_kernel, sm_scale=sm_scale, block_q=block_q, block_k=block_k,
        group=num_q_heads // num_kv_heads, quantized=quantized, compute_dtype=compute_dtype,
        parts=query_starts is not None)
    out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype)]
    if return_residuals:
        out_shape += [jax.ShapeDtypeStruct((num_tokens, num_q_heads), jnp.float32)] * 2
    inputs = [work, block_tables.astype(jnp.int32), q, k_pool, v_pool]
    if quantized:
        inputs += [k_scale.astype(jnp.float32), v_scale.astype(jnp.float32)]
    # Grid (tile, head), tile fastest: the programs running at once are neighbouring tiles of one
    # head, which re-read the same KV prefix from L2 (measured: 96% L2 hits, DRAM 2% busy at 16K).
    outs = pl.pallas_call(
        kernel,
        grid=(work.shape[1], num_q_heads),
        out_shape=out_shape,
        compiler_params=compat.triton_compiler_params(block_sizes.num_warps, block_sizes.num_stages),
        interpret=interpret,
        name="ragged_prefill",
    )(*inputs)
    if return_residuals:
        return outs[0], (outs[1], outs[2])
    return outs[0]


@functools.partial(jax.jit, static_argnames=("sm_scale", "return_residuals"))
def ragged_prefill_reference(
    q: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array,
    block_tables: jax.Array,
    kv_lens: jax.Array,
    cu_q_lens: jax.Array,
    *,
    query_starts: jax.Array | None = None,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
    sm_scale: float | None = None,
    return_residuals: bool = False,
):
    """Pure-jnp ragged causal attention over the rBlock pool, computed in float32.

    Args:
      q: [num_tokens, num_q_heads, head_dim] packed query tokens.
      k_pool, v_pool: [num_blocks, num_kv_heads, block_size, head_dim] (float, or int8 with scales).
      block_tables: [num_seqs, max_blocks_per_seq] int32.
      kv_lens: [num_seqs] int32, KV tokens of each sequence including this chunk's.
      cu_q_lens: [num_seqs + 1] int32 cumulative query-token counts.
      query_starts: optional [num_seqs] int32, as in `ragged_prefill` (parts).
      k_scale, v_scale: [num_blocks, num_kv_heads, block_size] float32 for int8 pools.
      sm_scale: softmax scale, default 1/sqrt(head_dim).
      return_residuals: also return the row max and row sum of exponentials.

    Returns:
      out [num_tokens, num_q_heads, head_dim] in q.dtype (normalised; 0 for rows with no keys), and
      with residuals `(out, (row_max, row_sum))`, each [num_tokens, num_q_heads] float32
      (-inf and 0 for rows with no keys).
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_pool.shape[1]
    group = num_q_heads // num_kv_heads
    scale = sm_scale if sm_scale is not None else head_dim ** -0.5
    seq, position, real = token_positions(cu_q_lens, kv_lens, num_tokens, query_starts)
    key_index = jnp.arange(block_tables.shape[1] * k_pool.shape[2])
    highest = jax.lax.Precision.HIGHEST  # a float32 oracle for the kernels, also on GPUs that default to TF32

    def sequence_kv(pool, scale, s):
        # This token's sequence only: memory O(context) per token, not O(batch x context).
        one = kv_layout.gather_sequences(pool, scale, block_tables[s][None])  # [1, Hkv, L, D]
        return one[0]

    def one_token(args):
        q_t, s, pos, is_real = args  # q_t [Hq, D]
        keys, values = sequence_kv(k_pool, k_scale, s), sequence_kv(v_pool, v_scale, s)  # [Hkv, L, D]
        q_t = q_t.astype(jnp.float32).reshape(num_kv_heads, group, head_dim)
        visible = (key_index <= pos) & (key_index < kv_lens[s]) & is_real  # [L]
        # Rows outside the sequence may hold anything (even NaN): keep them out of both products.
        keys = jnp.where(visible[None, :, None], keys, 0.0)
        values = jnp.where(visible[None, :, None], values, 0.0)
        scores = jnp.einsum("kgd,kld->kgl", q_t, keys, precision=highest) * scale  # [Hkv, G, L]
        scores = jnp.where(visible, scores, -jnp.inf)
        row_max = jnp.max(scores, axis=-1)  # [Hkv, G]
        safe_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
        p = jnp.exp(scores - safe_max[..., None])
        row_sum = jnp.sum(p, axis=-1)
        out = jnp.einsum("kgl,kld->kgd", p, values, precision=highest) / jnp.where(row_sum > 0, row_sum, 1.0)[..., None]
        return (out.reshape(num_q_heads, head_dim), row_max.reshape(num_q_heads), row_sum.reshape(num_q_heads))

    def one_chunk(args):
        # A chunk of padding tokens only (a bucket's tail) computes nothing: its rows have no keys.
        empty = (jnp.zeros((args[0].shape[0], num_q_heads, head_dim), jnp.float32),
                 jnp.full((args[0].shape[0], num_q_heads), -jnp.inf, jnp.float32),
                 jnp.zeros((args[0].shape[0], num_q_heads), jnp.float32))
        return jax.lax.cond(jnp.any(args[3]), jax.vmap(one_token), lambda _: empty, args)

    chunk = min(_REFERENCE_TOKEN_CHUNK, num_tokens)
    padded = -(-num_tokens // chunk) * chunk
    pad = lambda x: jnp.pad(x, [(0, padded - num_tokens)] + [(0, 0)] * (x.ndim - 1))  # noqa: E731 (not real)
    chunks = [pad(x).reshape((-1, chunk) + x.shape[1:]) for x in (q, seq, position, real)]
    out, row_max, row_sum = (x.reshape((padded,) + x.shape[2:])[:num_tokens]
                             for x in jax.lax.map(one_chunk, tuple(chunks)))
    out = out.astype(q.dtype)
    if return_residuals:
        return out, (row_max, row_sum)
    return out
