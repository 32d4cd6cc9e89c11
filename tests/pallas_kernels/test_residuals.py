"""merge_partials: any split of the keys merges back to the unsplit attention, exactly."""

from __future__ import annotations

import numpy as np
import pytest
import jax
import jax.numpy as jnp

from pallas_kernels.residuals import merge_partials, merge_run
from tests.seeds import seed


def _attention(scores, values):
    """Softmax attention of rows [R, L] scores over values [L, D] in float64: (out, max, sum); empty -> (0, -inf, 0)."""
    rows, length = scores.shape
    if length == 0:
        return np.zeros((rows, values.shape[-1])), np.full(rows, -np.inf), np.zeros(rows)
    m = scores.max(axis=1)
    p = np.exp(scores - m[:, None])
    s = p.sum(axis=1)
    return p @ values / s[:, None], m, s


def _random_split(rng, length, parts):
    """Assign each key to one of `parts` parts at random (some parts may be empty)."""
    owner = rng.integers(0, parts, size=length)
    return [np.flatnonzero(owner == i) for i in range(parts)]


@pytest.mark.parametrize("parts", [1, 2, 7])
def test_any_split_merges_to_unsplit(parts):
    rng = np.random.default_rng(parts)
    rows, length, dim = 5, 50, 16
    scores = rng.standard_normal((rows, length)) * 4
    values = rng.standard_normal((length, dim))
    want_out, want_max, want_sum = _attention(scores, values)
    pieces = [_attention(scores[:, idx], values[idx]) for idx in _random_split(rng, length, parts)]
    outs, maxes, sums = (np.stack(x) for x in zip(*pieces))
    out, m, s = merge_partials(jnp.asarray(outs, jnp.float32), jnp.asarray(maxes, jnp.float32),
                               jnp.asarray(sums, jnp.float32))
    np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(m, want_max, rtol=1e-6)
    np.testing.assert_allclose(s, want_sum, rtol=1e-5)


def test_merge_is_associative():
    rng = np.random.default_rng(1)
    outs = jnp.asarray(rng.standard_normal((3, 4, 8)), jnp.float32)
    maxes = jnp.asarray(rng.standard_normal((3, 4)) * 10, jnp.float32)
    sums = jnp.asarray(rng.uniform(0.5, 20, (3, 4)), jnp.float32)
    once = merge_partials(outs, maxes, sums)
    ab = merge_partials(outs[:2], maxes[:2], sums[:2])
    twice = merge_partials(jnp.stack([ab[0], outs[2]]), jnp.stack([ab[1], maxes[2]]), jnp.stack([ab[2], sums[2]]))
    for a, b in zip(once, twice):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_empty_partials_have_no_weight_even_with_garbage():
    rng = np.random.default_rng(2)
    out_a, m_a, s_a = _attention(rng.standard_normal((3, 9)), rng.standard_normal((9, 4)))
    # An empty part: max -inf, sum 0, and an output that is garbage (NaN) rather than 0.
    outs = jnp.asarray(np.stack([np.full((3, 4), np.nan), out_a]), jnp.float32)
    maxes = jnp.asarray(np.stack([np.full(3, -np.inf), m_a]), jnp.float32)
    sums = jnp.asarray(np.stack([np.zeros(3), s_a]), jnp.float32)
    out, m, s = merge_partials(outs, maxes, sums)
    np.testing.assert_allclose(out, out_a, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(m, m_a, rtol=1e-6)
    np.testing.assert_allclose(s, s_a, rtol=1e-6)


def test_all_empty_gives_zero_out_neg_inf_max_zero_sum():
    outs = jnp.full((4, 2, 3, 8), jnp.nan, jnp.float32)
    out, m, s = merge_partials(outs, jnp.full((4, 2, 3), -jnp.inf), jnp.zeros((4, 2, 3)))
    assert np.all(np.asarray(out) == 0)
    assert np.all(np.asarray(m) == -np.inf)
    assert np.all(np.asarray(s) == 0)


def test_segments_match_per_segment_merges_and_ignore_out_of_range():
    rng = np.random.default_rng(3)
    parts, rows, dim, segments = 9, 3, 8, 4
    outs = rng.standard_normal((parts, rows, dim))
    maxes = rng.standard_normal((parts, rows)) * 5
    sums = rng.uniform(0.5, 30, (parts, rows))
    ids = np.array([0, 2, 2, 0, 4, 2, -1, 0, 3])  # segment 1 gets nothing; ids 4 and -1 are padding
    outs[ids == 4] = np.nan
    maxes[ids == -1] = np.nan
    out, m, s = merge_partials(jnp.asarray(outs, jnp.float32), jnp.asarray(maxes, jnp.float32),
                               jnp.asarray(sums, jnp.float32), segment_ids=jnp.asarray(ids), num_segments=segments)
    assert out.shape == (segments, rows, dim)
    for seg in range(segments):
        sel = ids == seg
        if not sel.any():
            assert np.all(np.asarray(out[seg]) == 0) and np.all(np.asarray(m[seg]) == -np.inf)
            assert np.all(np.asarray(s[seg]) == 0)
            continue
        want = merge_partials(jnp.asarray(outs[sel], jnp.float32), jnp.asarray(maxes[sel], jnp.float32),
                              jnp.asarray(sums[sel], jnp.float32))
        for a, b in zip((out[seg], m[seg], s[seg]), want):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="row_max"):
        merge_partials(jnp.zeros((2, 3, 8)), jnp.zeros((2, 4)), jnp.zeros((2, 4)))
    with pytest.raises(ValueError, match="num_segments"):
        merge_partials(jnp.zeros((2, 3, 8)), jnp.zeros((2, 3)), jnp.zeros((2, 3)), segment_ids=jnp.zeros(2, jnp.int32))


