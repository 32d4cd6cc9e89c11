"""The jnp references (ragged prefill, ragged decode) against a float64 NumPy oracle written as plain loops."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kv_write import quantize_int8
from pallas_kernels.ragged_decode import ragged_decode_reference
from pallas_kernels.ragged_prefill import ragged_prefill_reference


def oracle(q, k_pool, v_pool, tables, kv_lens, cu_q_lens, k_scale=None, v_scale=None, sm_scale=None,
           query_starts=None):
    """Loop per sequence and query token in float64. Returns (out [T, Hq, D], row_max [T, Hq], row_sum [T, Hq]).
    query_starts: each sequence's first query position relative to key 0 of its row (default kv_len - q_len)."""
    q = np.asarray(q, np.float64)
    k = np.asarray(k_pool, np.float64)
    v = np.asarray(v_pool, np.float64)
    if k_scale is not None:
        k = k * np.asarray(k_scale, np.float64)[..., None]
        v = v * np.asarray(v_scale, np.float64)[..., None]
    num_tokens, num_q_heads, head_dim = q.shape
    _, num_kv_heads, block_size, _ = k.shape
    group = num_q_heads // num_kv_heads
    scale = head_dim ** -0.5 if sm_scale is None else sm_scale
    out = np.zeros((num_tokens, num_q_heads, head_dim))
    row_max = np.full((num_tokens, num_q_heads), -np.inf)
    row_sum = np.zeros((num_tokens, num_q_heads))
    for s in range(len(kv_lens)):
        first, last = int(cu_q_lens[s]), int(cu_q_lens[s + 1])
        for i, t in enumerate(range(first, last)):
            start = int(kv_lens[s]) - (last - first) if query_starts is None else int(query_starts[s])
            position = start + i
            for h in range(num_q_heads):
                kh = h // group
                scores, values = [], []
                for p in range(min(position + 1, int(kv_lens[s]))):  # none where position < 0
                    blk, row = int(tables[s, p // block_size]), p % block_size
                    scores.append(scale * float(q[t, h] @ k[blk, kh, row]))
                    values.append(v[blk, kh, row])
                if not scores:
                    continue
                scores = np.array(scores)
                m = scores.max()
                w = np.exp(scores - m)
                out[t, h] = w @ np.array(values) / w.sum()
                row_max[t, h], row_sum[t, h] = m, w.sum()
    return out, row_max, row_sum


def random_pools(rng, num_blocks, num_kv_heads, block_size, head_dim, int8):
    k = rng.standard_normal((num_blocks, num_kv_heads, block_size, head_dim)).astype(np.float32)
    v = rng.standard_normal((num_blocks, num_kv_heads, block_size, head_dim)).astype(np.float32)
    if int8:
        (k, ks), (v, vs) = quantize_int8(jnp.asarray(k)), quantize_int8(jnp.asarray(v))
        return k, v, ks, vs
    return jnp.asarray(k), jnp.asarray(v), None, None


def random_tables(rng, num_seqs, width, num_blocks):
    return jnp.asarray(rng.permutation(num_blocks)[: num_seqs * width].reshape(num_seqs, width), jnp.int32)


def check(got, want, atol=2e-5):
    out, (m, l) = got
    np.testing.assert_allclose(np.asarray(out, np.float64), want[0], atol=atol, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(m, np.float64), want[1], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(l, np.float64), want[2], rtol=1e-4)


@pytest.mark.parametrize("int8", [False, True])
def test_prefill_reference_matches_oracle_with_cached_prefixes(int8):
    rng = np.random.default_rng(int(int8))
    block_size, head_dim, num_q_heads, num_kv_heads = 8, 16, 4, 2
    # (query tokens, kv_len): a fresh prompt, cached prefixes, a decode-like token, an empty sequence.
    seqs = [(5, 5), (3, 20), (1, 9), (0, 4), (7, 16)]
    q_lens = np.array([a for a, _ in seqs])
    kv_lens = jnp.asarray([b for _, b in seqs], jnp.int32)
    cu_q_lens = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    num_tokens = int(q_lens.sum()) + 2  # two padding tokens at the end
    width = 3
    num_blocks = len(seqs) * width + 2
    k, v, ks, vs = random_pools(rng, num_blocks, num_kv_heads, block_size, head_dim, int8)
    tables = random_tables(rng, len(seqs), width, num_blocks)
    q = jnp.asarray(rng.standard_normal((num_tokens, num_q_heads, head_dim)), jnp.float32)
    got = ragged_prefill_reference(q, k, v, tables, kv_lens, cu_q_lens, k_scale=ks, v_scale=vs,
                                   return_residuals=True)
    want = oracle(q, k, v, np.asarray(tables), np.asarray(kv_lens), np.asarray(cu_q_lens), ks, vs)
    check(got, want)
    assert np.all(np.asarray(got[0][-2:]) == 0)  # padding tokens


@pytest.mark.parametrize("int8", [False, True])
def test_prefill_reference_matches_oracle_on_parts(int8):
    """query_starts: positions before the row's keys (negative), inside them, and past its kv_len."""
    rng = np.random.default_rng(20 + int(int8))
    block_size, head_dim, num_q_heads, num_kv_heads = 8, 16, 4, 2
    q_lens = np.array([5, 3, 1, 0, 7, 4])
    kv_lens = jnp.asarray([5, 20, 9, 4, 3, 0], jnp.int32)
    query_starts = jnp.asarray([-2, 7, 30, 0, -9, 1], jnp.int32)
    cu_q_lens = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    num_tokens = int(q_lens.sum()) + 2
    width = 3
    num_blocks = len(q_lens) * width + 2
    k, v, ks, vs = random_pools(rng, num_blocks, num_kv_heads, block_size, head_dim, int8)
    tables = random_tables(rng, len(q_lens), width, num_blocks)
    q = jnp.asarray(rng.standard_normal((num_tokens, num_q_heads, head_dim)), jnp.float32)
    got = ragged_prefill_reference(q, k, v, tables, kv_lens, cu_q_lens, query_starts=query_starts, k_scale=ks,
                                   v_scale=vs, return_residuals=True)
    want = oracle(q, k, v, np.asarray(tables), np.asarray(kv_lens), np.asarray(cu_q_lens), ks, vs,
                  query_starts=np.asarray(query_starts))
    check(got, want)
    assert np.isinf(want[1]).sum() > 8  # rows that see nothing: the first of sequence 0, all of 4 and 5, padding


def test_prefill_reference_custom_scale():
    rng = np.random.default_rng(3)
    k, v, _, _ = random_pools(rng, 6, 1, 4, 8, False)
    tables = random_tables(rng, 2, 3, 6)
    kv_lens = jnp.asarray([11, 6], jnp.int32)
    cu_q_lens = jnp.asarray([0, 4, 6], jnp.int32)
    q = jnp.asarray(rng.standard_normal((6, 2, 8)), jnp.float32)
    got = ragged_prefill_reference(q, k, v, tables, kv_lens, cu_q_lens, sm_scale=0.3, return_residuals=True)
    check(got, oracle(q, k, v, np.asarray(tables), np.asarray(kv_lens), np.asarray(cu_q_lens), sm_scale=0.3))


@pytest.mark.parametrize("int8,num_q_heads", [(False, 4), (True, 8)])
def test_decode_reference_matches_oracle(int8, num_q_heads):
    rng = np.random.default_rng(10 + num_q_heads)
    block_size, head_dim, num_kv_heads = 8, 16, 2
    kv_lens = jnp.asarray([1, 7, 8, 9, 0, 23], jnp.int32)
    width = 3
    num_blocks = len(kv_lens) * width + 1
    k, v, ks, vs = random_pools(rng, num_blocks, num_kv_heads, block_size, head_dim, int8)
    tables = random_tables(rng, len(kv_lens), width, num_blocks)
    q = jnp.asarray(rng.standard_normal((len(kv_lens), num_q_heads, head_dim)), jnp.float32)
    got = ragged_decode_reference(q, k, v, tables, kv_lens, k_scale=ks, v_scale=vs, return_residuals=True)
    cu_q_lens = np.arange(len(kv_lens) + 1)
    want = oracle(q, k, v, np.asarray(tables), np.asarray(kv_lens), cu_q_lens, ks, vs)
    check(got, want)
    assert np.all(np.asarray(got[1][0][4]) == -np.inf)  # kv_len 0: max -inf
