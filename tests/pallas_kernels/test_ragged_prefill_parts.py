"""Ragged prefill over parts of a sequence's KV (query_starts): each part through the kernel with its
residuals, merged with merge_partials, equals the unsplit attention (interpret mode on the CPU).

Each sequence's table is cut at random rBlock boundaries into 2-5 runs, each run a table row of its
own whose keys start at the run's first position; the row carries all of its sequence's query tokens,
so rows see parts entirely before the chunk (positions past the row's kv_len), overlapping it, and
starting inside it (negative positions: those tokens see nothing there). Pool rows no sequence owns
hold NaN for the kernel.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import ragged_prefill as rp
from pallas_kernels.residuals import merge_partials
from tests.pallas_kernels.test_ragged_prefill import _OUT_TOL, _RESIDUAL_TOL, _make_batch

# A chunk after a cached prefix, a fresh prompt, a decode-like token, lengths around the rBlock size.
_Q_LENS = (40, 33, 1, 17, 2)
_CACHED = (90, 0, 70, 47, 15)


def _cut_rows(rng, tables, kv_lens, q_lens, block_size):
    """Each sequence's used table entries cut into 2-5 runs (fewer if it has fewer rBlocks).

    Returns (row_seq [R], row_tables [R, W], row_kv_lens [R], row_query_starts [R], kinds): one row per
    run; kinds counts runs wholly before the chunk, overlapping it, and starting inside it."""
    rows, kinds = [], {"before": 0, "overlap": 0, "inside": 0}
    for s, (n, q) in enumerate(zip(kv_lens, q_lens)):
        blocks = -(-int(n) // block_size)
        count = min(int(rng.integers(2, 6)), blocks)
        cuts = np.sort(rng.choice(np.arange(1, blocks), count - 1, replace=False)) if count > 1 else []
        bounds = [0, *map(int, cuts), blocks]
        chunk = int(n) - int(q)  # first query position
        for e0, e1 in zip(bounds[:-1], bounds[1:]):
            start, end = e0 * block_size, min(e1 * block_size, int(n))
            kinds["before" if end <= chunk else "inside" if start > chunk else "overlap"] += 1
            rows.append((s, tables[s, e0:e1], end - start, chunk - start))
    width = max(len(r[1]) for r in rows)
    row_tables = np.zeros((len(rows), width), np.int32)
    for i, r in enumerate(rows):
        row_tables[i, :len(r[1])] = r[1]
    as_i32 = lambda j: np.asarray([r[j] for r in rows], np.int32)
    return as_i32(0), row_tables, as_i32(2), as_i32(3), kinds


def _run_parts(rng, *, kv_dtype, q_dtype, block_size, block_sizes, q_lens=_Q_LENS, cached=_CACHED):
    (args, scales), (ref_args, ref_scales) = _make_batch(
        rng, q_lens=list(q_lens), cached=list(cached), block_size=block_size, head_dim=64, num_kv_heads=2,
        group=2, kv_dtype=kv_dtype, q_dtype=q_dtype)
    q, k, v, tables, kv_lens, cu = args
    row_seq, row_tables, row_kv, row_qs, kinds = _cut_rows(rng, np.asarray(tables), np.asarray(kv_lens),
                                                           q_lens, block_size)
    # Every row carries its sequence's query tokens; src maps the rows' packed tokens back.
    cu = np.asarray(cu)
    src = np.concatenate([np.arange(cu[s], cu[s + 1]) for s in row_seq])
    padding = 3
    src_padded = np.concatenate([src, np.full(padding, q.shape[0] - 1)])  # the last token is padding (NaN)
    row_cu = np.concatenate([[0], np.cumsum(np.asarray(q_lens)[row_seq])]).astype(np.int32)
    part = lambda a: (a[0][src_padded], *a[1:3], jnp.asarray(row_tables), jnp.asarray(row_kv), jnp.asarray(row_cu))
    qs = jnp.asarray(row_qs)
    out, (m, l) = rp.ragged_prefill(*part(args), **scales, query_starts=qs, return_residuals=True,
                                    block_sizes=block_sizes)
    with jax.default_matmul_precision("highest"):
        ref_out, (ref_m, ref_l) = rp.ragged_prefill_reference(*part(ref_args), **ref_scales, query_starts=qs,
                                                              return_residuals=True)
        want, (want_m, want_l) = rp.ragged_prefill_reference(*ref_args, **ref_scales, return_residuals=True)
    return dict(out=out, m=m, l=l, ref_out=ref_out, ref_m=ref_m, ref_l=ref_l, want=want, want_m=want_m,
                want_l=want_l, src=src, num_tokens=q.shape[0], num_real=int(cu[-1]), kinds=kinds, q_dtype=q_dtype)


def _check(r):
    tol = _OUT_TOL[jnp.dtype(r["q_dtype"]).type]
    n = len(r["src"])
    out, m, l = (np.asarray(r[x], np.float32) for x in ("out", "m", "l"))
    assert np.all(np.isfinite(out)) and not np.any(np.isnan(m)) and not np.any(np.isnan(l))
    # Each part: the kernel against the reference with the same query_starts (-inf must match exactly).
    np.testing.assert_allclose(out, np.asarray(r["ref_out"], np.float32), atol=tol, rtol=tol)
    np.testing.assert_allclose(m, np.asarray(r["ref_m"]), atol=_RESIDUAL_TOL, rtol=_RESIDUAL_TOL)
    np.testing.assert_allclose(l, np.asarray(r["ref_l"]), atol=_RESIDUAL_TOL, rtol=_RESIDUAL_TOL)
    assert np.all(out[n:] == 0) and np.all(m[n:] == -np.inf) and np.all(l[n:] == 0)  # padding
    empty = l[:n] == 0
    assert empty.any(), "some rows should see nothing of their part"
    assert np.all(out[:n][empty] == 0) and np.all(m[:n][empty] == -np.inf)
    # The parts merged per query token: the unsplit attention, residuals included.
    merged, mm, ml = merge_partials(jnp.asarray(r["out"][:n]), jnp.asarray(r["m"][:n]), jnp.asarray(r["l"][:n]),
                                    segment_ids=jnp.asarray(r["src"]), num_segments=r["num_tokens"])
    real = r["num_real"]
    np.testing.assert_allclose(np.asarray(merged[:real]), np.asarray(r["want"][:real], np.float32), atol=tol, rtol=tol)
    np.testing.assert_allclose(np.asarray(mm[:real]), np.asarray(r["want_m"][:real]), atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(ml[:real]), np.asarray(r["want_l"][:real]), atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize(
    "kv_dtype,q_dtype,block_size,block_sizes,seed",
    [
        (jnp.float32, jnp.float32, 16, rp.PrefillBlockSizes(block_q=16, block_k=16), 0),
        (jnp.bfloat16, jnp.bfloat16, 16, rp.PrefillBlockSizes(block_q=32, block_k=16), 1),
        # Steps of 16 keys inside 32-key rBlocks: a part's kv_len ends mid-step and mid-rBlock.
        (jnp.int8, jnp.bfloat16, 32, rp.PrefillBlockSizes(block_q=16, block_k=16), 2),
    ],
)
def test_parts_merge_to_unsplit(kv_dtype, q_dtype, block_size, block_sizes, seed):
    rng = np.random.default_rng(seed)
    kinds = {"before": 0, "overlap": 0, "inside": 0}
    for _ in range(2):  # two random cuts of the same batch shape: one compile
        r = _run_parts(rng, kv_dtype=kv_dtype, q_dtype=q_dtype, block_size=block_size, block_sizes=block_sizes)
        _check(r)
        kinds = {k: kinds[k] + r["kinds"][k] for k in kinds}
    assert min(kinds.values()) > 0, kinds


def test_rows_that_see_nothing():
    """kv_len 0, and query positions wholly before the row's keys: out 0, row_max -inf, row_sum 0, no NaN;
    a row whose positions lie past its kv_len sees the whole row."""
    rng = np.random.default_rng(5)
    (args, scales), (ref_args, ref_scales) = _make_batch(
        rng, q_lens=[20, 5, 9], cached=[12, 30, 0], block_size=16, head_dim=64, num_kv_heads=1, group=2,
        kv_dtype=jnp.bfloat16, q_dtype=jnp.bfloat16)
    q, k, v, tables, _, cu = args
    kv_lens = jnp.asarray([0, 35, 9], jnp.int32)
    starts = jnp.asarray([4, -40, 100], jnp.int32)
    bs = rp.PrefillBlockSizes(block_q=16, block_k=16)
    out, (m, l) = rp.ragged_prefill(q, k, v, tables, kv_lens, cu, query_starts=starts, return_residuals=True,
                                    block_sizes=bs)
    out, m, l = np.asarray(out, np.float32), np.asarray(m), np.asarray(l)
    assert np.all(out[:25] == 0) and np.all(m[:25] == -np.inf) and np.all(l[:25] == 0)
    with jax.default_matmul_precision("highest"):
        ref = rp.ragged_prefill_reference(*ref_args[:4], kv_lens, ref_args[5], **ref_scales, query_starts=starts)
    assert np.all(np.isfinite(out)) and l[25:34].min() > 0
    np.testing.assert_allclose(out, np.asarray(ref, np.float32), atol=3e-2, rtol=3e-2)


def test_default_query_starts_change_nothing():
    """query_starts = kv_lens - q_lens is the default rule: the same result through the parts path."""
    rng = np.random.default_rng(8)
    (args, scales), _ = _make_batch(rng, q_lens=[20, 1, 37], cached=[12, 30, 0], block_size=16, head_dim=64,
                                    num_kv_heads=1, group=2, kv_dtype=jnp.float32, q_dtype=jnp.float32)
    bs = rp.PrefillBlockSizes(block_q=16, block_k=16)
    kv_lens, cu = args[4], args[5]
    starts = kv_lens - (cu[1:] - cu[:-1])
    want, (want_m, want_l) = rp.ragged_prefill(*args, **scales, return_residuals=True, block_sizes=bs)
    got, (m, l) = rp.ragged_prefill(*args, **scales, query_starts=starts, return_residuals=True, block_sizes=bs)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(m), np.asarray(want_m))
    np.testing.assert_allclose(np.asarray(l), np.asarray(want_l), rtol=1e-6)


def test_work_list_of_parts():
    """Per tile: full steps see every row's keys, kv steps reach the last visible key and stop at kv_len."""
    rng = np.random.default_rng(2)
    q_lens = rng.integers(0, 50, 12)
    num_tokens = int(q_lens.sum()) + 7
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    kv_lens = rng.integers(0, 80, 12).astype(np.int32)
    starts = rng.integers(-70, 100, 12).astype(np.int32)
    bk = 16
    work = np.asarray(rp._work_list(jnp.asarray(cu), jnp.asarray(kv_lens), num_tokens, 16, bk, jnp.asarray(starts)))
    assert work.shape[0] == rp._WORK_FIELDS + 1
    for seq, q_start, rows, pos0, full, total, last in work.T:
        if not rows or q_start >= cu[-1]:
            assert total == 0 and full == 0
            continue
        assert pos0 == starts[seq] + q_start - cu[seq]
        assert last == min(pos0 + rows, kv_lens[seq]) - 1
        assert 0 <= full <= total and total == max(0, -(-(last + 1) // bk))
        assert full * bk <= max(0, min(pos0 + 1, kv_lens[seq])) < (full + 1) * bk or full == total


def test_bad_query_starts_raise():
    q = jnp.zeros((8, 2, 64), jnp.float32)
    pool = jnp.zeros((4, 1, 16, 64), jnp.float32)
    tables, kv_lens, cu = jnp.asarray([[0, 1], [2, 3]], jnp.int32), jnp.asarray([3, 5], jnp.int32), \
        jnp.asarray([0, 4, 7], jnp.int32)
    # A part may hold fewer keys than its query tokens (kv_len 3 < 4 query tokens): no error.
    rp.ragged_prefill_reference(q, pool, pool, tables, kv_lens, cu, query_starts=jnp.asarray([0, 0], jnp.int32))
    with pytest.raises(ValueError, match="query_starts must be integer"):
        rp.ragged_prefill(q, pool, pool, tables, kv_lens, cu, query_starts=jnp.asarray([0], jnp.int32))
    with pytest.raises(ValueError, match="query tokens but kv_len"):
        rp.ragged_prefill(q, pool, pool, tables, kv_lens, cu)
