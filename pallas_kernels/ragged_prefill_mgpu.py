"""Ragged prefill on Hopper through Mosaic GPU: wgmma + TMA flash attention over the rBlock pool.

Same inputs, semantics and results as `ragged_prefill.ragged_prefill` (and its reference): packed
query tokens of many sequences, each attending causally to its own KV (cached prefix included) in
the head-major pool `[num_blocks, kv_heads, block_size, head_dim]`.

The structure is JAX's fixed-length `attention_mgpu` (FlashAttention-3 style): per CTA three
warpgroups, two computing `block_q` query rows each and ping-ponging on the tensor core through a
schedule barrier, one issuing TMA copies of K/V tiles into a ring of SMEM slots. What changes:
  * the CTA's 2 * block_q query rows come from a work list of tiles over the packed sequences;
  * each K/V tile is one TMA box `pool.at[rblock, kv_head, pl.ds(row, block_kv)]`, the rBlock
    looked up in the block table (block_size % block_kv == 0, so a tile never straddles rBlocks);
  * query i of sequence s sits at position kv_lens[s] - q_len[s] + i (causal after a cached prefix);
  * GQA: kv_head = head // group, with the q heads of a group adjacent in the grid (L2 reuse);
  * tiles run heaviest first, and whole KV tiles above a tile's diagonal are never fetched;
  * two CTAs (a cluster of 2, config.cluster_ctas) share each work-list tile, 2 x 2 * block_q rows
    of one sequence, and so every K/V tile: each CTA's memory warpgroup TMA-multicasts half of it
    into both CTAs' SMEM, and a slot is refilled once all four compute warpgroups released it.
    Sustained prefill is power-bound, and K/V moving from L2 into SMEM is a large share of the
    energy: sharing it saves a few percent (benchmarks/NOTES.md, ragged_prefill_mgpu).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import compat
from pallas_kernels.ragged_prefill import owner_rows, query_tiles
from pallas_kernels.validation import check_ragged_prefill_args

_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)
_COMPUTE_WGS = 2
_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_HEAD_DIMS = (64, 128)  # 256 would need more SMEM than the K/V ring leaves
_SMEM_BYTES = 220 * 1024  # of the 227 KiB a Hopper CTA may take; the rest for barriers and residuals
# Work-list rows, one column per CTA tile of 2 * block_q query rows of one sequence.
_SEQ, _Q_START, _ROWS, _POS0, _KV_LEN, _SLOT, _KV_BLOCKS, _RBLOCK0 = range(8)


@dataclasses.dataclass(frozen=True)
class MosaicPrefillConfig:
    """Tile sizes. block_q: query rows per compute warpgroup (a CTA takes 2 * block_q);
    block_kv: keys per step; steps: K/V tiles in flight (SMEM ring depth);
    heaviest_first: launch the tiles with the most KV steps first (the last wave is then short);
    cluster_ctas: CTAs (a cluster) that take a sequence's next cluster_ctas x 2 * block_q query rows
      together, each K/V tile leaving L2 once for all of them (TMA multicast into every CTA's SMEM);
      1: each CTA a tile of its own, no multicast. Sustained prefill is power-bound on an H200 and
      moving K/V from L2 into SMEM is a large share of the energy."""

    block_q: int = 64
    block_kv: int = 128
    steps: int = 2
    heaviest_first: bool = True
    cluster_ctas: int = 2

    def __post_init__(self):
        if self.block_q != 64:
            raise ValueError(f"block_q {self.block_q} must be 64 (one wgmma M tile per warpgroup)")
        if self.block_kv not in (64, 128):
            raise ValueError(f"block_kv {self.block_kv} must be 64 or 128")
        if not 2 <= self.steps <= 4:
            raise ValueError(f"steps {self.steps} must be in [2, 4]")
        # 4 ran 1-5% slower than 2 on an H200 (the cluster waits for its slowest CTA at every refill).
        if self.cluster_ctas not in (1, 2):
            raise ValueError(f"cluster_ctas {self.cluster_ctas} must be 1 or 2")


def _unsupported_reason(q: jax.Array, k_pool: jax.Array, config: MosaicPrefillConfig) -> str | None:
    """Why this kernel cannot take these inputs (dtype, head_dim, rBlock size), or None if it can.
    k_pool must be 4-d ([num_blocks, num_kv_heads, block_size, head_dim])."""
    if jnp.dtype(q.dtype) not in _DTYPES or k_pool.dtype != q.dtype:
        return f"Mosaic prefill needs bf16 or fp16 q and KV of one dtype; got q {q.dtype}, KV {k_pool.dtype}"
    if k_pool.shape[-1] not in _HEAD_DIMS:
        return f"Mosaic prefill supports head_dim in {_HEAD_DIMS}, got {k_pool.shape[-1]}"
    block_size = k_pool.shape[2]
    if block_size % config.block_kv:
        return f"rBlock size {block_size} must be a multiple of block_kv {config.block_kv}"
    return None


def mgpu_shapes_supported(q: jax.Array, k_pool: jax.Array, config: MosaicPrefillConfig | None = None) -> bool:
    """True when this kernel takes these shapes and dtypes (bf16/fp16 q and KV of one dtype, head_dim
    64 or 128, an rBlock size that is a multiple of block_kv); asks nothing of the device."""
    return k_pool.ndim == 4 and _unsupported_reason(q, k_pool, config or MosaicPrefillConfig()) is None


def mgpu_supported(q: jax.Array, k_pool: jax.Array, config: MosaicPrefillConfig | None = None) -> bool:
    """True when this kernel runs these inputs here: a Hopper GPU (wgmma) and mgpu_shapes_supported."""
    cc = compat.gpu_compute_capability()
    return cc is not None and cc[0] == 9 and mgpu_shapes_supported(q, k_pool, config)


def _work_list(cu_q_lens, kv_lens, block_tables, num_tokens: int, tile_q: int, block_kv: int,
               heaviest_first: bool):
    """Query tiles as int32 [8, num_tiles] (rows _SEQ.._RBLOCK0), num_tiles = cdiv(T, tile_q) + S + 1.

    The tiles of `ragged_prefill.query_tiles` (padding tiles: owner S, no keys, they write zeros;
    unused tiles: 0 rows), with the fields this kernel needs. _SLOT is the tile's owner (S for
    padding): each owner has at most one partial warpgroup sub-tile (its last), which goes to slot
    `owner` of a side buffer instead of the output. _RBLOCK0 is the sequence's first rBlock, so a
    CTA's first K/V copies wait on one load (the work list), not two (then the block table).
    """
    t = query_tiles(cu_q_lens, kv_lens, num_tokens, tile_q)
    kv_blocks = jnp.where(t.is_seq & (t.rows > 0), (t.pos0 + t.rows + block_kv - 1) // block_kv, 0)
    rblock0 = block_tables.astype(jnp.int32)[t.seq, 0]
    work = jnp.stack([t.seq, t.q_start, t.rows, t.pos0, t.kv_len, t.owner, kv_blocks, rblock0]).astype(jnp.int32)
    if heaviest_first:
        work = work[:, jnp.argsort(-kv_blocks, stable=True)]
    return work


def _kernel(work_ref, tables_ref, q_ref, k_ref, v_ref, *refs, block_q, block_kv, steps, group, qk_scale,
            residuals, use_wgmma, ctas, multicast):
    """work [8, tiles] i32; tables [S, W] i32; q [T, Hq, D]; k, v [N, Hkv, bs, D];
    outputs out [T, Hq, D], side [(S+1)*block_q, Hq, D] (+ m, l [Hq, tiles * ctas * 2 * block_q] f32, by
    tile and CTA);
    scratch qo, qs [2, block_q, D], k, v [steps, block_kv, D] (+ ml [2, 2, block_q] f32), barriers."""
    if residuals:
        out_ref, side_ref, m_ref, l_ref, *scratch = refs
        qo_smem2, qs_smem2, k_smem, v_smem, ml_smem2, *barriers = scratch
    else:
        out_ref, side_ref, *scratch = refs
        qo_smem2, qs_smem2, k_smem, v_smem, *barriers = scratch
    q_bars, k_bars, v_bars, k_free, v_free, sched = barriers
    head, tile, wg = lax.axis_index("heads"), lax.axis_index("tile"), lax.axis_index("wg")
    block_size, head_dim = k_ref.shape[2], k_ref.shape[3]
    dtype = q_ref.dtype
    i32 = lambda x: jnp.asarray(x, jnp.int32)
    cta_rows = _COMPUTE_WGS * block_q
    seq = work_ref[_SEQ, tile]
    kv_len = work_ref[_KV_LEN, tile]
    slot_id = work_ref[_SLOT, tile]
    tile_rows = work_ref[_ROWS, tile]
    # KV steps of the whole tile: a cluster's CTAs all stream all of them (the copies are shared).
    tile_nblk = work_ref[_KV_BLOCKS, tile]
    peer = lax.axis_index("peer") if ctas > 1 else 0  # which CTA of the cluster: rows peer * cta_rows..
    rows = jnp.clip(tile_rows - peer * cta_rows, 0, cta_rows)
    q_start = work_ref[_Q_START, tile] + peer * cta_rows
    pos0 = work_ref[_POS0, tile] + peer * cta_rows
    # This CTA's own KV steps: earlier CTAs of the cluster need fewer (causal).
    nblk = jnp.where((rows > 0) & (tile_nblk > 0), lax.div(pos0 + rows + (block_kv - 1), i32(block_kv)), 0)
    copy_axes = dict(collective_axes="peer") if multicast else {}

    def sched_barrier():
        plgpu.barrier_arrive(sched)
        plgpu.barrier_wait(sched)

    def cast(x, layout):
        return plgpu.layout_cast(x, layout) if use_wgmma else x

    def iota(shape, dim):
        if use_wgmma:
            return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA)
        return lax.broadcasted_iota(jnp.int32, shape, dim)

    # Unused tiles (the work list's slack: cdiv(T, tile) + S + 1 columns for at most cdiv(T, tile) + S
    # tiles) end at once: run through, each cost an SM ~1 us (session 7, a trace: 0.9% of the bench's
    # ragged batch, 1,056 of 23,648 CTAs; ~1 us a real CTA where sequences are one tile each).
    # A cluster's later CTAs may have no rows (the sequence's last tile is short): they still run, their
    # memory warpgroups issuing their parts of the shared copies and their compute warpgroups releasing them.
    live = tile_rows > 0

    @pl.when((wg < _COMPUTE_WGS) & live)
    def _compute():
        plgpu.set_max_registers(232, action="increase")
        qo_smem = qo_smem2.at[wg]  # tiled + swizzled: the wgmma operand
        qs_smem = qs_smem2.at[wg]  # plain rows: TMA to and from any packed row offset
        base = q_start + wg * block_q  # first packed token of this warpgroup's rows
        my_rows = jnp.clip(rows - wg * block_q, 0, block_q)
        p0 = pos0 + wg * block_q  # position of its first row
        # Padding tiles (nblk 0) have rows but no keys.
        my_nblk = jnp.where(my_rows > 0, lax.div(p0 + my_rows + (block_kv - 1), i32(block_kv)), 0)
        my_nblk = jnp.minimum(my_nblk, nblk)
        # KV steps wholly at or before p0 are visible to every row: no mask there.
        my_full = jnp.minimum(lax.div(p0 + 1, i32(block_kv)), my_nblk)

        # A TMA into or out of tiled SMEM needs a tile-aligned (multiple of 8) GMEM row, which Mosaic
        # must see as a product with 8, in a token axis whose length is a multiple of 8 (checked when
        # compiling); a sequence's tokens start anywhere in the packed batch, so other rows go through
        # plain SMEM (and registers) instead. A/B against staging every tile (session 6, two runs):
        # -3% to +4.6% a case, +1.3% on average; attention_mgpu's path for its (aligned) tiles.
        tma_rows = q_ref.shape[0] % 8 == 0
        aligned = (lax.rem(base, i32(8)) == 0) & tma_rows
        base8 = lax.div(base, i32(8)) * 8  # == base where aligned

        if tma_rows:
            @pl.when((my_rows > 0) & aligned)
            def _():
                plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(base8, block_q), head], qo_smem, q_bars.at[wg])
                plgpu.barrier_wait(q_bars.at[wg])

        @pl.when((my_rows > 0) & ~aligned)
        def _():
            plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(base, block_q), head], qs_smem, q_bars.at[wg])
            plgpu.barrier_wait(q_bars.at[wg])
            if use_wgmma:
                qo_smem[...] = compat.mgpu_load(qs_smem, layout=plgpu.Layout.WGMMA, optimized=False)
            else:
                qo_smem[...] = qs_smem[...]
            plgpu.commit_smem()  # read next by the tensor core

        row_layout = plgpu.Layout.WGMMA.reduce(1) if use_wgmma else None
        m_i = cast(jnp.full((block_q,), -jnp.inf, jnp.float32), row_layout)
        l_i = cast(jnp.full((block_q,), 0.0, jnp.float32), row_layout)
        acc = cast(jnp.full((block_q, head_dim), 0.0, jnp.float32), plgpu.Layout.WGMMA if use_wgmma else None)

        @pl.when(my_nblk > 0)
        def _():
            plgpu.barrier_wait(k_bars.at[0])

        pl.when(wg == 1)(sched_barrier)

        def wait_next_k(j):
            @pl.when(j + 1 < my_nblk)
            def _():
                plgpu.barrier_wait(k_bars.at[lax.rem(j + 1, i32(steps))])

        def kv_step(j, carry, masked: bool):
            acc, m_i, l_i = carry
            slot = lax.rem(j, i32(steps))
            if use_wgmma:
                def compute_qk(acc_ref):
                    plgpu.wgmma(acc_ref, qo_smem, plgpu.transpose_ref(k_smem.at[slot], (1, 0)))
                    sched_barrier()
                    return acc_ref[...]
                qk = pl.run_scoped(compute_qk, plgpu.ACC((block_q, block_kv), jnp.float32))
            else:
                qk = jnp.dot(qo_smem[...].astype(jnp.float32), k_smem[slot].astype(jnp.float32).T,
                             precision=lax.Precision.HIGHEST)
                sched_barrier()
            plgpu.barrier_arrive(k_free.at[slot])
            if masked:
                q_pos = iota((block_q, block_kv), 0) + p0
                k_pos = iota((block_q, block_kv), 1) + j * block_kv
                qk = jnp.where(q_pos >= k_pos, qk, -jnp.inf)
            # Scores are kept in log2 units of the scaled scores; with a positive scale it folds into
            # exp2's argument (one FMA per score).
            if qk_scale > 0:
                m_ij = jnp.maximum(m_i, qk.max(axis=1) * qk_scale)
                p = jnp.exp2(qk * qk_scale - lax.broadcast_in_dim(m_ij, qk.shape, [0]))
            else:
                s = qk * qk_scale
                m_ij = jnp.maximum(m_i, s.max(axis=1))
                p = jnp.exp2(s - lax.broadcast_in_dim(m_ij, qk.shape, [0]))
            alpha = jnp.exp2(m_i - m_ij)
            m_i = m_ij
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            l_i = l_i * alpha
            p16 = p.astype(dtype)

            def zero_v_tail():
                # Pool rows at or past kv_len may hold anything (NaN); p is 0 there but 0 * NaN is
                # not, and TMA cannot mask, so zero them in SMEM (only the sequence's last step).
                @pl.when((j + 1) * block_kv > kv_len)
                def _():
                    v_tile = v_smem.at[slot]
                    key = iota((block_kv, head_dim), 0) + j * block_kv
                    v_tile[...] = jnp.where(key < kv_len, v_tile[...], 0.0)
                    plgpu.commit_smem()  # generic-proxy writes, read next by the tensor core

            def end_softmax_barriers():
                plgpu.barrier_arrive(sched)  # done with softmax
                plgpu.barrier_wait(v_bars.at[slot])
                if masked:
                    zero_v_tail()
                plgpu.barrier_wait(sched)  # the tensor core is free

            # attention_mgpu: this order measurably matters for head_dim <= 128.
            if head_dim <= 128:
                l_i = l_i + p.sum(axis=1)
                acc, l_i, m_i, p16 = lax.optimization_barrier((acc, l_i, m_i, p16))
                end_softmax_barriers()
            else:
                end_softmax_barriers()
                l_i = l_i + p.sum(axis=1)

            if use_wgmma:
                def compute_pv(acc_ref):
                    plgpu.wgmma(acc_ref, p16, v_smem.at[slot])
                    wait_next_k(j)
                acc = pl.run_state(compute_pv)(plgpu.ACC.init(acc))
            else:
                acc = acc + jnp.dot(p16.astype(jnp.float32), v_smem[slot].astype(jnp.float32),
                                    precision=lax.Precision.HIGHEST)
                wait_next_k(j)
            plgpu.barrier_arrive(v_free.at[slot])
            return acc, m_i, l_i

        def epilogue_step(j, _):
            # The other warpgroup (or another CTA of the cluster) still consumes steps my_nblk..tile_nblk:
            # release them and keep the schedule ping-pong in step. Waiting for the loads keeps every
            # barrier phase observed (the interpreter insists; on the GPU they have landed anyway).
            slot = lax.rem(j, i32(steps))
            plgpu.barrier_wait(k_bars.at[slot])
            plgpu.barrier_arrive(k_free.at[slot])
            plgpu.barrier_wait(v_bars.at[slot])
            plgpu.barrier_arrive(v_free.at[slot])
            sched_barrier()
            sched_barrier()

        carry = lax.fori_loop(0, my_full, functools.partial(kv_step, masked=False), (acc, m_i, l_i))
        acc, m_i, l_i = lax.fori_loop(my_full, my_nblk, functools.partial(kv_step, masked=True), carry)
        lax.fori_loop(my_nblk, tile_nblk, epilogue_step, None)
        pl.when(wg == 0)(sched_barrier)

        # A row with keys has l >= 1 (its max contributes exp2(0)); one without has acc 0: output 0.
        acc = acc / lax.broadcast_in_dim(jnp.maximum(l_i, 1.0), acc.shape, [0])
        # Whole aligned sub-tiles leave from qo (free: the last QK wgmma has read it); the rest from
        # plain rows, for the unaligned TMA store.
        full = my_rows == block_q
        direct = full & aligned

        if tma_rows:
            @pl.when(direct)
            def _():
                qo_smem[...] = acc.astype(dtype)

        @pl.when(~direct)
        def _():
            qs_smem[...] = acc.astype(dtype)
        if residuals:
            ml_smem2.at[wg, 0][...] = m_i * _LN2  # natural log of the scaled scores' max
            ml_smem2.at[wg, 1][...] = l_i
        plgpu.commit_smem()
        # Whole sub-tiles go straight to the output; an owner's one partial sub-tile goes to its
        # side slot (a whole-tile store would overwrite the next sequence's rows).
        part = (my_rows > 0) & (my_rows < block_q)
        side_rows = pl.ds(slot_id * block_q, block_q)

        if tma_rows:
            @pl.when(direct)
            def _():
                plgpu.copy_smem_to_gmem(qo_smem, out_ref.at[pl.ds(base8, block_q), head])

        @pl.when(full & ~aligned)
        def _():
            plgpu.copy_smem_to_gmem(qs_smem, out_ref.at[pl.ds(base, block_q), head])

        @pl.when(part)
        def _():
            plgpu.copy_smem_to_gmem(qs_smem, side_ref.at[side_rows, head])

        if residuals:
            # A TMA store needs a 16-byte aligned address: float32 rows at an arbitrary token `base`
            # are not (the first GPU run faulted there), so residuals go to this tile's own rows and
            # are gathered into token order outside.
            @pl.when(my_rows > 0)
            def _():
                res_rows = pl.ds((tile * ctas + peer) * cta_rows + wg * block_q, block_q)
                for k, ref in enumerate((m_ref, l_ref)):
                    plgpu.copy_smem_to_gmem(ml_smem2.at[wg, k], ref.at[head, res_rows])

        plgpu.wait_smem_to_gmem(0)

    @pl.when((wg == _COMPUTE_WGS) & live)
    def _memory():
        plgpu.set_max_registers(40, action="decrease")
        kv_head = lax.div(head, i32(group))

        steps_per_rblock = block_size // block_kv
        rblock0 = work_ref[_RBLOCK0, tile]  # read once for the first copies, which all may need it

        def kv_tiles(j, first_rblock: bool = False):
            """Step j's K and V tiles [block_kv, D]: one block-table read for both (none in the
            sequence's first rBlock, whose id the work list carries)."""
            if first_rblock:
                rblock = rblock0
            else:
                rblock = tables_ref[seq, lax.div(j, i32(steps_per_rblock))]
            # row = (j % steps_per_rblock) * block_kv, written so Mosaic sees a multiple of the
            # SMEM tiling (it must, to TMA into tiled SMEM).
            row = lax.rem(j, i32(steps_per_rblock)) * block_kv
            return tuple(pool.at[rblock, kv_head, pl.ds(row, block_kv)] for pool in (k_ref, v_ref))

        for i in range(steps):
            @pl.when(i < tile_nblk)
            def _():
                k_tile, v_tile = kv_tiles(i, first_rblock=i < steps_per_rblock)
                plgpu.copy_gmem_to_smem(k_tile, k_smem.at[i], k_bars.at[i], **copy_axes)
                plgpu.copy_gmem_to_smem(v_tile, v_smem.at[i], v_bars.at[i], **copy_axes)

        @pl.loop(steps, jnp.maximum(tile_nblk, steps))
        def _(j):
            slot = lax.rem(j, i32(steps))
            # The block-table read goes before the waits, so its latency hides behind them instead
            # of delaying the copy once the slot frees.
            k_tile, v_tile = kv_tiles(j)
            plgpu.barrier_wait(k_free.at[slot])
            plgpu.copy_gmem_to_smem(k_tile, k_smem.at[slot], k_bars.at[slot], **copy_axes)
            plgpu.barrier_wait(v_free.at[slot])
            plgpu.copy_gmem_to_smem(v_tile, v_smem.at[slot], v_bars.at[slot], **copy_axes)

        # Observe the last release of every slot used (in a cluster, the other CTAs' releases too: no
        # CTA leaves while another may still write into its SMEM or arrive on its barriers).
        for i in range(steps):
            @pl.when(i < tile_nblk)
            def _():
                plgpu.barrier_wait(k_free.at[i])
                plgpu.barrier_wait(v_free.at[i])


