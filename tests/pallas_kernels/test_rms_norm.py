"""Add + RMSNorm: the kernel (interpret mode) vs the reference, and the reference vs a float64 NumPy oracle."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import compat
from pallas_kernels.rms_norm import (MAX_DIM, MAX_PARTS, MAX_PROGRAM_ELEMENTS, RmsNormBlockSizes, add_rms_norm,
                                     add_rms_norm_reference, default_block_sizes, rms_norm, rms_norm_reference)
from tests.seeds import seed

EPS = 1e-5
DTYPES = [jnp.bfloat16, jnp.float16, jnp.float32]
# Kernel vs reference: the same rounding points, so they differ only where the float32 sum of squares
# (another order) or rsqrt's last bit moves a value across a rounding boundary of the output dtype:
# now and then 1 ulp of n, which the weight product can make 2 ulp (2^-6 relative for bfloat16).
RTOL = {jnp.bfloat16: 2.0**-6, jnp.float16: 2.0**-9, jnp.float32: 1e-5}
ATOL = {jnp.bfloat16: 1e-6, jnp.float16: 1e-6, jnp.float32: 1e-7}  # float16 subnormals near zero
# Such boundary cases are rare; a misplaced rounding point changes ~20% of bfloat16/float16 outputs.
MAX_MISMATCH = 0.02


def _seed() -> int:
    return seed(94201)  # fixed: tests/seeds.py


def _inputs(seed, t, d, dtype):
    """x, delta [t, d] with row magnitudes spread over 1e-3 .. 3e2 (small rows meet eps); weight [d] ~ U(-2, 2)."""
    rng = np.random.default_rng(seed)
    row_scale = 10.0 ** rng.uniform(-3, 2.5, size=(t, 1))
    x = jnp.asarray(rng.standard_normal((t, d)) * row_scale, dtype)
    delta = jnp.asarray(rng.standard_normal((t, d)) * row_scale, dtype)
    weight = jnp.asarray(rng.uniform(-2, 2, size=d), dtype)
    return x, delta, weight


def _f64(a) -> np.ndarray:
    return np.asarray(jnp.asarray(a, jnp.float32), np.float64)


def _assert_close(got, want, dtype, what):
    """Elementwise within RTOL, and (for 16-bit dtypes) almost all bitwise equal."""
    assert got.shape == want.shape and got.dtype == want.dtype, f"{what}: {got.shape} {got.dtype} vs {want.shape}"
    g, w = _f64(got), _f64(want)
    assert np.all(np.isfinite(g)), f"{what}: non-finite output"
    np.testing.assert_allclose(g, w, rtol=RTOL[dtype], atol=ATOL[dtype], err_msg=what)
    if dtype != jnp.float32:
        mismatch = float(np.mean(g != w))
        assert mismatch <= MAX_MISMATCH, f"{what}: {mismatch:.1%} of outputs differ bitwise"


def _oracle(x, delta, weight, dtype):
    """float64 NumPy with the reference's rounding points: (normed, h) rounded to dtype, and normed unrounded."""
    h = (_f64(x) + _f64(delta)).astype(dtype) if delta is not None else np.asarray(x)
    h64 = _f64(h)
    n64 = h64 / np.sqrt(np.mean(h64 * h64, axis=-1, keepdims=True) + EPS)
    normed = (_f64(weight) * _f64(n64.astype(dtype))).astype(dtype)
    return normed, h, _f64(weight) * n64


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_delta", [True, False])
@pytest.mark.parametrize("t, d", [(t, d) for t in (1, 3, 17) for d in (64, 200, 256)])
def test_kernel_matches_reference(t, d, dtype, with_delta):
    seed = _seed()
    x, delta, weight = _inputs(seed, t, d, dtype)
    what = f"seed={seed} t={t} d={d} {jnp.dtype(dtype).name} delta={with_delta}"
    if with_delta:
        normed, h = add_rms_norm(x, delta, weight, eps=EPS, interpret=True)
        want_normed, want_h = add_rms_norm_reference(x, delta, weight, eps=EPS)
        # The add is rounded once from the exact sum in both: bitwise equal, to each other and to float64.
        np.testing.assert_array_equal(_f64(h), _f64(want_h), err_msg=what)
        np.testing.assert_array_equal(_f64(h), _f64((_f64(x) + _f64(delta)).astype(dtype)), err_msg=what)
        assert h.dtype == dtype
    else:
        normed = rms_norm(x, weight, eps=EPS, interpret=True)
        want_normed = rms_norm_reference(x, weight, eps=EPS)
        h = x
    _assert_close(normed, want_normed, dtype, what)
    assert not np.allclose(_f64(normed), _f64(h), rtol=0.1), what  # the norm did something


