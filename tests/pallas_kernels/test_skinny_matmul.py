"""skinny_matmul in interpret mode vs a float64 numpy oracle and skinny_matmul_reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import compat
from pallas_kernels.skinny_matmul import (SkinnyBlockSizes, _skinny_call, default_block_sizes, skinny_matmul,
                                          skinny_matmul_partials, skinny_matmul_reference)
from tests.seeds import seed

# Per-dtype tolerance relative to sqrt(K) * max|x| * max|w| (the size of a sum of K products):
# the kernel and the oracle differ only by the output rounding and float32 summation order.
RTOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2, jnp.float16: 2e-3}


def _inputs(seed, m, k, n, dtype):
    kx, kw = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (m, k), jnp.float32).astype(dtype)
    w = jax.random.normal(kw, (k, n), jnp.float32).astype(dtype)
    return x, w


def _oracle(x, w):
    return np.asarray(x, np.float64) @ np.asarray(w, np.float64)


def _check(out, x, w, dtype):
    want = _oracle(x, w)
    scale = np.sqrt(x.shape[1]) * np.abs(np.asarray(x, np.float64)).max() * np.abs(np.asarray(w, np.float64)).max()
    got = np.asarray(out, np.float64)
    assert got.shape == want.shape
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, want, rtol=0, atol=RTOL[dtype] * scale)


@pytest.mark.parametrize("m, k, n, block_sizes", [
    (1, 512, 256, SkinnyBlockSizes(block_n=64, block_k=64, k_splits=4)),  # even splits, static loop
    (3, 640, 192, SkinnyBlockSizes(block_n=64, block_k=64, k_splits=3)),  # 10 chunks in splits of 4, 4, 2
    (16, 384, 128, SkinnyBlockSizes(block_n=128, block_k=32, k_splits=1)),  # no split: written in x.dtype
    (5, 200, 100, SkinnyBlockSizes(block_n=64, block_k=64, k_splits=2)),  # K, N not multiples of the tiles
    (33, 96, 48, SkinnyBlockSizes(block_n=32, block_k=32, k_splits=2)),  # 64 padded rows
    (64, 64, 32, None),  # the most rows, default sizes
])
def test_matches_oracle(m, k, n, block_sizes):
    x, w = _inputs(m * 1000 + k, m, k, n, jnp.bfloat16)
    out = skinny_matmul(x, w, block_sizes=block_sizes, interpret=True)
    assert out.dtype == jnp.bfloat16 and out.shape == (m, n)
    _check(out, x, w, jnp.bfloat16)
    ref = skinny_matmul_reference(x, w)
    assert ref.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), rtol=1e-2, atol=2e-1)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16])
def test_dtypes_and_out_dtype(dtype):
    x, w = _inputs(7, 3, 320, 96, dtype)
    bs = SkinnyBlockSizes(block_n=32, block_k=64, k_splits=3)
    out = skinny_matmul(x, w, block_sizes=bs, interpret=True)
    assert out.dtype == dtype
    _check(out, x, w, dtype)
    out32 = skinny_matmul(x, w, out_dtype=jnp.float32, block_sizes=bs, interpret=True)
    assert out32.dtype == jnp.float32
    # float32 output keeps the float32 accumulation: tight against the oracle whatever the input dtype.
    _check(out32, x, w, jnp.float32)


def test_partials_cover_every_split_and_only_real_rows():
    """Unwritten partial rows/columns would be garbage in the sum: check each split's part exactly."""
    m, k, n = 3, 448, 80  # 7 chunks of 64: splits of 3, 3, 1; N tail of 16 past 64
    x, w = _inputs(11, m, k, n, jnp.float32)
    bs = SkinnyBlockSizes(block_n=64, block_k=64, k_splits=3)
    parts = np.asarray(_skinny_call(x, w, out_dtype=jnp.float32, block_sizes=bs, interpret=True))
    assert parts.shape == (3, m, n)
    xs, ws = np.asarray(x, np.float64), np.asarray(w, np.float64)
    for s, (lo, hi) in enumerate([(0, 192), (192, 384), (384, 448)]):
        np.testing.assert_allclose(parts[s], xs[:, lo:hi] @ ws[lo:hi], rtol=0, atol=1e-4 * np.sqrt(k))