def ragged_prefill_mgpu(
    q: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array,
    block_tables: jax.Array,
    kv_lens: jax.Array,
    cu_q_lens: jax.Array,
    *,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
    sm_scale: float | None = None,
    return_residuals: bool = False,
    config: MosaicPrefillConfig | None = None,
    interpret: bool = False,
    use_wgmma: bool | None = None,
):
    """Ragged causal attention of packed query tokens over the rBlock pool (Mosaic GPU, Hopper).

    Args:
      q: [num_tokens, num_q_heads, head_dim] packed query tokens, bf16 or fp16.
      k_pool, v_pool: [num_blocks, num_kv_heads, block_size, head_dim], q's dtype;
        block_size a multiple of config.block_kv.
      block_tables: [num_seqs, max_blocks_per_seq] int32.
      kv_lens: [num_seqs] int32, KV tokens of each sequence including this chunk's.
      cu_q_lens: [num_seqs + 1] int32 cumulative query-token counts; tokens past the end are padding.
      k_scale, v_scale: must be None (int8 pools are not supported here).
      sm_scale: softmax scale, default 1/sqrt(head_dim).
      return_residuals: also return the row max (natural log of scaled scores) and row sum.
      config: tile sizes.
      interpret: run in Mosaic GPU interpret mode (CPU); matmuls then default to jnp.dot.
      use_wgmma: tensor-core matmuls (default: not interpret); the interpreter cannot run them.

    Returns:
      out [num_tokens, num_q_heads, head_dim] in q.dtype (0 for padding tokens), and with residuals
      `(out, (row_max, row_sum))`, each [num_tokens, num_q_heads] float32 (-inf and 0 for padding).
    """
    config = config or MosaicPrefillConfig()
    check_ragged_prefill_args(q, k_pool, v_pool, block_tables, kv_lens, cu_q_lens, k_scale, v_scale)
    reason = _unsupported_reason(q, k_pool, config)
    if reason is not None:
        raise ValueError(reason)
    smem = (4 * config.block_q + 2 * config.steps * config.block_kv) * q.shape[-1] * q.dtype.itemsize
    if smem > _SMEM_BYTES:
        raise ValueError(f"config {config} needs {smem} bytes of SMEM at head_dim {q.shape[-1]}; "
                         f"the limit is {_SMEM_BYTES}: use fewer steps")
    if use_wgmma is None:
        use_wgmma = not interpret
    scale = float(sm_scale) if sm_scale is not None else q.shape[-1] ** -0.5
    return _ragged_prefill_mgpu(q, k_pool, v_pool, block_tables, kv_lens, cu_q_lens, sm_scale=scale,
                                return_residuals=bool(return_residuals), config=config,
                                interpret=bool(interpret), use_wgmma=bool(use_wgmma))