@pytest.mark.parametrize("t, d, block_rows, dtype", [
    (17, 200, 4, jnp.bfloat16),  # 5 programs, the last with 1 real row of 4; masked columns
    (5, 256, 2, jnp.float16),  # 3 programs, rows masked, columns not
    (3, 64, 1, jnp.float32),  # no masks at all
    (2, 8192, 1, jnp.bfloat16),  # the largest Llama hidden size in one pass
    (3, 5000, 2, jnp.float32),  # 8192 padded columns, 3192 masked
])
def test_block_row_edges_and_wide_rows(t, d, block_rows, dtype):
    seed = _seed()
    x, delta, weight = _inputs(seed, t, d, dtype)
    what = f"seed={seed} t={t} d={d} block_rows={block_rows}"
    bs = RmsNormBlockSizes(block_rows=block_rows, num_warps=4)
    normed, h = add_rms_norm(x, delta, weight, eps=EPS, block_sizes=bs, interpret=True)
    want_normed, want_h = add_rms_norm_reference(x, delta, weight, eps=EPS)
    np.testing.assert_array_equal(_f64(h), _f64(want_h), err_msg=what)
    _assert_close(normed, want_normed, dtype, what)
    _assert_close(rms_norm(x, weight, eps=EPS, block_sizes=bs, interpret=True),
                  rms_norm_reference(x, weight, eps=EPS), dtype, what)


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_matches_float64_oracle(dtype):
    seed = _seed()
    x, delta, weight = _inputs(seed, 9, 200, dtype)
    what = f"seed={seed} {jnp.dtype(dtype).name}"
    normed, h = add_rms_norm_reference(x, delta, weight, eps=EPS)
    want_normed, want_h, exact = _oracle(x, delta, weight, dtype)
    np.testing.assert_array_equal(_f64(h), _f64(want_h), err_msg=what)
    assert normed.dtype == dtype and h.dtype == dtype
    _assert_close(normed, jnp.asarray(want_normed), dtype, what)
    # Against the unrounded value: two roundings to dtype (n, then weight * n), each half an ulp.
    bound = {jnp.bfloat16: 2.0**-7, jnp.float16: 2.0**-10, jnp.float32: 1e-5}[dtype]
    np.testing.assert_allclose(_f64(normed), exact, rtol=bound, atol=ATOL[dtype], err_msg=what)
    want_plain, _, _ = _oracle(x, None, weight, dtype)
    _assert_close(rms_norm_reference(x, weight, eps=EPS), jnp.asarray(want_plain), dtype, what)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_rounding_points_are_checked(dtype):
    """Skipping the rounding of n before the weight product is caught by _assert_close (and the kernel is not)."""
    seed = _seed()
    x, delta, weight = _inputs(seed, 17, 256, dtype)
    h = x + delta
    h32 = h.astype(jnp.float32)
    n32 = h32 * jax.lax.rsqrt(jnp.mean(h32 * h32, axis=-1, keepdims=True) + EPS)
    unrounded = (weight.astype(jnp.float32) * n32).astype(dtype)
    want, _ = add_rms_norm_reference(x, delta, weight, eps=EPS)
    with pytest.raises(AssertionError, match="differ bitwise"):
        _assert_close(unrounded, want, dtype, f"seed={seed}")
    got, _ = add_rms_norm(x, delta, weight, eps=EPS, interpret=True)
    _assert_close(got, want, dtype, f"seed={seed}")


def test_rows_are_independent_and_zero_rows_stay_finite():
    """A NaN row poisons only itself, even sharing a program; an all-zero row normalises to zeros (eps)."""
    seed = _seed()
    x, delta, weight = _inputs(seed, 7, 200, jnp.bfloat16)
    x = x.at[2, 5].set(jnp.nan).at[4].set(0)
    delta = delta.at[4].set(0)
    normed, h = add_rms_norm(x, delta, weight, eps=EPS, block_sizes=RmsNormBlockSizes(block_rows=4), interpret=True)
    assert np.all(np.isnan(_f64(normed[2]))), f"seed={seed}"
    np.testing.assert_array_equal(_f64(normed[4]), 0.0, err_msg=f"seed={seed}")
    clean = np.array([0, 1, 3, 4, 5, 6])
    want_normed, want_h = add_rms_norm_reference(x[clean], delta[clean], weight, eps=EPS)
    _assert_close(normed[clean], want_normed, jnp.bfloat16, f"seed={seed}")
    np.testing.assert_array_equal(_f64(h[clean]), _f64(want_h), err_msg=f"seed={seed}")


