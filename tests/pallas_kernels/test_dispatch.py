"""The one backend switch: which implementation each call takes on which device."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import jax
import jax.numpy as jnp

from pallas_kernels import compat, dispatch
from tests.seeds import seed


def _fake_gpu(monkeypatch, capability):
    monkeypatch.setattr(compat, "on_gpu", lambda: True)
    monkeypatch.setattr(compat, "gpu_compute_capability", lambda: capability)


def test_cpu_takes_the_reference_and_bad_names_raise():
    assert dispatch.default_kernels("auto", head_dim=128) == dispatch.REFERENCE == dispatch.Kernels()
    assert dispatch.default_kernels(None) == dispatch.REFERENCE
    assert dispatch.default_kernels("reference", on_gpu=True) == dispatch.REFERENCE
    with pytest.raises(ValueError, match="'cuda' is not one of"):
        dispatch.default_kernels("cuda")
    # Named on the CPU, the kernels run in the interpreter.
    triton = dispatch.default_kernels("triton")
    assert triton.interpret and triton.decode_attention == triton.prefill_attention == "triton"
    assert dispatch.default_kernels("mosaic").prefill_attention == "triton"  # no Hopper here


def test_kernels_are_hashable_and_validated():
    """A static jit argument: equal descriptions hash equal; schedules are part of it; bad names raise."""
    from pallas_kernels.ragged_decode import DecodeBlockSizes

    a = dispatch.Kernels(decode_attention="triton", decode_block_sizes=DecodeBlockSizes(block_k=32))
    b = dispatch.Kernels(decode_attention="triton", decode_block_sizes=DecodeBlockSizes(block_k=32))
    assert a == b and hash(a) == hash(b) and len({a, b, dispatch.REFERENCE}) == 2
    assert a != dataclasses.replace(a, decode_block_sizes=DecodeBlockSizes(block_k=64))
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.decode_attention = "reference"
    for field, bad in (("decode_attention", "mosaic"), ("prefill_attention", "cuda"), ("rope_kv_write", "triton"),
                       ("decode_layer", "auto")):
        with pytest.raises(ValueError, match=f"Kernels.{field} '{bad}' is not one of"):
            dispatch.Kernels(**{field: bad})
    with pytest.raises(ValueError, match="fused_norm_max_tokens 65 must be in"):
        dispatch.Kernels(fused_norm_max_tokens=65)
    with pytest.raises(ValueError, match="mosaic_min_tokens 0"):
        dispatch.Kernels(mosaic_min_tokens=0)


def test_gpu_auto_prefers_mosaic_prefill_on_hopper_where_it_applies(monkeypatch):
    _fake_gpu(monkeypatch, (9, 0))
    auto = dispatch.default_kernels("auto", head_dim=128)
    assert (auto.decode_attention, auto.prefill_attention, auto.rope_kv_write, auto.decode_layer) == (
        "triton", "mosaic", "pallas", "pallas") and not auto.interpret  # decode runs Triton, as it always did
    unsupported = dispatch.default_kernels("auto", head_dim=96)  # no attention kernel for this head_dim
    assert unsupported.decode_attention == unsupported.prefill_attention == unsupported.rope_kv_write == "reference"
    assert unsupported.decode_layer == "pallas" and not unsupported.interpret  # add + norm, matmuls: any width
    q = jnp.zeros((512, 8, 128), jnp.bfloat16)
    pool = jnp.zeros((4, 8, 256, 128), jnp.bfloat16)
    mosaic, triton = auto, dispatch.default_kernels("triton")
    assert dispatch.prefill_kernel(q, pool, mosaic) == "mosaic"
    assert dispatch.prefill_kernel(q, pool, triton) == "triton"  # named explicitly
    assert dispatch.prefill_kernel(q[:dispatch.MOSAIC_MIN_TOKENS - 1], pool, mosaic) == "triton"  # short step
    assert dispatch.prefill_kernel(q[:200], pool, dataclasses.replace(mosaic, mosaic_min_tokens=256)) == "triton"
    assert dispatch.prefill_kernel(q, pool.astype(jnp.int8), mosaic) == "triton"  # int8 KV
    assert dispatch.prefill_kernel(q, pool[:, :, :64], mosaic) == "triton"  # rBlock below the KV tile
    assert dispatch.prefill_kernel(q.astype(jnp.float32), pool.astype(jnp.float32), mosaic) == "triton"


def test_gpu_before_hopper_keeps_the_triton_prefill(monkeypatch):
    _fake_gpu(monkeypatch, (8, 0))
    q = jnp.zeros((512, 8, 128), jnp.bfloat16)
    pool = jnp.zeros((4, 8, 256, 128), jnp.bfloat16)
    for name in ("auto", "mosaic"):
        kernels = dispatch.default_kernels(name, head_dim=128)
        assert kernels.prefill_attention == "triton" and dispatch.prefill_kernel(q, pool, kernels) == "triton"


def test_dispatch_queries_no_device_inside_a_trace(monkeypatch):
    """Every choice is read from Kernels: with the device queries broken, a traced step still dispatches."""
    kernels = dispatch.default_kernels("triton", head_dim=64)

    def fail():
        raise AssertionError("a device was queried inside the trace")

    monkeypatch.setattr(compat, "on_gpu", fail)
    monkeypatch.setattr(compat, "gpu_compute_capability", fail)
    pool = jnp.zeros((4, 2, 16, 64), jnp.float32)
    args = (pool, pool, jnp.zeros((2, 2), jnp.int32), jnp.asarray([3, 5], jnp.int32))
    q = jnp.ones((2, 2, 3, 64), jnp.float32)
    for decode in (True, False):
        jax.eval_shape(lambda q: dispatch.ragged_attention(q, *args, jnp.arange(3, dtype=jnp.int32), single_query=decode,
                                                           num_q_heads=4, kernels=kernels), q)
    w = jnp.ones((64, 64), jnp.float32)
    jax.eval_shape(lambda x: dispatch.add_rms_norm(x, dispatch.matmul_unreduced(x, w, kernels=kernels), x[0],
                                                   eps=1e-6, kernels=kernels), jnp.ones((2, 64), jnp.float32))


@pytest.mark.parametrize("backend,decode", [("reference", False), ("reference", True), ("triton", False),
                                            ("triton", True)])
def test_num_q_heads_attends_with_the_first_heads_of_each_group_only(backend, decode):
    """q grouped per KV head holding more rows a group than it uses (the model's q|k after RoPE): every
    backend and path (decode kernel in place, the others on a slice) gives what those heads alone
    give; the extra rows are NaN."""
    rng = np.random.default_rng(seed(28801))
    lens = [1, 1, 1] if decode else [5, 9, 2]
    kv_lens = jnp.asarray([17, 40, 3], jnp.int32)
    cu_q_lens = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
    pool = jnp.asarray(rng.standard_normal((8, 2, 16, 64)), jnp.float32)
    tables = jnp.asarray([[0, 1, 2], [3, 4, 5], [6, 7, 0]], jnp.int32)
    q = jnp.asarray(rng.standard_normal((sum(lens), 4, 64)), jnp.float32)
    grouped = q.reshape(sum(lens), 2, 2, 64)  # [T, Hkv, G, D]: query head h is [h // G, h % G]
    wide = jnp.concatenate([grouped, jnp.full((sum(lens), 2, 1, 64), jnp.nan, jnp.float32)], axis=2)
    args = (pool, pool, tables, kv_lens, cu_q_lens)
    got = dispatch.ragged_attention(wide, *args, single_query=decode, num_q_heads=4,
                                    kernels=dispatch.default_kernels(backend))
    want = dispatch.ragged_attention(q, *args, single_query=decode)
    assert got.shape == q.shape
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("tokens,k,n", [(3, 256, 128), (65, 256, 128), (1, 688, 256)])
def test_unreduced_matmul_and_norm_agree_across_backends(tokens, k, n):
    """matmul_unreduced's output, whatever its form (partials on a decode-sized kernel step, a plain
    product otherwise), gives the same add + norm as the reference backend's. 688 x 256 is the tiny
    preset's down projection, whose default split (43 parts) is more than the norm kernel sums."""
    rng = np.random.default_rng(seed(28802))
    x = jnp.asarray(rng.standard_normal((tokens, k)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((k, n)) / 16, jnp.float32)
    resid = jnp.asarray(rng.standard_normal((tokens, n)), jnp.float32)
    g = jnp.asarray(rng.uniform(0.5, 1.5, n), jnp.float32)
    want = dispatch.add_rms_norm(resid, dispatch.matmul_unreduced(x, w, kernels=dispatch.REFERENCE), g, eps=1e-6,
                                 kernels=dispatch.REFERENCE)
    kernels = dispatch.default_kernels("triton")
    delta = dispatch.matmul_unreduced(x, w, kernels=kernels)
    assert delta.ndim == (3 if tokens <= kernels.fused_norm_max_tokens else 2)
    got = dispatch.add_rms_norm(resid, delta, g, eps=1e-6, kernels=kernels)
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
