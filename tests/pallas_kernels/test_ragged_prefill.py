"""The ragged prefill kernel against its pure-jnp reference on random ragged batches (interpret mode on CPU)."""

from __future__ import annotations

import dataclasses
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import ragged_prefill as rp

# Tolerance on the normalised output per query dtype: the kernel feeds p to the PV dot in the
# compute dtype, so half-precision outputs carry that rounding. On the GPU, exp2 is approximate and
# sums run in another order, so float32 gets more room there.
_OUT_TOL = {jnp.float32: 2e-5, jnp.bfloat16: 3e-2, jnp.float16: 4e-3}
_GPU_FLOAT32_TOL = 1e-3
_RESIDUAL_TOL = 1e-4


def _make_batch(rng, *, q_lens, cached, block_size, head_dim, num_kv_heads, group, kv_dtype, q_dtype,
                num_padding=3, spare_blocks=3, run_length=1):
    """A random ragged batch on a shuffled pool: runs of `run_length` consecutive rBlocks in random order.

    Returns (kernel_args, reference_args): identical except that every pool slot no sequence owns
    (and every scale of one) is NaN for the kernel and finite for the reference, so the kernel is
    checked never to let stale KV into a result.
    """
    kv_lens = np.asarray(q_lens) + np.asarray(cached)
    num_seqs = len(q_lens)
    width = max(1, int(max(-(-kv_lens // block_size))))
    num_blocks = num_seqs * width + spare_blocks
    num_runs = -(-num_blocks // run_length)
    blocks = (rng.permutation(num_runs)[:, None] * run_length + np.arange(run_length)).ravel()
    tables = blocks[blocks < num_blocks][: num_seqs * width].reshape(num_seqs, width).astype(np.int32)
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    owned = np.zeros(shape[:3], bool)  # [blocks, heads, rows]
    for s in range(num_seqs):
        for pos in range(kv_lens[s]):
            owned[tables[s, pos // block_size], :, pos % block_size] = True
    kv = {}
    for name in ("k", "v"):
        if kv_dtype == jnp.int8:
            pool = rng.integers(-127, 128, shape).astype(np.int8)
            scale = rng.uniform(0.002, 0.02, shape[:3]).astype(np.float32)
            kv[name] = (pool, pool, scale, np.where(owned, scale, np.nan).astype(np.float32))
        else:
            pool = rng.standard_normal(shape).astype(np.float32)
            kv[name] = (pool, np.where(owned[..., None], pool, np.nan), None, None)
    num_tokens = int(sum(q_lens)) + num_padding
    q = rng.standard_normal((num_tokens, num_kv_heads * group, head_dim)).astype(np.float32)
    q[sum(q_lens):] = np.nan  # padding tokens must not matter
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)

    def pack(stale_nan: bool):
        pools = [jnp.asarray(kv[n][1 if stale_nan else 0], kv_dtype) for n in ("k", "v")]
        scales = [None if kv[n][2] is None else jnp.asarray(kv[n][3 if stale_nan else 2]) for n in ("k", "v")]
        args = (jnp.asarray(q, q_dtype), *pools, jnp.asarray(tables), jnp.asarray(kv_lens, jnp.int32), jnp.asarray(cu))
        return args, dict(k_scale=scales[0], v_scale=scales[1])

    return pack(True), pack(False)


def _assert_matches(rng, *, block_sizes=None, sm_scale=None, **batch):
    (args, scales), (ref_args, ref_scales) = _make_batch(rng, **batch)
    out, (row_max, row_sum) = rp.ragged_prefill(*args, **scales, sm_scale=sm_scale, return_residuals=True,
                                                block_sizes=block_sizes)
    # XLA on a GPU runs float32 matmuls in TF32 unless told otherwise: keep the reference exact.
    with jax.default_matmul_precision("highest"):
        ref, (ref_max, ref_sum) = rp.ragged_prefill_reference(*ref_args, **ref_scales, sm_scale=sm_scale,
                                                              return_residuals=True)
    q = args[0]
    assert out.shape == q.shape and out.dtype == q.dtype
    assert row_max.shape == row_sum.shape == q.shape[:2] and row_max.dtype == jnp.float32
    on_gpu = jax.default_backend() == "gpu"
    tol = _OUT_TOL[jnp.dtype(q.dtype).type]
    tol = max(tol, _GPU_FLOAT32_TOL) if on_gpu else tol
    res_tol = _GPU_FLOAT32_TOL if on_gpu else _RESIDUAL_TOL
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=tol, rtol=tol)
    # Residuals come from float32 scores and sums on both sides; -inf (padding rows) must match exactly.
    np.testing.assert_allclose(np.asarray(row_max), np.asarray(ref_max), atol=res_tol, rtol=res_tol)
    np.testing.assert_allclose(np.asarray(row_sum), np.asarray(ref_sum), atol=res_tol, rtol=res_tol)
    num_real = int(args[5][-1])
    assert num_real < q.shape[0], "the batch should carry padding tokens"
    assert np.all(np.asarray(out[num_real:], np.float32) == 0)
    assert np.all(np.asarray(row_max[num_real:]) == -np.inf) and np.all(np.asarray(row_sum[num_real:]) == 0)


def _awkward_lengths(rng, block_size, count):
    """Query lengths 1, block-1, block, block+1 and random non-multiples, with random cached prefixes."""
    q_lens = [1, block_size - 1, block_size, block_size + 1] + list(rng.integers(2, 3 * block_size, count))
    cached = [int(rng.integers(0, 2 * block_size)) if rng.random() < 0.7 else 0 for _ in q_lens]
    order = rng.permutation(len(q_lens))
    return [int(q_lens[i]) for i in order], [cached[i] for i in order]


@pytest.mark.parametrize(
    "kv_dtype,q_dtype,group,head_dim,block_size",
    [
        (jnp.float32, jnp.float32, 1, 64, 16),
        (jnp.bfloat16, jnp.bfloat16, 4, 128, 32),
        (jnp.float16, jnp.float16, 8, 64, 16),
        (jnp.int8, jnp.bfloat16, 4, 64, 32),
        (jnp.int8, jnp.float32, 1, 128, 16),
    ],
)
def test_matches_reference(kv_dtype, q_dtype, group, head_dim, block_size):
    rng = np.random.default_rng(zlib.crc32(f"{jnp.dtype(kv_dtype)}{group}{head_dim}{block_size}".encode()))
    q_lens, cached = _awkward_lengths(rng, block_size, 2)
    _assert_matches(rng, q_lens=q_lens, cached=cached, block_size=block_size, head_dim=head_dim,
                    num_kv_heads=2 if group < 8 else 1, group=group, kv_dtype=kv_dtype, q_dtype=q_dtype,
                    block_sizes=rp.PrefillBlockSizes(block_q=16, block_k=16))


@pytest.mark.parametrize(
    "block_sizes,block_size",
    [
        (rp.PrefillBlockSizes(block_q=32, block_k=64), 32),  # block_k capped at the rBlock size
        (rp.PrefillBlockSizes(block_q=16, block_k=32), 48),  # rBlock not a power of two: 16-key steps
        (rp.PrefillBlockSizes(block_q=64, block_k=16), 64),  # many key steps per rBlock
    ],
)
def test_block_sizes(block_sizes, block_size):
    rng = np.random.default_rng(block_size + block_sizes.block_q)
    q_lens, cached = _awkward_lengths(rng, block_size, 1)
    _assert_matches(rng, q_lens=q_lens, cached=cached, block_size=block_size, head_dim=64, num_kv_heads=1,
                    group=2, kv_dtype=jnp.float32, q_dtype=jnp.float32, block_sizes=block_sizes, sm_scale=0.3)


def test_decode_rows_and_empty_sequences():
    """q_len 1 against long cached prefixes, and sequences with no query tokens this step."""
    rng = np.random.default_rng(7)
    _assert_matches(rng, q_lens=[1, 0, 1, 3, 0], cached=[70, 9, 0, 40, 0], block_size=16, head_dim=64,
                    num_kv_heads=2, group=1, kv_dtype=jnp.bfloat16, q_dtype=jnp.bfloat16, num_padding=5,
                    block_sizes=rp.PrefillBlockSizes(block_q=16, block_k=16))


def test_without_residuals_returns_array():
    rng = np.random.default_rng(3)
    (args, scales), _ = _make_batch(rng, q_lens=[5, 20], cached=[3, 0], block_size=16, head_dim=64, num_kv_heads=1,
                                    group=1, kv_dtype=jnp.float32, q_dtype=jnp.float32)
    out = rp.ragged_prefill(*args, **scales)  # default block sizes
    assert isinstance(out, jax.Array) and out.shape == args[0].shape
    assert np.all(np.isfinite(np.asarray(out)))


def test_default_block_sizes_per_dtype_and_device(monkeypatch):
    assert rp.default_block_sizes(jnp.bfloat16) == rp.PrefillBlockSizes()
    assert dataclasses.astuple(rp.PrefillBlockSizes()) == (128, 128, 8, 3)
    assert rp.default_block_sizes(jnp.float32).block_q == 64
    # Three 128 x 128 stages do not fit an Ampere block's shared memory: two there.
    monkeypatch.setattr(rp.compat, "gpu_compute_capability", lambda: (8, 0))
    assert rp.default_block_sizes(jnp.bfloat16).num_stages == 2
    monkeypatch.setattr(rp.compat, "gpu_compute_capability", lambda: (9, 0))
    assert rp.default_block_sizes(jnp.bfloat16).num_stages == 3


def test_default_tiles_partly_filled():
    """The default tiles (128 x 128, the masks built per step and after the loops) over sequences
    shorter than a tile, tiles ending mid-sequence, cached prefixes and padding, bf16 and int8 KV."""
    rng = np.random.default_rng(12)
    for kv_dtype in (jnp.bfloat16, jnp.int8):
        _assert_matches(rng, q_lens=[130, 5, 129], cached=[3, 140, 0], block_size=128, head_dim=64,
                        num_kv_heads=1, group=2, kv_dtype=kv_dtype, q_dtype=jnp.bfloat16)


@pytest.mark.parametrize("block_q", [16, 32])
def test_work_list_covers_every_token_once(block_q):
    rng = np.random.default_rng(block_q)
    q_lens = rng.integers(0, 70, 9)
    num_tokens = int(q_lens.sum()) + 11
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    kv_lens = (q_lens + rng.integers(0, 50, 9)).astype(np.int32)
    work = np.asarray(rp._work_list(jnp.asarray(cu), jnp.asarray(kv_lens), num_tokens, block_q, 16))
    assert work.shape[0] == rp._WORK_FIELDS
    hits = np.zeros(num_tokens, int)
    for seq, q_start, rows, pos0, full, total in work.T:
        assert 0 <= rows <= block_q
        hits[q_start:q_start + rows] += 1
        if rows and q_start < cu[-1]:
            assert cu[seq] <= q_start and q_start + rows <= cu[seq + 1]
            assert pos0 == kv_lens[seq] - q_lens[seq] + (q_start - cu[seq])
            assert full * 16 <= pos0 + 1 and total * 16 >= pos0 + rows
        else:
            assert total == 0
    assert np.all(hits == 1)
    starts = work[rp._Q_START][work[rp._ROWS] > 0]
    assert np.all(np.diff(starts) > 0), "tiles in packed order"


def test_consecutive_rblock_runs():
    """Runs of consecutive rBlocks broken at random (the allocator's preferred layout, fragmented)."""
    rng = np.random.default_rng(4)
    _assert_matches(rng, q_lens=[40, 3, 33], cached=[20, 50, 0], block_size=16, head_dim=64, num_kv_heads=1,
                    group=2, kv_dtype=jnp.bfloat16, q_dtype=jnp.bfloat16, run_length=3,
                    block_sizes=rp.PrefillBlockSizes(block_q=16, block_k=16))


def _valid_args():
    q = jnp.zeros((8, 4, 64), jnp.float32)
    pool = jnp.zeros((4, 2, 16, 64), jnp.float32)
    tables = jnp.asarray([[0, 1], [2, 3]], jnp.int32)
    return dict(q=q, k_pool=pool, v_pool=pool, block_tables=tables, kv_lens=jnp.asarray([20, 5], jnp.int32),
                cu_q_lens=jnp.asarray([0, 4, 7], jnp.int32))


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(q=jnp.zeros((8, 4, 32), jnp.float32)), "head_dim"),
        (dict(q=jnp.zeros((8, 3, 64), jnp.float32)), "multiple"),
        (dict(kv_lens=jnp.asarray([33, 5], jnp.int32)), "kv_len 33"),
        (dict(cu_q_lens=jnp.asarray([0, 4, 9], jnp.int32)), "cu_q_lens"),
        (dict(cu_q_lens=jnp.asarray([0, 4, 3], jnp.int32)), "cu_q_lens"),
        (dict(cu_q_lens=jnp.asarray([0, 4, 7], jnp.int32), kv_lens=jnp.asarray([20, 2], jnp.int32)), "query tokens"),
        (dict(block_tables=jnp.asarray([[0, 9], [2, 3]], jnp.int32)), "block_tables entry 9"),
        (dict(k_pool=jnp.zeros((4, 2, 16, 64), jnp.int8), v_pool=jnp.zeros((4, 2, 16, 64), jnp.int8)), "int8"),
        (dict(k_pool=jnp.zeros((8, 2, 8, 64)), v_pool=jnp.zeros((8, 2, 8, 64)),
              kv_lens=jnp.asarray([10, 5], jnp.int32)),
         "rBlock size 8"),
    ],
)
def test_bad_input_raises(change, match):
    args = {**_valid_args(), **change}
    with pytest.raises(ValueError, match=match):
        rp.ragged_prefill(**args)


@pytest.mark.parametrize("fields", [dict(block_q=24), dict(block_k=8), dict(num_warps=3), dict(num_stages=0)])
def test_bad_block_sizes_raise(fields):
    with pytest.raises(ValueError):
        rp.PrefillBlockSizes(**fields)


@pytest.mark.gpu
def test_gpu_long_ragged_batch():
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    rng = np.random.default_rng(11)
    for kv_dtype in (jnp.bfloat16, jnp.int8):
        _assert_matches(rng, q_lens=[1, 255, 256, 257, 1000], cached=[0, 300, 17, 0, 513], block_size=64,
                        head_dim=128, num_kv_heads=4, group=4, kv_dtype=kv_dtype, q_dtype=jnp.bfloat16)