def merge_runs(outs, maxes, sums, first, num, *, rows, real_rows):
    """merge_run (the decode kernel's in-kernel merge) over every run, one program per (run, head)."""
    from jax.experimental import pallas as pl

    num_runs, heads, dim = first.shape[0], outs.shape[1], outs.shape[-1]

    def kernel(first_ref, num_ref, outs_ref, max_ref, sum_ref, out_ref, out_max_ref, out_sum_ref):
        run, head = pl.program_id(0), pl.program_id(1)
        out, m, s = merge_run(outs_ref, max_ref, sum_ref, first_ref[run], num_ref[run], head, rows=rows,
                              real_rows=real_rows)
        out_ref[...], out_max_ref[...], out_sum_ref[...] = out, m, s

    whole = pl.no_block_spec
    return pl.pallas_call(
        kernel, grid=(num_runs, heads), in_specs=[whole] * 5,
        out_specs=[pl.BlockSpec((None, None, rows, dim), lambda r, h: (r, h, 0, 0)),
                   pl.BlockSpec((None, None, rows), lambda r, h: (r, h, 0)),
                   pl.BlockSpec((None, None, rows), lambda r, h: (r, h, 0))],
        out_shape=[jax.ShapeDtypeStruct((num_runs, heads, rows, dim), jnp.float32),
                   jax.ShapeDtypeStruct((num_runs, heads, rows), jnp.float32),
                   jax.ShapeDtypeStruct((num_runs, heads, rows), jnp.float32)],
        interpret=True)(first, num, outs, maxes, sums)


@pytest.mark.parametrize("rows,real_rows", [(1, 1), (4, 4), (8, 6)])
def test_merge_run_matches_merge_partials(rows, real_rows):
    """The decode kernel's in-kernel merge of runs of consecutive parts agrees with merge_partials;
    padding rows, parts past the last run and every unread slot hold NaN and must not leak in."""
    rng = np.random.default_rng(seed(78846))
    heads, padded_rows, dim = 3, 8, 16
    # Parts per run; a run of 0 parts is an empty sequence; runs longer than one load (32 // rows parts).
    runs = [3, 0, 1, 40, 2, 9]
    num_parts = sum(runs) + 2  # two unused parts past the last run
    outs = np.full((num_parts, heads, padded_rows, dim), np.nan, np.float32)
    maxes = np.full((num_parts, heads, padded_rows), np.nan, np.float32)
    sums = np.full((num_parts, heads, padded_rows), np.nan, np.float32)
    real = sum(runs)
    outs[:real, :, :real_rows] = rng.standard_normal((real, heads, real_rows, dim))
    maxes[:real, :, :real_rows] = rng.standard_normal((real, heads, real_rows)) * 5
    sums[:real, :, :real_rows] = rng.uniform(0.5, 3, (real, heads, real_rows))
    sums[1, 0, 0] = 0.0  # an empty part inside a run: no weight whatever its max and output hold
    maxes[1, 0, 0] = np.nan
    outs[1, 0, 0] = np.nan
    first = np.concatenate([[0], np.cumsum(runs)[:-1]]).astype(np.int32)
    out, m, s = merge_runs(jnp.asarray(outs), jnp.asarray(maxes), jnp.asarray(sums), jnp.asarray(first),
                           jnp.asarray(runs, np.int32), rows=rows, real_rows=real_rows)
    out, m, s = out[:, :, :real_rows], m[:, :, :real_rows], s[:, :, :real_rows]
    segment = np.concatenate([np.full(n, i) for i, n in enumerate(runs)] + [np.full(num_parts - sum(runs), len(runs))]).astype(np.int32)
    clean = lambda x: jnp.asarray(np.nan_to_num(x[:, :, :real_rows], nan=0.0))
    want = merge_partials(clean(outs), jnp.asarray(np.where(np.isnan(maxes), -np.inf, maxes)[:, :, :real_rows]),
                          clean(sums), segment_ids=jnp.asarray(segment), num_segments=len(runs))
    for got, ref in zip((out, m, s), want):
        assert not np.any(np.isnan(np.asarray(got)))
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-6)
    assert np.all(np.asarray(out[1]) == 0) and np.all(np.asarray(m[1]) == -np.inf) and np.all(np.asarray(s[1]) == 0)