def test_eps_and_weight_reach_the_output():
    seed = _seed()
    x, delta, weight = _inputs(seed, 3, 64, jnp.float32)
    x = x * 1e-3  # mean square ~1e-6 or less: eps 1e-5 vs 1e-2 makes a large difference
    a, _ = add_rms_norm(x, delta * 1e-3, weight, eps=1e-5, interpret=True)
    b, _ = add_rms_norm(x, delta * 1e-3, weight, eps=1e-2, interpret=True)
    assert np.all(np.abs(_f64(b)) < np.abs(_f64(a)) + 1e-12) and not np.allclose(_f64(a), _f64(b)), f"seed={seed}"
    ones = rms_norm(x, jnp.ones_like(weight), eps=EPS, interpret=True)
    _assert_close(rms_norm(x, weight, eps=EPS, interpret=True), weight * ones, jnp.float32, f"seed={seed}")


def test_under_jit():
    seed = _seed()
    x, delta, weight = _inputs(seed, 5, 128, jnp.bfloat16)
    got = jax.jit(lambda a, b, w: add_rms_norm(a, b, w, eps=EPS, interpret=True))(x, delta, weight)
    want = add_rms_norm_reference(x, delta, weight, eps=EPS)
    _assert_close(got[0], want[0], jnp.bfloat16, f"seed={seed}")
    np.testing.assert_array_equal(_f64(got[1]), _f64(want[1]))


def test_default_block_sizes():
    for t in (1, 3, 8, 64, 300):
        for d in (64, 200, 4096, 5120, 8192, 11008, MAX_DIM):
            bs = default_block_sizes(t, d)
            d_pow2 = 1 << (d - 1).bit_length()
            assert bs.block_rows * d_pow2 <= MAX_PROGRAM_ELEMENTS, (t, d, bs)
            assert bs.block_rows <= 1 << (t - 1).bit_length(), (t, d, bs)
    assert default_block_sizes(1, 4096) == RmsNormBlockSizes(block_rows=1, num_warps=4)
    assert default_block_sizes(64, 4096) == RmsNormBlockSizes(block_rows=1, num_warps=4)
    assert default_block_sizes(8, 8192) == RmsNormBlockSizes(block_rows=1, num_warps=8)
    assert default_block_sizes(17, 64).block_rows == 32


@pytest.mark.parametrize("x_shape, d_shape, w_shape, dtypes, eps, match", [
    ((3, 128), (3, 64), (128,), ("bfloat16",) * 3, EPS, r"delta shape \(3, 64\) != x shape \(3, 128\)"),
    ((3, 128), (3, 128), (100,), ("bfloat16",) * 3, EPS, r"weight shape \(100,\) != \(D,\) = \(128,\)"),
    ((2, 3, 128), (2, 3, 128), (128,), ("bfloat16",) * 3, EPS, r"\[T, D\]"),
    ((0, 128), (0, 128), (128,), ("bfloat16",) * 3, EPS, "T 0 and D 128 must be >= 1"),
    ((3, 128), (3, 128), (128,), ("bfloat16", "float32", "bfloat16"), EPS, "delta dtype float32 must equal x dtype"),
    ((3, 128), (3, 128), (128,), ("float16", "float16", "float32"), EPS, "weight dtype float32 must equal x dtype"),
    ((3, 128), (3, 128), (128,), ("int32",) * 3, EPS, "x dtype int32 is not supported; use one of bfloat16"),
    ((3, 128), (3, 128), (128,), ("bfloat16",) * 3, 0.0, "eps 0.0 must be"),
    ((3, 128), (3, 128), (128,), ("bfloat16",) * 3, -1e-6, "eps -1e-06 must be"),
    ((1, MAX_DIM + 1), (1, MAX_DIM + 1), (MAX_DIM + 1,), ("bfloat16",) * 3, EPS, f"D {MAX_DIM + 1} exceeds {MAX_DIM}"),
])
def test_bad_arguments(x_shape, d_shape, w_shape, dtypes, eps, match):
    x, delta, weight = (jnp.zeros(s, dt) for s, dt in zip((x_shape, d_shape, w_shape), dtypes))
    with pytest.raises(ValueError, match=match):
        add_rms_norm(x, delta, weight, eps=eps, interpret=True)
    if "delta" not in match:
        with pytest.raises(ValueError, match=match):
            rms_norm(x, weight, eps=eps, interpret=True)