@functools.partial(jax.jit, static_argnames=("sm_scale", "return_residuals", "config", "interpret", "use_wgmma"))
def _ragged_prefill_mgpu(q, k_pool, v_pool, block_tables, kv_lens, cu_q_lens, *, sm_scale, return_residuals,
                         config, interpret, use_wgmma):
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_pool.shape[1]
    num_seqs = kv_lens.shape[0]
    block_q, block_kv, steps = config.block_q, config.block_kv, config.steps
    # cluster_ctas CTAs share each work-list tile (its rows split between them), as a cluster on the GPU;
    # the interpreter has no clusters, so there they are a grid axis and each CTA loads its own K/V.
    ctas = config.cluster_ctas
    multicast = ctas > 1 and not interpret
    tile_q = ctas * _COMPUTE_WGS * block_q
    work = _work_list(cu_q_lens, kv_lens, block_tables, num_tokens, tile_q, block_kv, config.heaviest_first)
    num_tiles = work.shape[1]
    side_rows = (num_seqs + 1) * block_q
    tile_rows = num_tiles * tile_q  # residual rows, by tile
    dt = q.dtype
    out_type = [jax.ShapeDtypeStruct(q.shape, dt), jax.ShapeDtypeStruct((side_rows, num_q_heads, head_dim), dt)]
    if return_residuals:
        out_type += [jax.ShapeDtypeStruct((num_q_heads, tile_rows), jnp.float32)] * 2
    transforms = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128)) if use_wgmma else ()
    scratch = [plgpu.SMEM((_COMPUTE_WGS, block_q, head_dim), dt, transforms=transforms),
               plgpu.SMEM((_COMPUTE_WGS, block_q, head_dim), dt),
               plgpu.SMEM((steps, block_kv, head_dim), dt, transforms=transforms),
               plgpu.SMEM((steps, block_kv, head_dim), dt, transforms=transforms)]
    if return_residuals:
        scratch.append(plgpu.SMEM((_COMPUTE_WGS, 2, block_q), jnp.float32))
    scratch += [plgpu.Barrier(num_barriers=_COMPUTE_WGS),
                plgpu.Barrier(num_barriers=steps), plgpu.Barrier(num_barriers=steps)]
    # A slot is free once every CTA's compute warpgroups released it (the next copy fills them all).
    free = (functools.partial(plgpu.ClusterBarrier, collective_axes=("peer",)) if multicast else plgpu.Barrier)
    scratch += [free(num_arrivals=_COMPUTE_WGS, num_barriers=steps),
                free(num_arrivals=_COMPUTE_WGS, num_barriers=steps),
                plgpu.Barrier(num_arrivals=_COMPUTE_WGS)]
    kernel = functools.partial(
        _kernel, block_q=block_q, block_kv=block_kv, steps=steps, group=num_q_heads // num_kv_heads,
        qk_scale=sm_scale * _LOG2E, residuals=return_residuals, use_wgmma=use_wgmma, ctas=ctas,
        multicast=multicast)
    if multicast:
        grid = dict(grid=(num_q_heads, num_tiles), grid_names=("heads", "tile"), cluster=(ctas,),
                    cluster_names=("peer",))
    elif ctas > 1:
        grid = dict(grid=(num_q_heads, num_tiles, ctas), grid_names=("heads", "tile", "peer"))
    else:
        grid = dict(grid=(num_q_heads, num_tiles), grid_names=("heads", "tile"))
    params = compat.mgpu_interpret_params(out_of_bounds_reads="uninitialized") if interpret else None
    if interpret and params is None:
        raise ValueError(f"jax {jax.__version__} has no Mosaic GPU interpret mode")
    extra = dict(interpret=params) if interpret else {}
    # Grid (heads, tiles), heads fastest: the q heads of one KV head run side by side and share its
    # K/V through L2.
    outs = plgpu.kernel(
        kernel,
        out_type=out_type,
        scratch_types=scratch,
        **grid,
        num_threads=_COMPUTE_WGS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        **extra,
    )(work, block_tables.astype(jnp.int32), q, k_pool, v_pool)
    # Each owner's (sequence's, then the padding's) partial last sub-tile sits in its side slot.
    rows_of_owner = owner_rows(cu_q_lens, num_tokens)  # [S + 1]
    owner_start = cu_q_lens.astype(jnp.int32)  # [S + 1]: the padding starts at cu_q_lens[S]
    part = rows_of_owner % block_q
    r = jnp.arange(block_q, dtype=jnp.int32)
    dst = jnp.where(r[None, :] < part[:, None], (owner_start + rows_of_owner - part)[:, None] + r[None, :],
                    num_tokens).reshape(-1)  # [side_rows]; num_tokens = dropped
    out = outs[0].at[dst].set(outs[1], mode="drop")
    if not return_residuals:
        return out
    # Residual row i of tile column c is token q_start[c] + i for i < rows[c] (rows past: dropped).
    i = jnp.arange(tile_q, dtype=jnp.int32)
    token = jnp.where(i[None, :] < work[_ROWS][:, None], work[_Q_START][:, None] + i[None, :], num_tokens)
    token = token.reshape(-1)
    m = jnp.full((num_q_heads, num_tokens), -jnp.inf, jnp.float32).at[:, token].set(outs[2], mode="drop")
    l = jnp.zeros((num_q_heads, num_tokens), jnp.float32).at[:, token].set(outs[3], mode="drop")
    return out, (m.T, l.T)
