"""Part rows of a DistAttention prefill step (host-side NumPy): every (query, key) pair of the causal
attention lies in exactly one row, on the instance and rBlock row that hold the key."""

from __future__ import annotations

import numpy as np
import pytest

from jaxllm.engine.distkv import Allocation, Placement
from sharding.prefill_parts import PrefillParts, prefill_parts, prefill_parts_from_global

BLOCK = 4


def _random_step(rng, instances, num_seqs=6):
    """Per sequence: a table of Placements (runs of random length on random instances, spare entries past
    the KV), kv_len and q_len (0, 1, whole prompts, chunks after a cached prefix)."""
    next_block = [0] * instances
    tables, kv_lens, q_lens = [], [], []
    for s in range(num_seqs):
        kv_len = int(rng.integers(1, 40))
        q_len = [0, 1, kv_len, int(rng.integers(1, kv_len + 1))][s % 4]
        table = []
        while len(table) * BLOCK < kv_len + BLOCK:  # one spare entry past the KV
            instance = int(rng.integers(instances)) if not table or rng.random() < 0.5 else table[-1].instance
            table.append(Placement(instance, next_block[instance] + int(rng.integers(3))))
            next_block[instance] = table[-1].block + 1
        tables.append(tuple(table))
        kv_lens.append(kv_len)
        q_lens.append(q_len)
    return tables, kv_lens, q_lens


def _pairs(parts: PrefillParts, tables, kv_lens, q_lens):
    """The (query token, key position) pairs the rows cover, checking each key's rBlock on the way."""
    cu = np.concatenate([[0], np.cumsum(q_lens)])
    seen = []
    instances, rows = parts.kv_lens.shape
    for i in range(instances):
        for r in range(rows):
            lo, hi = parts.cu_q_lens[i, r], parts.cu_q_lens[i, r + 1]
            if parts.seq[i, r] < 0:
                assert lo == hi and parts.kv_lens[i, r] == 0
                continue
            s, start, n = parts.seq[i, r], parts.starts[i, r], parts.kv_lens[i, r]
            assert hi > lo and n > 0 and parts.query_starts[i, r] >= 0
            for k, token in enumerate(parts.token_index[i, lo:hi]):
                assert cu[s] <= token < cu[s + 1]
                relative = parts.query_starts[i, r] + k
                for j in range(min(relative + 1, n)):
                    where = tables[s][(start + j) // BLOCK]
                    assert (where.instance, where.block) == (i, parts.tables[i, r, j // BLOCK])
                    seen.append((int(token), int(start + j)))
        assert np.all(parts.token_index[i, parts.cu_q_lens[i, -1]:] == -1)
    return seen


@pytest.mark.parametrize("instances", [1, 2, 3, 8])
def test_rows_cover_every_causal_pair_once(instances):
    rng = np.random.default_rng(instances)
    for _ in range(5):
        tables, kv_lens, q_lens = _random_step(rng, instances)
        parts = prefill_parts(tables, kv_lens, q_lens, block_size=BLOCK, instances=instances)
        seen = _pairs(parts, tables, kv_lens, q_lens)
        want = [(int(sum(q_lens[:s])) + t, p) for s in range(len(q_lens)) for t in range(q_lens[s])
                for p in range(kv_lens[s] - q_lens[s] + t + 1)]
        assert sorted(seen) == sorted(want)
        # One row per run of the allocator's table (over the entries holding KV) of a sequence with queries.
        runs = sum(len(Allocation(s, 0, t[:-(-kv_lens[s] // BLOCK)]).runs()) for s, t in enumerate(tables)
                   if q_lens[s])
        assert (parts.seq >= 0).sum() == runs


def test_global_ids_and_tuples_give_the_same_rows():
    rng = np.random.default_rng(9)
    tables, kv_lens, q_lens = _random_step(rng, 4)
    per_instance = 100
    width = max(len(t) for t in tables)
    global_ids = np.full((len(tables), width), -1, np.int64)  # -1: padding past each table
    for s, t in enumerate(tables):
        global_ids[s, :len(t)] = [p.instance * per_instance + p.block for p in t]
    a = prefill_parts(tables, kv_lens, q_lens, block_size=BLOCK, instances=4)
    b = prefill_parts_from_global(global_ids, kv_lens, q_lens, block_size=BLOCK, blocks_per_instance=per_instance,
                                  instances=4)
    c = prefill_parts([[(p.instance, p.block) for p in t] for t in tables], kv_lens, q_lens, block_size=BLOCK,
                      instances=4)
    for x, y in ((a, b), (a, c)):
        for name in ("tables", "kv_lens", "query_starts", "cu_q_lens", "token_index", "seq", "starts"):
            np.testing.assert_array_equal(getattr(x, name), getattr(y, name))


def test_bucket_padding_and_limits():
    tables = [[(0, 3), (1, 0), (1, 1), (0, 4)]]
    parts = prefill_parts(tables, [14], [10], block_size=BLOCK, instances=2, max_rows=3, max_blocks=4, max_tokens=16)
    assert parts.tables.shape == (2, 3, 4) and parts.token_index.shape == (2, 16)
    # Instance 0: the run at entry 0 (all 10 queries, positions 4..13 at relative 4..13) and the run at entry 3
    # (positions 12, 13: relative 0, 1); instance 1: entries 1-2 (positions 4..13, relative 0..).
    np.testing.assert_array_equal(parts.starts, [[0, 12, 0], [4, 0, 0]])
    np.testing.assert_array_equal(parts.query_starts, [[4, 0, 0], [0, 0, 0]])
    np.testing.assert_array_equal(parts.kv_lens, [[4, 2, 0], [8, 0, 0]])
    np.testing.assert_array_equal(parts.cu_q_lens, [[0, 10, 12, 12], [0, 10, 10, 10]])
    np.testing.assert_array_equal(parts.token_index[0, :13], list(range(10)) + [8, 9, -1])
    with pytest.raises(ValueError, match="rows per instance = 2, more than the bucket's 1"):
        prefill_parts(tables, [14], [10], block_size=BLOCK, instances=2, max_rows=1)
    with pytest.raises(ValueError, match="query tokens per instance = 12, more than the bucket's 11"):
        prefill_parts(tables, [14], [10], block_size=BLOCK, instances=2, max_tokens=11)
    with pytest.raises(ValueError, match="kv_len 17 needs 5 rBlocks of 4; its table has 4"):
        prefill_parts(tables, [17], [1], block_size=BLOCK, instances=2)
    with pytest.raises(ValueError, match="entry 1 is on instance 1, outside \\[0, 1\\)"):
        prefill_parts(tables, [14], [10], block_size=BLOCK, instances=1)
    with pytest.raises(ValueError, match="q_len 15 must be in \\[0, kv_len 14\\]"):
        prefill_parts(tables, [14], [15], block_size=BLOCK, instances=2)


def test_shapes_are_checked():
    parts = prefill_parts([[(0, 0)]], [3], [3], block_size=BLOCK, instances=1)
    fields = {name: getattr(parts, name) for name in ("tables", "kv_lens", "query_starts", "cu_q_lens",
                                                       "token_index", "seq", "starts")}
    with pytest.raises(ValueError, match="cu_q_lens shape"):
        PrefillParts(**{**fields, "cu_q_lens": np.zeros((1, 5), np.int32)})
    with pytest.raises(ValueError, match="cu_q_lens ends at 3 query tokens; token_index holds 2"):
        PrefillParts(**{**fields, "token_index": np.zeros((1, 2), np.int32)})
    assert len(parts.device_args()) == 5
