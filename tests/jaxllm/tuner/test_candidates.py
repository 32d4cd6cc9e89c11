"""Candidate schedules: the base first, valid Kernels, Mosaic only where the base names it and it applies."""

from __future__ import annotations

import pytest

from jaxllm.tuner.candidates import all_schedules, candidates, decode_candidates, prefill_candidates
from pallas_kernels.dispatch import REFERENCE, Kernels

HOPPER = Kernels(decode_attention="triton", prefill_attention="mosaic", rope_kv_write="pallas", decode_layer="pallas")
AMPERE = Kernels(decode_attention="triton", prefill_attention="triton", rope_kv_write="pallas", decode_layer="pallas")


@pytest.mark.parametrize("op", ["decode", "prefill"])
def test_schedules_are_distinct_and_described_alike(op):
    scheds = all_schedules(op)
    assert len({s.name for s in scheds}) == len(scheds)
    assert len({len(s.features) for s in scheds}) == 1
    assert len({s.apply(HOPPER) for s in scheds}) == len(scheds)  # each a different, hashable Kernels


def test_decode_candidate_zero_is_the_base_unchanged():
    cands = decode_candidates(HOPPER)
    assert cands[0].apply(HOPPER) is HOPPER and len(cands) > 1
    assert all(c.apply(HOPPER).prefill_attention == "mosaic" for c in cands)  # only decode fields move
    assert [c.name for c in decode_candidates(REFERENCE)] == ["default"]


def test_prefill_mosaic_only_on_a_mosaic_base_and_long_enough_buckets():
    long = [c.name for c in prefill_candidates(HOPPER, 512, block_size=256)]
    assert long[0] == "mosaic_default" and "mosaic_cluster1" in long and "triton_default" in long
    assert prefill_candidates(HOPPER, 512)[0].apply(HOPPER) == HOPPER
    short = [c.name for c in prefill_candidates(HOPPER, HOPPER.mosaic_min_tokens // 2)]
    assert not any(n.startswith("mosaic") for n in short) and short[0] == "triton_default"
    assert not any(c.backend == "mosaic" for c in prefill_candidates(AMPERE, 4096))
    # rBlocks of 64 hold no 128-key Mosaic tile: only the 64-key one stays.
    assert [c.name for c in prefill_candidates(HOPPER, 512, block_size=64) if c.backend == "mosaic"] == [
        "mosaic_kv64_steps3"]
    assert [c.name for c in prefill_candidates(REFERENCE, 512)] == ["base"]


def test_unknown_op_is_refused():
    with pytest.raises(ValueError, match="op 'matmul' is not one of"):
        candidates("matmul", HOPPER, 16)


@pytest.mark.parametrize("op", ["decode", "prefill"])
def test_every_triton_candidate_computes_the_same_attention(op):
    """A tuner changes schedules, never results: each candidate's Kernels through dispatch.ragged_attention
    (interpret mode) matches the pure-jnp reference on a ragged batch (Mosaic needs a Hopper: not here)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels.dispatch import ragged_attention

    base = Kernels(decode_attention="triton", prefill_attention="triton", interpret=True)
    block, hq, hkv, d = 32, 4, 2, 128
    keys = jax.random.split(jax.random.key(0), 3)
    k_pool = jax.random.normal(keys[0], (12, hkv, block, d), jnp.float32)
    v_pool = jax.random.normal(keys[1], (12, hkv, block, d), jnp.float32)
    kv_lens = jnp.asarray([70, 1, 33], jnp.int32)
    tables = jnp.asarray(np.arange(12).reshape(3, 4), jnp.int32)
    q_lens = [1, 1, 1] if op == "decode" else [9, 1, 6]
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    q = jax.random.normal(keys[2], (int(sum(q_lens)), hq, d), jnp.float32)
    want = ragged_attention(q, k_pool, v_pool, tables, kv_lens, cu, single_query=op == "decode", kernels=REFERENCE)
    for sched in candidates(op, base, 16):
        got = ragged_attention(q, k_pool, v_pool, tables, kv_lens, cu, single_query=op == "decode",
                               kernels=sched.apply(base))
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-3, atol=2e-3, err_msg=sched.name)
