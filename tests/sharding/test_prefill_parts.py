"""Past rows of a DistAttention prefill step (host-side NumPy): every (query, key before the step's first query of
its sequence) pair lies in exactly one row, on the instance that holds the key; rows and row queries never exceed
the step's sequences and tokens."""

from __future__ import annotations

import numpy as np
import pytest

from jaxllm.engine.distkv import Placement
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
    """The (query token, key position) pairs the rows cover, checking each key's rBlock on the way: a row lists its
    instance's past rBlocks of the sequence in table order, the partly past one last, and every query sees every
    key (no mask)."""
    cu = np.concatenate([[0], np.cumsum(q_lens)])
    seen = []
    instances, rows = parts.kv_lens.shape
    for i in range(instances):
        for r in range(rows):
            lo, hi = parts.cu_q_lens[i, r], parts.cu_q_lens[i, r + 1]
            if parts.seq[i, r] < 0:
                assert lo == hi and parts.kv_lens[i, r] == 0
                continue
            s, n = parts.seq[i, r], parts.kv_lens[i, r]
            assert hi - lo == q_lens[s] and n > 0 and parts.query_starts[i, r] == n
            past = kv_lens[s] - q_lens[s]
            full = [e for e in range(past // BLOCK) if tables[s][e].instance == i]
            partial = [past // BLOCK] if past % BLOCK and tables[s][past // BLOCK].instance == i else []
            positions = [e * BLOCK + j for e in full for j in range(BLOCK)] + [e * BLOCK + j for e in partial
                                                                               for j in range(past % BLOCK)]
            assert n == len(positions)
            np.testing.assert_array_equal(parts.tables[i, r, :len(full) + len(partial)],
                                          [tables[s][e].block for e in full + partial])
            for token in parts.token_index[i, lo:hi]:
                assert cu[s] <= token < cu[s + 1]
                seen += [(int(token), p) for p in positions]
        assert np.all(parts.token_index[i, parts.cu_q_lens[i, -1]:] == -1)
    return seen


@pytest.mark.parametrize("instances", [1, 2, 3, 8])
def test_rows_cover_every_past_pair_once_within_the_steps_own_sizes(instances):
    rng = np.random.default_rng(instances)
    for _ in range(5):
        tables, kv_lens, q_lens = _random_step(rng, instances)
        parts = prefill_parts(tables, kv_lens, q_lens, block_size=BLOCK, instances=instances)
        seen = _pairs(parts, tables, kv_lens, q_lens)
        # Every query sees every key before the step's first query of its sequence (its chunk's keys are the
        # home's, from the step's own K/V: not in these rows).
        want = [(int(sum(q_lens[:s])) + t, p) for s in range(len(q_lens)) for t in range(q_lens[s])
                for p in range(kv_lens[s] - q_lens[s])]
        assert sorted(seen) == sorted(want)
        # However scattered the rBlocks: no more rows on an instance than sequences, nor row queries than tokens.
        assert parts.kv_lens.shape[1] <= sum(q > 0 for q in q_lens)
        assert parts.token_index.shape[1] <= max(sum(q_lens), 1)


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
        for name in ("tables", "kv_lens", "query_starts", "cu_q_lens", "token_index", "seq"):
            np.testing.assert_array_equal(getattr(x, name), getattr(y, name))


def test_bucket_padding_and_limits():
    # Sequence 0: 14 keys, its last 5 queried (past: positions 0..8 = entry 0 on instance 0, entry 1 and the first
    # key of entry 2 on instance 1); sequence 1: 6 keys, its last queried (past 0..4 on instance 0).
    tables = [[(0, 3), (1, 0), (1, 1), (0, 4)], [(0, 5), (0, 6)]]
    parts = prefill_parts(tables, [14, 6], [5, 1], block_size=BLOCK, instances=2, max_rows=3, max_blocks=4,
                          max_tokens=16)
    assert parts.tables.shape == (2, 3, 4) and parts.token_index.shape == (2, 16)
    np.testing.assert_array_equal(parts.seq, [[0, 1, -1], [0, -1, -1]])
    np.testing.assert_array_equal(parts.kv_lens, [[4, 5, 0], [5, 0, 0]])
    np.testing.assert_array_equal(parts.query_starts, parts.kv_lens)
    np.testing.assert_array_equal(parts.tables[:, :2, :2], [[[3, 0], [5, 6]], [[0, 1], [0, 0]]])
    np.testing.assert_array_equal(parts.cu_q_lens, [[0, 5, 6, 6], [0, 5, 5, 5]])
    np.testing.assert_array_equal(parts.token_index[0, :7], [0, 1, 2, 3, 4, 5, -1])
    with pytest.raises(ValueError, match="rows per instance = 2, more than the bucket's 1"):
        prefill_parts(tables, [14, 6], [5, 1], block_size=BLOCK, instances=2, max_rows=1)
    with pytest.raises(ValueError, match="query tokens per instance = 6, more than the bucket's 5"):
        prefill_parts(tables, [14, 6], [5, 1], block_size=BLOCK, instances=2, max_tokens=5)
    with pytest.raises(ValueError, match="kv_len 17 needs 5 rBlocks of 4; its table has 4"):
        prefill_parts(tables[:1], [17], [1], block_size=BLOCK, instances=2)
    with pytest.raises(ValueError, match="entry 1 is on instance 1, outside \\[0, 1\\)"):
        prefill_parts(tables[:1], [14], [10], block_size=BLOCK, instances=1)
    with pytest.raises(ValueError, match="q_len 15 must be in \\[0, kv_len 14\\]"):
        prefill_parts(tables[:1], [14], [15], block_size=BLOCK, instances=2)


def test_shapes_are_checked():
    parts = prefill_parts([[(0, 0), (0, 1)]], [7], [3], block_size=BLOCK, instances=1)  # past: 4 keys
    fields = {name: getattr(parts, name) for name in ("tables", "kv_lens", "query_starts", "cu_q_lens",
                                                       "token_index", "seq")}
    with pytest.raises(ValueError, match="cu_q_lens shape"):
        PrefillParts(**{**fields, "cu_q_lens": np.zeros((1, 5), np.int32)})
    with pytest.raises(ValueError, match="cu_q_lens ends at 3 query tokens; token_index holds 2"):
        PrefillParts(**{**fields, "token_index": np.zeros((1, 2), np.int32)})
    assert len(parts.device_args()) == 5
