"""The one backend switch: which implementation each call takes on which device."""

from __future__ import annotations

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
