"""KV write: the scatter path, and RoPE + the KV write as one kernel (interpret mode) against it."""

from __future__ import annotations

import numpy as np
import pytest
import jax
import jax.numpy as jnp

from pallas_kernels import compat, dispatch
from pallas_kernels.kv_write import rope_write_kv, rope_write_kv_kernel, write_kv
from tests.seeds import seed


def _case(rng, num_tokens, num_blocks=6, heads=2, block_size=16, head_dim=64, dtype=jnp.bfloat16):
    pool_shape = (num_blocks, heads, block_size, head_dim)
    k_pool = jnp.asarray(rng.standard_normal(pool_shape), dtype)
    v_pool = jnp.asarray(rng.standard_normal(pool_shape), dtype)
    k_new = jnp.asarray(rng.standard_normal((num_tokens, heads, head_dim)), jnp.float32)
    v_new = jnp.asarray(rng.standard_normal((num_tokens, heads, head_dim)), jnp.float32)
    slots = rng.choice(num_blocks * block_size, size=num_tokens, replace=False).astype(np.int32)
    slots[rng.random(num_tokens) < 0.3] = -1  # padding tokens
    return k_pool, v_pool, k_new, v_new, jnp.asarray(slots)


def _rope_case(rng, num_tokens, q_heads, kv_heads, head_dim, dtype, num_blocks=6, block_size=16):
    k_pool, v_pool, _, _, slots = _case(rng, num_tokens, num_blocks, kv_heads, block_size, head_dim, dtype)
    # Grouped per KV head: [T, Hkv, G + 2, D], each KV head's G query heads, then its k, then its v.
    qkv = jnp.asarray(rng.standard_normal((num_tokens, kv_heads, q_heads // kv_heads + 2, head_dim)), dtype)
    positions = rng.integers(0, 100_000, num_tokens)
    inv_freq = 1.0 / 10000.0 ** (np.arange(0, head_dim, 2) / head_dim)
    angles = (positions[:, None] * inv_freq[None, :]).astype(np.float32)
    return k_pool, v_pool, qkv, jnp.asarray(np.cos(angles)), jnp.asarray(np.sin(angles)), slots


def _split_f64(qkv):
    """(q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]) of a grouped qkv, in float64 numpy (query head h
    is [h // G, h % G])."""
    x = np.asarray(jnp.asarray(qkv, jnp.float32), np.float64)
    g = x.shape[2] - 2
    return x[:, :, :g].reshape(x.shape[0], -1, x.shape[3]), x[:, :, g], x[:, :, g + 1]


def _rotate_f64(x, cos, sin):
    """The rotate-half RoPE in float64 numpy: x [T, H, D] by the (float32) angle tables given."""
    x = np.asarray(x, np.float64)
    half = x.shape[-1] // 2
    c, s = (np.asarray(t, np.float64)[:, None, :] for t in (cos, sin))
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def test_scatter_writes_the_new_tokens_and_touches_nothing_else():
    rng = np.random.default_rng(seed(49941))
    k_pool, v_pool, k_new, v_new, slots = _case(rng, 9)
    got_k, got_v, _, _ = write_kv(k_pool, v_pool, k_new, v_new, slots)
    for got, pool, new in ((got_k, k_pool, k_new), (got_v, v_pool, v_new)):
        expect = np.asarray(pool, np.float32).copy()
        for t, slot in enumerate(np.asarray(slots)):
            if slot >= 0:
                expect[slot // 16, :, slot % 16] = np.asarray(new[t].astype(pool.dtype), np.float32)
        np.testing.assert_array_equal(np.asarray(got, np.float32), expect)


def _ulps(dtype) -> float:
    return {jnp.dtype(jnp.bfloat16): 2.0 ** -7, jnp.dtype(jnp.float16): 2.0 ** -10,
            jnp.dtype(jnp.float32): 2.0 ** -22}[jnp.dtype(dtype)]


@pytest.mark.parametrize("num_tokens,q_heads,kv_heads,head_dim,dtype", [
    (1, 4, 4, 64, jnp.bfloat16), (7, 8, 2, 128, jnp.float16), (33, 4, 1, 64, jnp.float32), (5, 2, 2, 128, jnp.bfloat16)])
def test_rope_write_kernel_matches_reference_and_touches_nothing_else(num_tokens, q_heads, kv_heads, head_dim, dtype):
    rng = np.random.default_rng(seed(49942))
    k_pool, v_pool, qkv, cos, sin, slots = _rope_case(rng, num_tokens, q_heads, kv_heads, head_dim, dtype)
    g = q_heads // kv_heads
    want_q, want_k, want_v, _, _ = rope_write_kv(k_pool, v_pool, qkv, cos, sin, slots)
    got_q, got_k, got_v = rope_write_kv_kernel(k_pool, v_pool, qkv, cos, sin, slots, interpret=True)
    assert got_q.shape == (num_tokens, kv_heads, g, head_dim) and got_q.dtype == qkv.dtype
    assert want_q.shape == (num_tokens, kv_heads, g + 1, head_dim)  # each group's q then k, rotated
    # One rounding of the dtype apart at most: float32 rotations may contract into FMAs differently.
    tol = dict(rtol=_ulps(dtype), atol=_ulps(dtype))
    np.testing.assert_allclose(np.asarray(got_q, np.float32), np.asarray(want_q[:, :, :g], np.float32), **tol)
    np.testing.assert_allclose(np.asarray(got_k, np.float32), np.asarray(want_k, np.float32), **tol)
    np.testing.assert_array_equal(np.asarray(got_v, np.float32), np.asarray(want_v, np.float32))
    # Against float64 numpy: q and the written k rotated, v as given, every other pool row unchanged.
    f64 = lambda a: np.asarray(jnp.asarray(a, jnp.float32), np.float64)
    q64, k64, v64 = _split_f64(qkv)
    np.testing.assert_allclose(f64(got_q).reshape(num_tokens, q_heads, head_dim), _rotate_f64(q64, cos, sin),
                               rtol=2 * _ulps(dtype), atol=2 * _ulps(dtype) * 4)
    k_rot = _rotate_f64(k64, cos, sin)
    expect_k, expect_v = f64(k_pool).copy(), f64(v_pool).copy()
    for t, slot in enumerate(np.asarray(slots)):
        if slot >= 0:
            expect_k[slot // 16, :, slot % 16] = k_rot[t]
            expect_v[slot // 16, :, slot % 16] = v64[t]
    np.testing.assert_allclose(f64(got_k), expect_k, rtol=2 * _ulps(dtype), atol=2 * _ulps(dtype) * 4)
    np.testing.assert_array_equal(f64(got_v), expect_v)


@pytest.mark.parametrize("num_parts,dtype", [(1, jnp.bfloat16), (2, jnp.bfloat16), (5, jnp.float16), (3, jnp.float32)])
def test_rope_write_kernel_sums_split_k_partials(num_parts, dtype):
    """qkv as the skinny matmul's float32 split-K partials: summed, rounded to dtype, then as a whole qkv."""
    rng = np.random.default_rng(seed(49943))
    k_pool, v_pool, qkv, cos, sin, slots = _rope_case(rng, 6, 8, 2, 64, dtype)
    parts = jnp.asarray(rng.standard_normal((num_parts, *qkv.shape)), jnp.float32)
    whole = jnp.sum(parts, axis=0).astype(dtype)
    want = rope_write_kv(k_pool, v_pool, whole, cos, sin, slots)
    ref = rope_write_kv(k_pool, v_pool, parts, cos, sin, slots, dtype=dtype)
    for a, b in zip(ref[:3], want[:3]):  # the reference with partials is the reference on their sum
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    got = rope_write_kv_kernel(k_pool, v_pool, parts, cos, sin, slots, dtype=dtype, interpret=True)
    assert got[0].dtype == dtype
    # The partials' float32 sum may round differently in the last bit (order of the adds): 2 ulps.
    tol = dict(rtol=2 * _ulps(dtype), atol=2 * _ulps(dtype))
    np.testing.assert_allclose(np.asarray(got[0], np.float32), np.asarray(want[0][:, :, :4], np.float32), **tol)
    for a, b in zip(got[1:], want[1:3]):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), **tol)
    # Untouched rows stay: the pools differ from the originals only at the written slots.
    written = np.zeros(k_pool.shape[0] * k_pool.shape[2], bool)
    written[np.asarray(slots)[np.asarray(slots) >= 0]] = True
    for got_pool, pool in ((got[1], k_pool), (got[2], v_pool)):
        unchanged = np.asarray(got_pool, np.float32).transpose(0, 2, 1, 3).reshape(written.size, -1)[~written]
        np.testing.assert_array_equal(
            unchanged, np.asarray(pool, np.float32).transpose(0, 2, 1, 3).reshape(written.size, -1)[~written])


def test_rope_write_kernel_under_jit_with_donated_pools():
    rng = np.random.default_rng(seed(49944))
    k_pool, v_pool, qkv, cos, sin, slots = _rope_case(rng, 5, 4, 2, 64, jnp.float32)
    want = rope_write_kv(k_pool, v_pool, qkv, cos, sin, slots)
    step = jax.jit(lambda k, v, *a: rope_write_kv_kernel(k, v, *a, interpret=True), donate_argnums=(0, 1))
    got = step(jnp.array(k_pool), jnp.array(v_pool), qkv, cos, sin, slots)
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0][:, :, :2]), rtol=1e-6, atol=1e-6)
    for a, b in zip(got[1:], want[1:3]):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


def test_bad_inputs_raise():
    rng = np.random.default_rng(0)
    k_pool, v_pool, qkv, cos, sin, slots = _rope_case(rng, 4, 4, 2, 64, jnp.bfloat16)
    with pytest.raises(ValueError, match="int8"):
        rope_write_kv_kernel(k_pool.astype(jnp.int8), v_pool.astype(jnp.int8), qkv, cos, sin, slots)
    with pytest.raises(ValueError, match=r"qkv shape \(4, 1, 4, 64\) != \(\[parts,\] tokens, 2, G \+ 2, 64\)"):
        rope_write_kv_kernel(k_pool, v_pool, qkv[:, :1], cos, sin, slots)  # one KV head's group, the pool has 2
    with pytest.raises(ValueError, match=r"qkv shape \(4, 2, 2, 64\) != .* with G >= 1"):
        rope_write_kv_kernel(k_pool, v_pool, qkv[:, :, 2:], cos, sin, slots)  # k and v, no query head
    with pytest.raises(ValueError, match=r"qkv shape \(4, 8, 64\)"):
        rope_write_kv_kernel(k_pool, v_pool, qkv.reshape(4, 8, 64), cos, sin, slots)  # the ungrouped layout
    with pytest.raises(ValueError, match=r"qkv shape \(4, 2, 4, 32\)"):
        rope_write_kv_kernel(k_pool, v_pool, qkv[..., :32], cos, sin, slots)
    with pytest.raises(ValueError, match=r"sin shape \(4, 16\) != \(tokens, head_dim // 2\) = \(4, 32\)"):
        rope_write_kv_kernel(k_pool, v_pool, qkv, cos, sin[:, :16], slots)
    with pytest.raises(ValueError, match="slot_mapping shape"):
        rope_write_kv_kernel(k_pool, v_pool, qkv, cos, sin, slots[:2])
    with pytest.raises(ValueError, match="v_pool"):
        rope_write_kv_kernel(k_pool, v_pool[:, :1], qkv, cos, sin, slots)
    with pytest.raises(ValueError, match="partials .* must be float32, got bfloat16"):
        rope_write_kv_kernel(k_pool, v_pool, qkv[None], cos, sin, slots, dtype=jnp.bfloat16)
    for fn in (rope_write_kv, rope_write_kv_kernel):
        with pytest.raises(ValueError, match="partials needs the projection's dtype"):
            fn(k_pool, v_pool, qkv[None].astype(jnp.float32), cos, sin, slots)


def test_dispatch_keeps_int8_and_reference_on_the_scatter_path():
    rng = np.random.default_rng(1)
    k_pool, v_pool, qkv, cos, sin, slots = _rope_case(rng, 3, 4, 2, 64, jnp.float32)
    ref = dispatch.rope_write_kv(k_pool, v_pool, qkv, cos, sin, slots, kernels=dispatch.REFERENCE)
    want = rope_write_kv(k_pool, v_pool, qkv, cos, sin, slots)
    for a, b in zip(ref[:3], want[:3]):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    q_pool = jnp.zeros(k_pool.shape, jnp.int8)
    scale = jnp.ones(k_pool.shape[:3], jnp.float32)
    kernels = dispatch.default_kernels("triton", on_gpu=False)
    out = dispatch.rope_write_kv(q_pool, q_pool, qkv, cos, sin, slots, scale, scale, kernels=kernels)
    assert out[1].dtype == jnp.int8 and out[3] is not None  # scales written: the scatter path
    assert out[0].shape == (3, 2, 3, 64)  # rotated q|k per group: the decode kernel reads its 2 queries in place


@pytest.mark.gpu
@pytest.mark.skipif(not compat.on_gpu(), reason="needs a GPU")
@pytest.mark.parametrize("num_tokens,q_heads,kv_heads,dtype", [
    (1, 32, 32, jnp.bfloat16), (300, 32, 32, jnp.bfloat16), (9, 64, 8, jnp.float16), (5, 8, 1, jnp.float32)])
def test_gpu_rope_write_kernel_matches_reference(num_tokens, q_heads, kv_heads, dtype):
    """The compiled kernel (no interpret mode), Llama-2-7B's head_dim and a 256-token rBlock pool."""
    rng = np.random.default_rng(seed(49945))
    k_pool, v_pool, qkv, cos, sin, slots = _rope_case(rng, num_tokens, q_heads, kv_heads, 128, dtype,
                                                      num_blocks=4, block_size=256)
    g = q_heads // kv_heads
    want_q, want_k, want_v, _, _ = rope_write_kv(k_pool, v_pool, qkv, cos, sin, slots)
    got_q, got_k, got_v = rope_write_kv_kernel(k_pool, v_pool, qkv, cos, sin, slots)
    tol = dict(rtol=_ulps(dtype), atol=_ulps(dtype))
    np.testing.assert_allclose(np.asarray(got_q, np.float32), np.asarray(want_q[:, :, :g], np.float32), **tol)
    np.testing.assert_allclose(np.asarray(got_k, np.float32), np.asarray(want_k, np.float32), **tol)
    np.testing.assert_array_equal(np.asarray(got_v, np.float32), np.asarray(want_v, np.float32))
    # The same projection as float32 split-K partials (halves: their sum is exact), as a decode step passes it.
    halves = jnp.stack([qkv.astype(jnp.float32) * 0.5] * 2)
    got = rope_write_kv_kernel(k_pool, v_pool, halves, cos, sin, slots, dtype=dtype)
    np.testing.assert_allclose(np.asarray(got[0], np.float32), np.asarray(want_q[:, :, :g], np.float32), **tol)
    np.testing.assert_allclose(np.asarray(got[1], np.float32), np.asarray(want_k, np.float32), **tol)
    np.testing.assert_array_equal(np.asarray(got[2], np.float32), np.asarray(want_v, np.float32))
