"""Ragged decode kernel (interpret mode on the CPU) against ragged_decode_reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import compat
from pallas_kernels.kv_write import quantize_int8
from pallas_kernels.ragged_decode import (MAX_ITEMS_PER_HEAD, MERGE_LOADS_PER_RUN, DecodeBlockSizes, _work_item,
                                          default_block_sizes, ragged_decode, ragged_decode_reference)
from pallas_kernels.residuals import merge_partials, parts_per_merge_load
from tests.seeds import seed

# Output tolerance by query/output dtype; int8 KV is compared at its query dtype's tolerance.
TOL = {jnp.dtype(jnp.float32): 1e-4, jnp.dtype(jnp.bfloat16): 2e-2, jnp.dtype(jnp.float16): 4e-3}


def make_case(rng, lens, num_q_heads, num_kv_heads, head_dim, block_size, kv_dtype, q_dtype=None, spare=3):
    """Random pools with shuffled, non-consecutive tables; rows no sequence uses hold NaN (or NaN scales).

    Returns (q, poisoned pools dict, clean pools dict, tables, kv_lens): the kernel gets the
    poisoned pools, the reference the clean ones (the same values where used, 0 elsewhere).
    """
    lens = np.asarray(lens)
    num_seqs = len(lens)
    width = max(1, -(-int(lens.max()) // block_size))
    num_blocks = num_seqs * width + spare
    tables = rng.permutation(num_blocks)[: num_seqs * width].reshape(num_seqs, width).astype(np.int32)
    used = np.zeros((num_blocks, block_size), bool)
    for s, n in enumerate(lens):
        for p in range(int(n)):
            used[tables[s, p // block_size], p % block_size] = True
    used = used[:, None, :]  # [blocks, 1, block_size]
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    clean, poisoned = {}, {}
    for name in ("k", "v"):
        x = rng.standard_normal(shape).astype(np.float32)
        x = np.where(used[..., None], x, 0.0)
        if kv_dtype == "int8":
            values, scale = quantize_int8(jnp.asarray(x))
            clean[name], clean[name + "_scale"] = values, scale
            poisoned[name] = values
            poisoned[name + "_scale"] = jnp.where(jnp.asarray(used), scale, jnp.nan)
        else:
            clean[name] = jnp.asarray(x, kv_dtype)
            poisoned[name] = jnp.where(jnp.asarray(used[..., None]), clean[name], jnp.nan).astype(kv_dtype)
            clean[name + "_scale"] = poisoned[name + "_scale"] = None
    if q_dtype is None:
        q_dtype = jnp.bfloat16 if kv_dtype == "int8" else kv_dtype
    q = jnp.asarray(rng.standard_normal((num_seqs, num_q_heads, head_dim)), q_dtype)
    return q, poisoned, clean, jnp.asarray(tables), jnp.asarray(lens, jnp.int32)


def run_both(q, poisoned, clean, tables, kv_lens, block_sizes=None):
    out, (m, l) = ragged_decode(q, poisoned["k"], poisoned["v"], tables, kv_lens, k_scale=poisoned["k_scale"],
                                v_scale=poisoned["v_scale"], return_residuals=True, block_sizes=block_sizes)
    ref, (rm, rl) = ragged_decode_reference(q, clean["k"], clean["v"], tables, kv_lens, k_scale=clean["k_scale"],
                                            v_scale=clean["v_scale"], return_residuals=True)
    return (out, m, l), (ref, rm, rl)


def assert_matches(got, want, dtype):
    out, m, l = got
    ref, rm, rl = want
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert m.shape == rm.shape == l.shape and m.dtype == jnp.float32
    tol = TOL[jnp.dtype(dtype)]
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=tol, rtol=tol)
    # -inf where kv_len is 0 must match exactly; assert_allclose treats equal infinities as equal.
    np.testing.assert_allclose(np.asarray(m), np.asarray(rm), atol=1e-4, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(l), np.asarray(rl), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(2, 2), (8, 2), (8, 1), (6, 2)])
def test_awkward_lengths_and_head_ratios(num_q_heads, num_kv_heads):
    rng = np.random.default_rng(num_q_heads * 10 + num_kv_heads)
    block_size = 32
    # tile 16: lengths around the tile, around the rBlock, a zero, and non-multiples.
    lens = [1, 15, 16, 17, 31, 32, 33, 0, 95, 70]
    case = make_case(rng, lens, num_q_heads, num_kv_heads, 64, block_size, jnp.bfloat16)
    got, want = run_both(*case, block_sizes=DecodeBlockSizes(block_k=16, tokens_per_split=32))
    assert_matches(got, want, jnp.bfloat16)
    out, m, l = got
    assert np.all(np.asarray(out[7], np.float32) == 0) and np.all(np.asarray(m[7]) == -np.inf)
    assert np.all(np.asarray(l[7]) == 0)


@pytest.mark.parametrize("kv_dtype,head_dim", [(jnp.float32, 128), (jnp.bfloat16, 128), (jnp.float16, 64),
                                                ("int8", 128), ("int8", 64)])
def test_dtypes_and_head_dims(kv_dtype, head_dim):
    rng = np.random.default_rng(head_dim)
    lens = [5, 64, 129, 200]
    case = make_case(rng, lens, 8, 2, head_dim, 64, kv_dtype)
    got, want = run_both(*case, block_sizes=DecodeBlockSizes(block_k=64, tokens_per_split=64))
    assert_matches(got, want, case[0].dtype)


def test_int8_default_schedule_matches_reference():
    assert default_block_sizes(jnp.int8).block_k == 128 and default_block_sizes(jnp.bfloat16) == DecodeBlockSizes()
    rng = np.random.default_rng(seed(53821))
    case = make_case(rng, [1, 127, 128, 129, 300], 4, 2, 128, 128, "int8")
    got, want = run_both(*case, block_sizes=None)  # the dtype's default: 128-token tiles
    assert_matches(got, want, case[0].dtype)


def test_int8_via_fp16_matches_reference():
    """int8 KV turned into float16 by the integer trick (every int8 value exactly), split and unsplit."""
    from pallas_kernels.ragged_decode import _int8_to_float16

    every = jnp.arange(-128, 128, dtype=jnp.int32).astype(jnp.int8)
    np.testing.assert_array_equal(np.asarray(_int8_to_float16(every), np.float32), np.arange(-128, 128))
    rng = np.random.default_rng(seed(53822))
    case = make_case(rng, [1, 200, 0, 77], 8, 2, 64, 32, "int8")
    bsz = DecodeBlockSizes(block_k=16, tokens_per_split=64, int8_via_fp16=True)
    got, want = run_both(*case, block_sizes=bsz)
    assert_matches(got, want, jnp.bfloat16)


def test_float32_query_with_bf16_kv():
    rng = np.random.default_rng(5)
    case = make_case(rng, [40, 7], 4, 4, 64, 16, jnp.bfloat16, q_dtype=jnp.float32)
    got, want = run_both(*case)
    assert_matches(got, want, jnp.float32)


def test_batch_mixing_1_and_5000_splits_the_long_sequence():
    rng = np.random.default_rng(7)
    case = make_case(rng, [1, 5000], 2, 1, 64, 128, jnp.bfloat16, spare=1)
    bsz = DecodeBlockSizes(block_k=128, target_programs=8)
    # 5001 real tokens x 1 KV head over ~8 programs -> items of at most 626 tokens: 8 for the long sequence.
    assert int(bsz.split(128, jnp.asarray([1, 5000]), 1)) == 626
    got, want = run_both(*case, block_sizes=bsz)
    assert_matches(got, want, jnp.bfloat16)


def test_split_size_does_not_change_the_result():
    rng = np.random.default_rng(8)
    case = make_case(rng, [300, 17, 64], 4, 2, 64, 32, jnp.float32)
    results = [run_both(*case, block_sizes=DecodeBlockSizes(block_k=bk, tokens_per_split=split))[0]
               for bk, split in ((16, 16), (32, 128), (128, 512))]
    for other in results[1:]:
        for a, b in zip(results[0], other):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_q_heads,num_kv_heads,lens", [
    (16, 2, [1000, 256, 272, 0, 5]),  # GQA 8: 4 parts a merge load, runs of 16 items; 63 / 16 / 17 items
    (2, 2, [2100, 40]),  # MHA: 32 parts a load, runs of 128 items; 132 items
])
def test_sequences_split_past_one_merge_run_merge_in_two_levels(num_q_heads, num_kv_heads, lens):
    """A sequence of more items than one run of merge loads holds is merged run by run, then the runs: the
    result equals the reference whatever the last run's size (full, one item, ragged)."""
    rng = np.random.default_rng(11)
    case = make_case(rng, lens, num_q_heads, num_kv_heads, 64, 16, jnp.float32)
    sizes = DecodeBlockSizes(block_k=16, tokens_per_split=16)
    group = num_q_heads // num_kv_heads
    fan_in = parts_per_merge_load(1 << (group - 1).bit_length()) * MERGE_LOADS_PER_RUN
    assert -(-max(lens) // 16) > fan_in  # the longest sequence takes the two-level merge
    got, want = run_both(*case, block_sizes=sizes)
    assert_matches(got, want, jnp.float32)
    again, _ = run_both(*case, block_sizes=sizes)  # counters are left zero: a second call is the same
    for a, b in zip(got, again):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_kernel_residuals_merge_over_a_split_of_the_tables():
    """Attention over the first k rBlocks and over the rest, merged, equals attention over all."""
    rng = np.random.default_rng(9)
    block_size, cut = 16, 3
    q, pools, _, tables, kv_lens = make_case(rng, [100, 20, 48, 49], 4, 2, 64, block_size, jnp.bfloat16)
    args = dict(k_scale=None, v_scale=None, return_residuals=True)
    full, (fm, fl) = ragged_decode(q, pools["k"], pools["v"], tables, kv_lens, **args)
    head_len = jnp.minimum(kv_lens, cut * block_size)
    a, (am, al) = ragged_decode(q, pools["k"], pools["v"], tables[:, :cut], head_len, **args)
    b, (bm, bl) = ragged_decode(q, pools["k"], pools["v"], tables[:, cut:], kv_lens - head_len, **args)
    out, m, l = merge_partials(jnp.stack([a, b]), jnp.stack([am, bm]), jnp.stack([al, bl]))
    np.testing.assert_allclose(np.asarray(out), np.asarray(full, np.float32), atol=2e-2, rtol=2e-2)
    np.testing.assert_allclose(m, fm, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(l, fl, rtol=1e-4)


def test_default_split_follows_the_real_lengths_not_the_table():
    bsz = DecodeBlockSizes()
    # 128K of real KV: MHA (32 KV heads) -> 32 items x 32 heads, GQA (8 KV heads) -> 128 x 8: 1024 programs.
    assert int(bsz.split(1024, jnp.asarray([131072]), 32)) == 4096
    assert int(bsz.split(1024, jnp.asarray([131072]), 8)) == 1024
    # Just past a power of two the split grows by one token, not twice over.
    assert int(bsz.split(1024, jnp.asarray([131072 + 5]), 32)) == 4097
    # A 32K sequence in a table sized for 512K still gets ~1024 programs.
    assert int(bsz.split(1024, jnp.asarray([32768]), 32)) == 1024
    # Short calls aim for short_target_programs (512) items x heads, never below one tile, and never
    # below min_tokens_per_split (256) where that still gives them as many.
    assert int(bsz.split(256, jnp.asarray([1024]), 32)) == 64  # 16 items x 32 heads
    assert int(bsz.split(256, jnp.asarray([2048]), 32)) == 128
    assert int(bsz.split(256, jnp.asarray([4096]), 32)) == 256
    assert int(bsz.split(256, jnp.asarray([8192]), 32)) == 256  # 32 items: the long rule's 1024 programs
    assert int(bsz.split(256, jnp.asarray([100]), 1)) == 64  # one tile
    assert int(bsz.split(16, jnp.asarray([1000]), 8)) == 16


def test_few_kv_heads_get_at_most_max_items_a_head_and_eight_or_more_keep_their_targets():
    """A tensor shard's few KV heads cap both program targets at MAX_ITEMS_PER_HEAD x heads; from 8 heads up
    no schedule the tuner lists (targets up to 2048 / 1024) changes."""
    assert MAX_ITEMS_PER_HEAD * 8 >= 2048
    assert DecodeBlockSizes().programs(2) == (2 * MAX_ITEMS_PER_HEAD, min(512, 2 * MAX_ITEMS_PER_HEAD))
    assert DecodeBlockSizes().programs(1) == (MAX_ITEMS_PER_HEAD, MAX_ITEMS_PER_HEAD)
    for heads in (8, 10, 32):
        assert DecodeBlockSizes().programs(heads) == (1024, 512)
        assert DecodeBlockSizes(target_programs=2048, short_target_programs=1024).programs(heads) == (2048, 1024)
    # One 128K sequence over 2 KV heads: 1024 programs would be 512 items a head.
    split = int(DecodeBlockSizes().split(256, jnp.asarray([131072]), 2))
    assert 131072 // split == MAX_ITEMS_PER_HEAD
    assert int(DecodeBlockSizes().split(256, jnp.asarray([131072]), 8)) == 131072 * 8 // 1024  # uncapped


def test_host_split_equals_the_kernels():
    """split_for_work on Python ints (the AutoTuner's features) gives what the kernel computes on the device."""
    rng = np.random.default_rng(seed(53823))
    schedules = (DecodeBlockSizes(), DecodeBlockSizes(block_k=128),
                 DecodeBlockSizes(target_programs=512, short_target_programs=256, min_tokens_per_split=1024))
    for _ in range(40):
        lens = rng.integers(1, int(rng.choice([100, 5000, 600_000])), size=int(rng.integers(1, 9)))
        heads, block = int(rng.choice([1, 2, 8, 32])), int(rng.choice([16, 64, 256, 1024]))
        for bsz in schedules:
            host = bsz.split_for_work(int(lens.sum()) * heads, bsz.tile(block), heads)
            assert isinstance(host, int) and host == int(bsz.split(block, jnp.asarray(lens, jnp.int32), heads))
    # The static bound holds for any lengths: target / heads + num_seqs items.
    rng = np.random.default_rng(seed(53824))
    for _ in range(200):
        lens = rng.integers(0, 1 << rng.integers(1, 20), size=int(rng.integers(1, 40)))
        heads = int(rng.choice([1, 2, 8, 32]))
        split = int(bsz.split(16, jnp.asarray(lens, jnp.int32), heads))
        per_sequence = np.maximum(-(-lens // split), 1)  # an empty sequence still gets one item
        assert int(per_sequence.sum()) <= bsz.num_items(16, len(lens), 1 << 20, heads), (lens, heads, split)
        # and one sequence's: whether the kernel needs its two-level merge is decided from this bound
        assert int(per_sequence.max()) <= bsz.items_per_sequence(16, 1 << 20, heads), (lens, heads, split)
    for heads in (1, 2, 8, 32):  # one long sequence: the bound is tight
        lens = np.asarray([(1 << 20) - 3])
        split = int(bsz.split(16, jnp.asarray(lens, jnp.int32), heads))
        assert -(-int(lens[0]) // split) <= bsz.items_per_sequence(16, 1 << 20, heads), (heads, split)
    # Llama-2-7B's 32 KV heads (MHA: 128 items a run) never need it under the default schedule; GQA 8's shards do.
    assert DecodeBlockSizes().items_per_sequence(256, 1 << 20, 32) <= parts_per_merge_load(1) * MERGE_LOADS_PER_RUN
    assert DecodeBlockSizes().items_per_sequence(256, 1 << 20, 2) > parts_per_merge_load(8) * MERGE_LOADS_PER_RUN


def _work_items(kv_lens, num_items, block_sizes, block_size=16, num_kv_heads=2):
    """Each program's (seq, start, count, first item, items) from the kernel's own `_work_item`."""
    from jax.experimental import pallas as pl

    num_seqs = kv_lens.shape[0]

    def kernel(lens_ref, out_ref):
        item = pl.program_id(0)
        values = _work_item(lens_ref, item, num_seqs=num_seqs, seqs_pow2=1 << (num_seqs - 1).bit_length(),
                            block_sizes=block_sizes, block_size=block_size, num_kv_heads=num_kv_heads)
        for i, v in enumerate(values):
            out_ref[item, i] = v.astype(jnp.int32)

    out = pl.pallas_call(kernel, grid=(num_items,), in_specs=[pl.no_block_spec], out_specs=pl.no_block_spec,
                         out_shape=jax.ShapeDtypeStruct((num_items, 5), jnp.int32), interpret=True)(kv_lens)
    return np.asarray(out).T


@pytest.mark.parametrize("lens,split", [([0, 5, 64, 65, 0, 200], 64), ([3000], None), ([1, 0, 129, 7], None)])
def test_work_items_cover_each_sequence_once_then_run_past_the_batch(lens, split):
    kv_lens = jnp.asarray(lens, jnp.int32)
    block_sizes = DecodeBlockSizes(block_k=16, tokens_per_split=split, min_tokens_per_split=32, target_programs=16)
    num_items = block_sizes.num_items(16, len(lens), 4096, 2)
    seq, start, count, first, items = _work_items(kv_lens, num_items, block_sizes)
    real = seq < len(lens)
    split = int(block_sizes.split(16, kv_lens, 2))
    assert real.sum() == sum(max(1, -(-n // split)) for n in lens)  # kv_len 0 still gets its one program
    assert np.all(real[:real.sum()]) and not np.any(real[real.sum():])  # real items first, then past the batch
    for s, n in enumerate(lens):
        # Each sequence's items are the run first .. first + items - 1 (what its last program merges).
        mine = np.flatnonzero(real & (seq == s))
        np.testing.assert_array_equal(mine, np.arange(first[mine[0]], first[mine[0]] + items[mine[0]]))
        assert np.all(first[mine] == first[mine[0]]) and np.all(items[mine] == len(mine))
        covered = np.concatenate([np.arange(st, st + c) for st, c in zip(start[mine], count[mine])])
        np.testing.assert_array_equal(np.sort(covered), np.arange(n))


@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(4, 4), (8, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
def test_query_heads_read_in_place_from_the_grouped_layout(num_q_heads, num_kv_heads):
    """q grouped per KV head with one more row a group ([S, Hkv, G + 1, D]: the model's rotated q|k)
    gives what the queries alone give, against the reference too; the extra rows hold NaN and must
    not be read. Awkward lengths: 0, one tile +- 1, a non-multiple of the rBlock."""
    rng = np.random.default_rng(num_q_heads * 10 + num_kv_heads)
    g = num_q_heads // num_kv_heads
    q, pools, clean, tables, kv_lens = make_case(rng, [5, 0, 70, 15, 17, 33], num_q_heads, num_kv_heads, 64, 16,
                                                 jnp.bfloat16)
    grouped = q.reshape(q.shape[0], num_kv_heads, g, 64)  # query head h is [h // G, h % G]
    wide = jnp.concatenate([grouped, jnp.full((q.shape[0], num_kv_heads, 1, 64), jnp.nan, q.dtype)], axis=2)
    bsz = DecodeBlockSizes(block_k=16, tokens_per_split=32)
    got, (m, l) = ragged_decode(wide, pools["k"], pools["v"], tables, kv_lens, num_q_heads=num_q_heads,
                                block_sizes=bsz, return_residuals=True)
    want = ragged_decode(q, pools["k"], pools["v"], tables, kv_lens, block_sizes=bsz)
    assert got.shape == (q.shape[0], num_q_heads, 64)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    ref, (rm, rl) = ragged_decode_reference(q, clean["k"], clean["v"], tables, kv_lens, return_residuals=True)
    assert_matches((got, m, l), (ref, rm, rl), jnp.bfloat16)
    too_many = num_q_heads + 2 * num_kv_heads  # more than the group's rows hold
    with pytest.raises(ValueError, match=f"num_q_heads {too_many} must be a multiple"):
        ragged_decode(wide, pools["k"], pools["v"], tables, kv_lens, num_q_heads=too_many)
    if num_kv_heads > 1:
        with pytest.raises(ValueError, match=f"num_q_heads {num_q_heads + 1} must be a multiple"):
            ragged_decode(wide, pools["k"], pools["v"], tables, kv_lens, num_q_heads=num_q_heads + 1)
    with pytest.raises(ValueError, match="grouped q"):
        ragged_decode(wide[:, :1] if num_kv_heads > 1 else jnp.concatenate([wide] * 2, axis=1),
                      pools["k"], pools["v"], tables, kv_lens)


def test_under_jit():
    rng = np.random.default_rng(10)
    q, pools, clean, tables, kv_lens = make_case(rng, [33, 2], 4, 1, 64, 16, jnp.float16)
    fn = jax.jit(lambda q, k, v, t, n: ragged_decode(q, k, v, t, n))
    out = fn(q, pools["k"], pools["v"], tables, kv_lens)
    ref = ragged_decode_reference(q, clean["k"], clean["v"], tables, kv_lens)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=4e-3, rtol=4e-3)


def _bad_inputs():
    q = jnp.zeros((2, 4, 64), jnp.bfloat16)
    k = jnp.zeros((6, 2, 16, 64), jnp.bfloat16)
    tables = jnp.asarray([[0, 1], [2, 3]], jnp.int32)
    lens = jnp.asarray([20, 3], jnp.int32)
    return q, k, tables, lens


@pytest.mark.parametrize("change,match", [
    (lambda q, k, t, n: (q, k, t.at[0, 1].set(6), n), "block_tables entry 6"),
    (lambda q, k, t, n: (q, k, t.at[1, 0].set(-1), n), "block_tables entry -1"),
    (lambda q, k, t, n: (q, k, t, n.at[0].set(33)), "kv_len 33"),
    (lambda q, k, t, n: (q[:, :3], k, t, n), "num_q_heads 3"),
    (lambda q, k, t, n: (q, k.astype(jnp.int16), t, n), "not supported"),
    (lambda q, k, t, n: (q[..., :32], k[..., :32], t, n), "head_dim 32"),
    (lambda q, k, t, n: (q[:1], k, t, n), "sequences"),
    (lambda q, k, t, n: (q, k[:, :, :8], t, n), "multiple of 16"),
    (lambda q, k, t, n: (q[0], k, t, n), "num_seqs"),
])
def test_bad_inputs_raise_value_error(change, match):
    q, k, tables, lens = change(*_bad_inputs())
    with pytest.raises(ValueError, match=match):
        ragged_decode(q, k, k, tables, lens)


def test_int8_without_scales_and_bad_block_sizes_raise():
    q, k, tables, lens = _bad_inputs()
    with pytest.raises(ValueError, match="k_scale"):
        ragged_decode(q, k.astype(jnp.int8), k.astype(jnp.int8), tables, lens)
    with pytest.raises(ValueError, match="block_k 48"):
        DecodeBlockSizes(block_k=48)
    with pytest.raises(ValueError, match="tokens_per_split 64"):
        DecodeBlockSizes(block_k=128, tokens_per_split=64)


@pytest.mark.gpu
@pytest.mark.skipif(not compat.on_gpu(), reason="needs a GPU")
@pytest.mark.parametrize("kv_dtype", [jnp.bfloat16, "int8"])
def test_compiled_kernel_on_gpu(kv_dtype):
    rng = np.random.default_rng(11)
    case = make_case(rng, [1, 127, 128, 129, 0, 3000], 32, 8, 128, 256, kv_dtype)
    with jax.default_matmul_precision("highest"):  # the reference's f32 einsums in full f32, not TF32
        got, want = run_both(*case)
    assert_matches(got, want, case[0].dtype)
