"""Verify attention (Q query tokens a sequence: a decode over the earlier keys + a causal part among the Q) against
the ragged prefill reference, with the decode kernel in interpret mode and with the decode reference; through
dispatch.ragged_attention too."""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import dispatch
from pallas_kernels.ragged_decode import DecodeBlockSizes, ragged_decode, ragged_decode_reference
from pallas_kernels.verify_attention import verify_attention, verify_attention_reference
from tests.pallas_kernels.test_ragged_decode import TOL, make_case
from tests.seeds import seed


def _reference_past(q, k_pool, v_pool, block_tables, kv_lens, *, k_scale=None, v_scale=None, num_q_heads=None,
                    return_residuals=False):
    q = q[:, :, :num_q_heads // q.shape[1]].reshape(q.shape[0], -1, q.shape[-1])
    return ragged_decode_reference(q, k_pool, v_pool, block_tables, kv_lens, k_scale=k_scale, v_scale=v_scale,
                                   return_residuals=return_residuals)


KERNEL_PAST = functools.partial(ragged_decode, block_sizes=DecodeBlockSizes(block_k=16, tokens_per_split=32))


def verify_case(rng, lens, queries, num_q_heads, num_kv_heads, head_dim, block_size, kv_dtype):
    """make_case's pools over kv_lens = lens (each >= queries, or 0 for a padding sequence), with q of Q tokens a
    sequence."""
    q, poisoned, clean, tables, kv_lens = make_case(rng, lens, num_q_heads, num_kv_heads, head_dim, block_size,
                                                    kv_dtype)
    q = jnp.asarray(rng.standard_normal((len(lens) * queries, num_q_heads, head_dim)), q.dtype)
    return q, poisoned, clean, tables, kv_lens


def check(got, want, dtype, real_tokens):
    (out, (m, l)), (ref, (rm, rl)) = got, want
    assert out.shape == ref.shape and out.dtype == ref.dtype
    tol = TOL[jnp.dtype(dtype)]
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    np.testing.assert_allclose(out[real_tokens], ref[real_tokens], atol=tol, rtol=tol)
    np.testing.assert_allclose(np.asarray(m)[real_tokens], np.asarray(rm)[real_tokens], atol=1e-4, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(l)[real_tokens], np.asarray(rl)[real_tokens], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("past", ["kernel", "reference"])
@pytest.mark.parametrize("queries,num_q_heads,num_kv_heads", [(5, 2, 2), (2, 8, 2), (5, 8, 1), (3, 6, 2)])
def test_verify_attention_matches_ragged_prefill(past, queries, num_q_heads, num_kv_heads):
    rng = np.random.default_rng(seed(7300 + queries * 10 + num_q_heads))
    block_size = 32
    # Earlier keys around the kernel's tile (16) and the rBlock (32); a padding sequence (0); the Q new keys
    # crossing an rBlock's end.
    lens = [queries, queries + 1, 15 + queries, 16 + queries, 31, 33, 0, 95, 64 + queries - 1]
    lens = [n if n == 0 else max(n, queries) for n in lens]
    q, poisoned, clean, tables, kv_lens = verify_case(rng, lens, queries, num_q_heads, num_kv_heads, 64,
                                                      block_size, jnp.bfloat16)
    fn = KERNEL_PAST if past == "kernel" else _reference_past
    got = verify_attention(q, poisoned["k"], poisoned["v"], tables, kv_lens, queries=queries, past=fn,
                           return_residuals=True)
    want = verify_attention_reference(q, clean["k"], clean["v"], tables, kv_lens, queries=queries,
                                      return_residuals=True)
    check(got, want, jnp.bfloat16, slice(None))
    pad = slice(6 * queries, 7 * queries)  # the padding sequence's tokens see no key
    assert np.all(np.asarray(got[0][pad], np.float32) == 0) and np.all(np.asarray(got[1][1][pad]) == 0)


@pytest.mark.parametrize("kv_dtype,head_dim", [(jnp.float32, 128), ("int8", 64)])
def test_verify_attention_dtypes(kv_dtype, head_dim):
    rng = np.random.default_rng(seed(7321))
    lens = [5, 64, 129, 200]
    q, poisoned, clean, tables, kv_lens = verify_case(rng, lens, 5, 8, 2, head_dim, 64, kv_dtype)
    fn = functools.partial(ragged_decode, block_sizes=DecodeBlockSizes(block_k=64, tokens_per_split=64))
    got = verify_attention(q, poisoned["k"], poisoned["v"], tables, kv_lens, queries=5, past=fn,
                           k_scale=poisoned["k_scale"], v_scale=poisoned["v_scale"], return_residuals=True)
    want = verify_attention_reference(q, clean["k"], clean["v"], tables, kv_lens, queries=5,
                                      k_scale=clean["k_scale"], v_scale=clean["v_scale"], return_residuals=True)
    check(got, want, q.dtype, slice(None))


def test_dispatch_takes_verify_attention_for_grouped_q():
    """ragged_attention with verify_queries on a grouped q (rope_write_kv's, Gh = G + 2 rows a KV head) gives the
    prefill path's result, for both settings of Kernels.verify_attention."""
    rng = np.random.default_rng(seed(7322))
    queries, hkv, group, head_dim = 4, 2, 2, 64
    lens = [4, 40, 0, 77]
    _, poisoned, clean, tables, kv_lens = make_case(rng, lens, hkv * group, hkv, head_dim, 16, jnp.float32)
    q = jnp.asarray(rng.standard_normal((len(lens) * queries, hkv, group + 2, head_dim)), jnp.float32)
    cu = jnp.arange(len(lens) + 1, dtype=jnp.int32) * queries
    results = {}
    for how in ("decode", "prefill"):
        kernels = dispatch.Kernels(verify_attention=how)
        results[how] = dispatch.ragged_attention(q, clean["k"], clean["v"], tables, kv_lens, cu, single_query=False,
                                                 num_q_heads=hkv * group, verify_queries=queries, kernels=kernels)
    np.testing.assert_allclose(np.asarray(results["decode"]), np.asarray(results["prefill"]), atol=1e-5, rtol=1e-5)


def test_a_wrong_token_count_is_refused():
    rng = np.random.default_rng(0)
    q, poisoned, _, tables, kv_lens = verify_case(rng, [8, 9], 4, 2, 2, 64, 16, jnp.float32)
    with pytest.raises(ValueError, match="4 query tokens a sequence"):
        verify_attention(q[:7], poisoned["k"], poisoned["v"], tables, kv_lens, queries=4, past=_reference_past)
