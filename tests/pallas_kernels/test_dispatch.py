"""The one backend switch: which implementation each call takes on which device."""

from __future__ import annotations

import numpy as np
import pytest
import jax.numpy as jnp

from pallas_kernels import compat, dispatch


def _fake_gpu(monkeypatch, capability):
    monkeypatch.setattr(compat, "on_gpu", lambda: True)
    monkeypatch.setattr(compat, "gpu_compute_capability", lambda: capability)


def test_cpu_takes_the_reference_and_bad_names_raise():
    assert dispatch.resolve_backend("auto", 128) == "reference"
    assert dispatch.resolve_backend(None) == "reference"
    with pytest.raises(ValueError, match="'cuda' is not one of"):
        dispatch.resolve_backend("cuda")


def test_gpu_auto_prefers_mosaic_prefill_on_hopper_where_it_applies(monkeypatch):
    _fake_gpu(monkeypatch, (9, 0))
    assert dispatch.resolve_backend("auto", 128) == "mosaic"
    assert dispatch.resolve_backend("auto", 96) == "reference"  # no kernel for this head_dim
    q = jnp.zeros((512, 8, 128), jnp.bfloat16)
    pool = jnp.zeros((4, 8, 256, 128), jnp.bfloat16)
    assert dispatch.prefill_kernel(q, pool, "mosaic") == "mosaic"
    assert dispatch.prefill_kernel(q, pool, "triton") == "triton"  # named explicitly
    assert dispatch.prefill_kernel(q[:dispatch.MOSAIC_MIN_TOKENS - 1], pool, "mosaic") == "triton"  # short step
    assert dispatch.prefill_kernel(q, pool.astype(jnp.int8), "mosaic") == "triton"  # int8 KV
    assert dispatch.prefill_kernel(q, pool[:, :, :64], "mosaic") == "triton"  # rBlock below the KV tile
    assert dispatch.prefill_kernel(q.astype(jnp.float32), pool.astype(jnp.float32), "mosaic") == "triton"


def test_gpu_before_hopper_keeps_the_triton_prefill(monkeypatch):
    _fake_gpu(monkeypatch, (8, 0))
    q = jnp.zeros((512, 8, 128), jnp.bfloat16)
    pool = jnp.zeros((4, 8, 256, 128), jnp.bfloat16)
    assert dispatch.prefill_kernel(q, pool, dispatch.resolve_backend("auto", 128)) == "triton"


@pytest.mark.parametrize("backend,decode", [("reference", False), ("reference", True), ("triton", False),
                                            ("triton", True)])
def test_num_q_heads_attends_with_the_first_heads_only(backend, decode):
    """q holding more heads than it uses (the model's q|k after RoPE): every backend and path (decode
    kernel in place, the others on a slice) gives what those heads alone give; the extra heads are NaN."""
    rng = np.random.default_rng()
    lens = [1, 1, 1] if decode else [5, 9, 2]
    kv_lens = jnp.asarray([17, 40, 3], jnp.int32)
    cu_q_lens = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
    pool = jnp.asarray(rng.standard_normal((8, 2, 16, 64)), jnp.float32)
    tables = jnp.asarray([[0, 1, 2], [3, 4, 5], [6, 7, 0]], jnp.int32)
    q = jnp.asarray(rng.standard_normal((sum(lens), 4, 64)), jnp.float32)
    wide = jnp.concatenate([q, jnp.full((sum(lens), 2, 64), jnp.nan, jnp.float32)], axis=1)
    args = (pool, pool, tables, kv_lens, cu_q_lens)
    got = dispatch.ragged_attention(wide, *args, decode=decode, num_q_heads=4, backend=backend)
    want = dispatch.ragged_attention(q, *args, decode=decode, backend="reference")
    assert got.shape == q.shape
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("tokens,k,n", [(3, 256, 128), (65, 256, 128), (1, 688, 256)])
def test_unreduced_matmul_and_norm_agree_across_backends(tokens, k, n):
    """matmul_unreduced's output, whatever its form (partials on a decode-sized kernel step, a plain
    product otherwise), gives the same add + norm as the reference backend's. 688 x 256 is the tiny
    preset's down projection, whose default split (43 parts) is more than the norm kernel sums."""
    rng = np.random.default_rng()
    x = jnp.asarray(rng.standard_normal((tokens, k)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((k, n)) / 16, jnp.float32)
    resid = jnp.asarray(rng.standard_normal((tokens, n)), jnp.float32)
    g = jnp.asarray(rng.uniform(0.5, 1.5, n), jnp.float32)
    want = dispatch.add_rms_norm(resid, dispatch.matmul_unreduced(x, w, backend="reference"), g, eps=1e-6,
                                 backend="reference")
    delta = dispatch.matmul_unreduced(x, w, backend="triton")
    assert delta.ndim == (3 if tokens <= dispatch.FUSED_NORM_MAX_TOKENS else 2)
    got = dispatch.add_rms_norm(resid, delta, g, eps=1e-6, backend="triton")
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