def test_bad_block_sizes():
    with pytest.raises(ValueError, match="block_rows 3 must be a power of two"):
        RmsNormBlockSizes(block_rows=3)
    with pytest.raises(ValueError, match="num_warps 3"):
        RmsNormBlockSizes(num_warps=3)
    x = jnp.zeros((4, 256), jnp.bfloat16)
    with pytest.raises(ValueError, match=f"block_rows 128 x padded D 256 exceeds {MAX_PROGRAM_ELEMENTS}"):
        rms_norm(x, jnp.ones((256,), jnp.bfloat16), eps=EPS, block_sizes=RmsNormBlockSizes(block_rows=128))


@pytest.mark.gpu
@pytest.mark.skipif(not compat.on_gpu(), reason="needs a GPU")
@pytest.mark.parametrize("t", [1, 8, 64, 300])
def test_gpu_matches_reference(t):
    seed = _seed()
    x, delta, weight = _inputs(seed, t, 4096, jnp.bfloat16)
    what = f"seed={seed} t={t}"
    normed, h = add_rms_norm(x, delta, weight, eps=EPS)
    want_normed, want_h = add_rms_norm_reference(x, delta, weight, eps=EPS)
    np.testing.assert_array_equal(_f64(h), _f64(want_h), err_msg=what)
    _assert_close(normed, want_normed, jnp.bfloat16, what)
    _assert_close(rms_norm(x, weight, eps=EPS), rms_norm_reference(x, weight, eps=EPS), jnp.bfloat16, what)
    partials = jnp.stack([delta.astype(jnp.float32) * f for f in (0.5, 0.25, 0.25)])  # sums to delta exactly
    got_normed, got_h = add_rms_norm(x, partials, weight, eps=EPS)
    np.testing.assert_array_equal(_f64(got_h), _f64(want_h), err_msg=what + " partials")
    _assert_close(got_normed, want_normed, jnp.bfloat16, what + " partials")


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("t, d, parts", [(1, 256, 5), (3, 200, 2), (17, 64, 1)])
def test_split_k_partials_as_delta(t, d, parts, dtype):
    """delta as a matmul's [S, T, D] float32 split-K partials: summed, rounded to x.dtype, then added."""
    seed = _seed()
    x, _, weight = _inputs(seed, t, d, dtype)
    rng = np.random.default_rng(seed + 1)
    partials = jnp.asarray(rng.standard_normal((parts, t, d)) * np.abs(_f64(x)).max(axis=1, keepdims=True), jnp.float32)
    what = f"seed={seed} t={t} d={d} parts={parts} {jnp.dtype(dtype).name}"
    normed, h = add_rms_norm(x, partials, weight, eps=EPS, interpret=True)
    want_normed, want_h = add_rms_norm_reference(x, partials, weight, eps=EPS)
    # The partials' float32 sum runs in another order in the kernel, the reference and float64: where
    # x and the partials nearly cancel they differ by a few ulps of the operands' size, not of the
    # result's, so h is bounded by sum |operands|; normed inherits that through its row (looser check).
    p64 = np.asarray(partials, np.float64)
    operands = np.abs(_f64(x)) + np.abs(p64).sum(axis=0)

    def check_h(got, ref, name):
        limit = RTOL[dtype] * np.abs(ref) + 4 * float(jnp.finfo(dtype).eps) * operands
        err = np.abs(_f64(got) - ref)
        assert np.all(err <= limit), f"{what} {name}: off by {float((err - limit).max())} past the bound"

    oracle = (_f64(x) + _f64(jnp.asarray(p64.sum(axis=0), jnp.float32).astype(dtype))).astype(np.float32)
    check_h(want_h, _f64(jnp.asarray(oracle).astype(dtype)), "reference h vs float64")
    check_h(h, _f64(want_h), "kernel h vs reference")
    assert h.dtype == want_h.dtype and normed.dtype == want_normed.dtype
    np.testing.assert_allclose(_f64(normed), _f64(want_normed), rtol=4 * RTOL[dtype], atol=1e-3, err_msg=what + " normed")


def test_bad_partials():
    x, w = jnp.zeros((2, 64), jnp.bfloat16), jnp.ones((64,), jnp.bfloat16)
    with pytest.raises(ValueError, match="delta partials dtype bfloat16 must be float32"):
        add_rms_norm(x, jnp.zeros((3, 2, 64), jnp.bfloat16), w, eps=EPS, interpret=True)
    with pytest.raises(ValueError, match=r"delta partials shape \(3, 2, 32\) must be"):
        add_rms_norm(x, jnp.zeros((3, 2, 32), jnp.float32), w, eps=EPS, interpret=True)
    with pytest.raises(ValueError, match=f"1 <= S <= {MAX_PARTS}"):
        add_rms_norm(x, jnp.zeros((MAX_PARTS + 1, 2, 64), jnp.float32), w, eps=EPS, interpret=True)
