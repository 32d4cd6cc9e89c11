"""KV write: the one-kernel writer (interpret mode) and the scatter path give the same pool."""

from __future__ import annotations

import numpy as np
import pytest
import jax
import jax.numpy as jnp

from pallas_kernels import dispatch
from pallas_kernels.kv_write import write_kv, write_kv_kernel


def _case(rng, num_tokens, num_blocks=6, heads=2, block_size=16, head_dim=64, dtype=jnp.bfloat16):
    pool_shape = (num_blocks, heads, block_size, head_dim)
    k_pool = jnp.asarray(rng.standard_normal(pool_shape), dtype)
    v_pool = jnp.asarray(rng.standard_normal(pool_shape), dtype)
    k_new = jnp.asarray(rng.standard_normal((num_tokens, heads, head_dim)), jnp.float32)
    v_new = jnp.asarray(rng.standard_normal((num_tokens, heads, head_dim)), jnp.float32)
    slots = rng.choice(num_blocks * block_size, size=num_tokens, replace=False).astype(np.int32)
    slots[rng.random(num_tokens) < 0.3] = -1  # padding tokens
    return k_pool, v_pool, k_new, v_new, jnp.asarray(slots)


@pytest.mark.parametrize("num_tokens,dtype", [(1, jnp.bfloat16), (7, jnp.float16), (33, jnp.float32)])
def test_kernel_matches_scatter_and_touches_nothing_else(num_tokens, dtype):
    rng = np.random.default_rng()
    k_pool, v_pool, k_new, v_new, slots = _case(rng, num_tokens, dtype=dtype)
    want_k, want_v, _, _ = write_kv(k_pool, v_pool, k_new, v_new, slots)
    got_k, got_v = write_kv_kernel(k_pool, v_pool, k_new, v_new, slots, interpret=True)
    np.testing.assert_array_equal(np.asarray(got_k, np.float32), np.asarray(want_k, np.float32))
    np.testing.assert_array_equal(np.asarray(got_v, np.float32), np.asarray(want_v, np.float32))
    # Independent check against numpy: written rows hold the new tokens, every other row is unchanged.
    expect = np.asarray(k_pool, np.float32).copy()
    for t, slot in enumerate(np.asarray(slots)):
        if slot >= 0:
            expect[slot // 16, :, slot % 16] = np.asarray(k_new[t].astype(dtype), np.float32)
    np.testing.assert_array_equal(np.asarray(got_k, np.float32), expect)


def test_kernel_under_jit_with_donated_pools():
    rng = np.random.default_rng()
    k_pool, v_pool, k_new, v_new, slots = _case(rng, 5)
    want = write_kv(k_pool, v_pool, k_new, v_new, slots)[:2]
    step = jax.jit(lambda k, v, kn, vn, s: write_kv_kernel(k, v, kn, vn, s, interpret=True), donate_argnums=(0, 1))
    got = step(jnp.array(k_pool), jnp.array(v_pool), k_new, v_new, slots)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_heads_read_in_place_from_a_fused_projection(backend):
    """k and v taken at head offsets of wider arrays (the model's qk after RoPE and its qkv) write
    exactly what the same heads sliced out would."""
    rng = np.random.default_rng()
    k_pool, v_pool, k_new, v_new, slots = _case(rng, 6, heads=2)
    noise = lambda n: jnp.asarray(rng.standard_normal((6, n, 64)), jnp.float32)
    qk = jnp.concatenate([noise(4), k_new], axis=1)  # 4 "query" heads, then the 2 KV heads
    qkv = jnp.concatenate([noise(4), noise(2), v_new], axis=1)
    want = write_kv(k_pool, v_pool, k_new, v_new, slots)[:2]
    if backend == "triton":
        got = write_kv_kernel(k_pool, v_pool, qk, qkv, slots, k_first_head=4, v_first_head=6, interpret=True)
    else:
        got = dispatch.write_kv(k_pool, v_pool, qk, qkv, slots, k_first_head=4, v_first_head=6, backend=backend)[:2]
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_bad_inputs_raise():
    rng = np.random.default_rng(0)
    k_pool, v_pool, k_new, v_new, slots = _case(rng, 4)
    with pytest.raises(ValueError, match="int8"):
        write_kv_kernel(k_pool.astype(jnp.int8), v_pool.astype(jnp.int8), k_new, v_new, slots)
    with pytest.raises(ValueError, match=r"k_first_head 0 \+ 2 KV heads do not fit k_new \(4, 1, 64\)"):
        write_kv_kernel(k_pool, v_pool, k_new[:, :1], v_new[:, :1], slots)
    with pytest.raises(ValueError, match="v_first_head 1 "):
        write_kv_kernel(k_pool, v_pool, k_new, v_new, slots, v_first_head=1)
    with pytest.raises(ValueError, match="new K/V shape"):
        write_kv_kernel(k_pool, v_pool, k_new[..., :32], v_new[..., :32], slots)
    with pytest.raises(ValueError, match="slot_mapping shape"):
        write_kv_kernel(k_pool, v_pool, k_new, v_new, slots[:2])


def test_dispatch_keeps_int8_and_reference_on_the_scatter_path():
    rng = np.random.default_rng(1)
    k_pool, v_pool, k_new, v_new, slots = _case(rng, 3)
    ref = dispatch.write_kv(k_pool, v_pool, k_new, v_new, slots, backend="reference")
    want = write_kv(k_pool, v_pool, k_new, v_new, slots)
    for a, b in zip(ref[:2], want[:2]):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    q_pool = jnp.zeros(k_pool.shape, jnp.int8)
    scale = jnp.ones(k_pool.shape[:3], jnp.float32)
    out = dispatch.write_kv(q_pool, q_pool, k_new, v_new, slots, scale, scale, backend="triton")
    assert out[0].dtype == jnp.int8 and out[2] is not None  # scales written: the scatter path