def test_poisoned_tails_are_not_read():
    """NaN past the logical end of x and w (a larger buffer sliced) must not reach the output."""
    m, k, n = 2, 150, 70
    x, w = _inputs(3, m, k, n, jnp.float32)
    x_big = jnp.full((m, k + 50), jnp.nan, jnp.float32).at[:, :k].set(x)
    w_big = jnp.full((k + 50, n + 50), jnp.nan, jnp.float32).at[:k, :n].set(w)
    out = jax.jit(lambda a, b: skinny_matmul(a[:, :k], b[:k, :n], block_sizes=SkinnyBlockSizes(64, 64, 2),
                                             interpret=True))(x_big, w_big)
    _check(out, x, w, jnp.float32)


def test_default_block_sizes_divide_llama_shapes():
    for k in (4096, 11008):
        for n in (4096, 11008, 12288, 22016, 32000):
            bs = default_block_sizes(1, k, n)
            assert n % bs.block_n == 0 and k % bs.block_k == 0, (k, n, bs)
            chunks, per_split, splits = bs.plan(k)
            assert (splits - 1) * per_split < chunks <= splits * per_split  # no empty split
    bs = default_block_sizes(1, 100, 24)  # awkward: still valid sizes, masks do the rest
    assert bs.block_n >= 16 and bs.block_k >= 16


@pytest.mark.parametrize("x_shape, w_shape, dtypes, match", [
    ((0, 64), (64, 32), (jnp.bfloat16, jnp.bfloat16), "rows"),
    ((65, 64), (64, 32), (jnp.bfloat16, jnp.bfloat16), "1 to 64"),
    ((2, 64), (63, 32), (jnp.bfloat16, jnp.bfloat16), "K = 64"),
    ((2, 2, 64), (64, 32), (jnp.bfloat16, jnp.bfloat16), r"\[M, K\]"),
    ((2, 64), (64, 32), (jnp.bfloat16, jnp.float32), "must equal"),
    ((2, 64), (64, 32), (jnp.int8, jnp.int8), "must be among"),
])
def test_bad_arguments(x_shape, w_shape, dtypes, match):
    x, w = jnp.zeros(x_shape, dtypes[0]), jnp.zeros(w_shape, dtypes[1])
    with pytest.raises(ValueError, match=match):
        skinny_matmul(x, w, interpret=True)


def test_bad_block_sizes():
    with pytest.raises(ValueError, match="block_n 96"):
        SkinnyBlockSizes(block_n=96)
    with pytest.raises(ValueError, match="block_k 8"):
        SkinnyBlockSizes(block_k=8)
    with pytest.raises(ValueError, match="k_splits 0"):
        SkinnyBlockSizes(k_splits=0)
    with pytest.raises(ValueError, match="num_warps 3"):
        SkinnyBlockSizes(num_warps=3)


@pytest.mark.gpu
@pytest.mark.skipif(not compat.on_gpu(), reason="needs a GPU")
@pytest.mark.parametrize("m, k, n", [(1, 4096, 4096), (8, 11008, 4096), (3, 4096, 11008), (5, 1000, 300)])
def test_gpu_matches_oracle(m, k, n):
    x, w = _inputs(m + k + n, m, k, n, jnp.bfloat16)
    _check(skinny_matmul(x, w), x, w, jnp.bfloat16)


@pytest.mark.parametrize("m, k, n, block_sizes, splits", [
    (3, 448, 80, SkinnyBlockSizes(block_n=64, block_k=64, k_splits=3), 3),
    (2, 128, 64, SkinnyBlockSizes(block_n=64, block_k=64, k_splits=1), 1),  # one split: still [1, M, N] float32
])
def test_unreduced_partials_sum_to_the_product(m, k, n, block_sizes, splits):
    x, w = _inputs(seed(52676), m, k, n, jnp.bfloat16)
    parts = skinny_matmul_partials(x, w, block_sizes=block_sizes, interpret=True)
    assert parts.shape == (splits, m, n) and parts.dtype == jnp.float32
    _check(jnp.sum(parts, axis=0), x, w, jnp.float32)
