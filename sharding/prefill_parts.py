"""Host-side (NumPy) part rows of a DistAttention prefill step: where each sequence's earlier KV lives.

A prefill step's queries of a sequence are its positions c0 .. kv_len - 1 (c0 = kv_len - q_len). Their causal
attention splits exactly into two kinds of keys:

- the PAST, positions before c0: every query of the step sees every one of them, so on each instance the
  sequence's past keys there form ONE row, in any order (keys are stored after RoPE, so attention over them
  does not depend on where they sit), with no mask: the row's table lists the instance's full past rBlocks,
  then the rBlock holding c0 if its first c0 % block_size keys are past and it lives there (the only
  partial one, so it goes last); query_starts = the row's key count puts every query after every key.
- the CHUNK, positions c0 .. kv_len - 1: the step's own new K/V, causal among themselves. Every instance
  has them (DistAttention gathers the step's q/k/v), so the sequence's home attends over them from a small
  pool of the step's own tokens (`chunk_block_size`), not from wherever their rBlocks live.

Rows are one per (instance, sequence with past keys there) and each holds the sequence's q_len queries, so an
instance has at most as many rows as the step has sequences and at most as many row queries as the step has
tokens, however the rBlocks are scattered: the step's shapes are fixed by its bucket (one program, whose memory
the engine plans for). Merged per query token with their residuals, the rows' partials and the chunk's are the
whole attention.

`prefill_parts` takes tables of (instance, block) placements (as `Allocation.table` holds them);
`prefill_parts_from_global` a [S, W] table of global rBlock ids.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class PrefillParts:
    """Past rows of one prefill step, per instance (int32 NumPy arrays; I instances, R rows per instance,
    W rBlocks per row, T_l query tokens per instance, padded to those sizes).

    tables: [I, R, W] each row's local rBlock ids on its instance (0 past the row's rBlocks).
    kv_lens: [I, R] the row's keys (0: an unused row).
    query_starts: [I, R] = kv_lens: every query of the row sees every key.
    cu_q_lens: [I, R + 1] the rows' query tokens packed per instance.
    token_index: [I, T_l] per packed local query token, its index in the step's packed queries; -1 past
      cu_q_lens[i, -1] (padding).
    seq: [I, R] the sequence the row belongs to, -1 for unused rows (host bookkeeping, not sent).
    """

    tables: np.ndarray
    kv_lens: np.ndarray
    query_starts: np.ndarray
    cu_q_lens: np.ndarray
    token_index: np.ndarray
    seq: np.ndarray

    def __post_init__(self):
        if self.tables.ndim != 3:
            raise ValueError(f"tables must be [instances, rows, max_blocks], got shape {self.tables.shape}")
        rows = self.tables.shape[:2]
        for name in ("kv_lens", "query_starts", "seq"):
            if getattr(self, name).shape != rows:
                raise ValueError(f"{name} shape {getattr(self, name).shape} != [instances, rows] = {rows}")
        if self.cu_q_lens.shape != (rows[0], rows[1] + 1):
            raise ValueError(f"cu_q_lens shape {self.cu_q_lens.shape} != [instances, rows + 1] = "
                             f"{(rows[0], rows[1] + 1)}")
        if self.token_index.ndim != 2 or self.token_index.shape[0] != rows[0]:
            raise ValueError(f"token_index shape {self.token_index.shape} != [instances={rows[0]}, tokens]")
        if np.any(self.cu_q_lens[:, -1] > self.token_index.shape[1]):
            raise ValueError(f"cu_q_lens ends at {int(self.cu_q_lens[:, -1].max())} query tokens; token_index "
                             f"holds {self.token_index.shape[1]} per instance")

    def device_args(self) -> tuple[np.ndarray, ...]:
        """(tables, kv_lens, query_starts, cu_q_lens, token_index): the rows as the kernels take them."""
        return self.tables, self.kv_lens, self.query_starts, self.cu_q_lens, self.token_index


def _placement(p: Any) -> tuple[int, int]:
    """(instance, block) of a `Placement` (anything with .instance and .block) or a 2-tuple."""
    if hasattr(p, "instance"):
        return int(p.instance), int(p.block)
    instance, block = p
    return int(instance), int(block)


def _fit(name: str, needed: int, limit: int | None) -> int:
    """The padded size: `limit` if given (raising when `needed` exceeds it), else needed (at least 1)."""
    if limit is None:
        return max(1, needed)
    if needed > limit:
        raise ValueError(f"this step needs {name} = {needed}, more than the bucket's {limit}")
    return limit


def chunk_block_size(block_size: int) -> int:
    """Tokens per rBlock of a step's chunk pool (DistAttention): each sequence's chunk starts at a block of its
    own there, so small blocks waste little; at most the pool's rBlock size."""
    return min(block_size, CHUNK_BLOCK)


# Tokens per rBlock of the chunk pool where the pool's rBlocks are larger (a multiple of the kernels' key tile).
CHUNK_BLOCK = 64


def prefill_parts(
    tables: Sequence[Sequence[Any]],
    kv_lens: Sequence[int],
    q_lens: Sequence[int],
    *,
    block_size: int,
    instances: int,
    max_rows: int | None = None,
    max_blocks: int | None = None,
    max_tokens: int | None = None,
) -> PrefillParts:
    """Past rows of a prefill step (the module docstring) from per-sequence tables of (instance, block) placements.

    Args:
      tables: per sequence, its rBlock table: entry e (a `Placement` or an (instance, block) pair) holds
        positions [e * block_size, (e + 1) * block_size); entries past the sequence's kv_len are ignored.
      kv_lens: per sequence, its KV tokens including this step's query tokens.
      q_lens: per sequence, its query tokens this step, packed in sequence order (the last q_len
        positions of its KV; 0: no row).
      block_size: tokens per rBlock.
      instances: instances on the mesh axis.
      max_rows, max_blocks, max_tokens: pad rows per instance, rBlocks per row and query tokens per
        instance to these (a bucket; ValueError if the step needs more); default the step's own maxima.

    Returns:
      PrefillParts with one row per (instance, sequence with queries and past keys on that instance).
    """
    _check_step(len(tables), kv_lens, q_lens, block_size, instances)
    placements = []
    for s, (table, kv_len) in enumerate(zip(tables, kv_lens)):
        used = _used_entries(s, kv_len, len(table), block_size)
        placements.append(np.array([_placement(table[e]) for e in range(used)], np.int64).reshape(used, 2).T)
    return _past_rows(placements, kv_lens, q_lens, block_size=block_size, instances=instances, max_rows=max_rows,
                      max_blocks=max_blocks, max_tokens=max_tokens)


def _check_step(num_tables: int, kv_lens, q_lens, block_size: int, instances: int) -> None:
    if num_tables != len(kv_lens) or len(q_lens) != len(kv_lens):
        raise ValueError(f"tables ({num_tables}), kv_lens ({len(kv_lens)}) and q_lens ({len(q_lens)}) must "
                         "have one entry per sequence")
    if block_size <= 0 or instances <= 0:
        raise ValueError(f"block_size {block_size} and instances {instances} must be positive")


def _used_entries(s: int, kv_len, table_width: int, block_size: int) -> int:
    """Sequence s's table entries holding its kv_len keys (ValueError naming them when the table is narrower)."""
    used = -(-int(kv_len) // block_size)
    if used > table_width:
        raise ValueError(f"sequence {s}: kv_len {kv_len} needs {used} rBlocks of {block_size}; its table has "
                         f"{table_width}")
    return used


def _past_rows(placements: Sequence[np.ndarray], kv_lens, q_lens, *, block_size: int, instances: int,
               max_rows: int | None, max_blocks: int | None, max_tokens: int | None) -> PrefillParts:
    """prefill_parts on each sequence's used table entries as a [2, used] array (instances, then blocks)."""
    rows: list[list[tuple[int, np.ndarray, int, np.ndarray]]] = [[] for _ in range(instances)]
    first_token = 0
    for s, ((where, block), kv_len, q_len) in enumerate(zip(placements, kv_lens, q_lens)):
        kv_len, q_len = int(kv_len), int(q_len)
        if not 0 <= q_len <= kv_len:
            raise ValueError(f"sequence {s}: q_len {q_len} must be in [0, kv_len {kv_len}]")
        outside = np.flatnonzero((where < 0) | (where >= instances))
        if len(outside):
            e = int(outside[0])
            raise ValueError(f"sequence {s}: table entry {e} is on instance {int(where[e])}, outside [0, {instances})")
        past = kv_len - q_len  # the first query position: keys before it are the past
        full, partial = divmod(past, block_size)
        if q_len:
            tokens = np.arange(q_len, dtype=np.int64) + first_token
            for instance in range(instances):
                blocks = block[:full][where[:full] == instance]
                keys = len(blocks) * block_size
                if partial and where[full] == instance:  # the one partly past rBlock: its keys come last
                    blocks = np.append(blocks, block[full])
                    keys += partial
                if keys:
                    rows[instance].append((s, blocks, keys, tokens))
        first_token += q_len
    num_rows = _fit("rows per instance", max(len(r) for r in rows), max_rows)
    width = _fit("rBlocks per row", max((len(row[1]) for r in rows for row in r), default=0), max_blocks)
    num_tokens = _fit("query tokens per instance", max(sum(len(row[3]) for row in r) for r in rows), max_tokens)
    out = dict(tables=np.zeros((instances, num_rows, width), np.int32),
               kv_lens=np.zeros((instances, num_rows), np.int32),
               query_starts=np.zeros((instances, num_rows), np.int32),
               cu_q_lens=np.zeros((instances, num_rows + 1), np.int32),
               token_index=np.full((instances, num_tokens), -1, np.int32),
               seq=np.full((instances, num_rows), -1, np.int32))
    for i, instance_rows in enumerate(rows):
        count = 0
        for r, (s, blocks, keys, tokens) in enumerate(instance_rows):
            out["tables"][i, r, :len(blocks)] = blocks
            out["kv_lens"][i, r] = out["query_starts"][i, r] = keys
            out["seq"][i, r] = s
            out["token_index"][i, count:count + len(tokens)] = tokens
            count += len(tokens)
            out["cu_q_lens"][i, r + 1] = count
        out["cu_q_lens"][i, len(instance_rows) + 1:] = count
    return PrefillParts(**out)


def prefill_parts_from_global(
    tables: np.ndarray,
    kv_lens: Sequence[int],
    q_lens: Sequence[int],
    *,
    block_size: int,
    blocks_per_instance: int,
    instances: int,
    max_rows: int | None = None,
    max_blocks: int | None = None,
    max_tokens: int | None = None,
) -> PrefillParts:
    """`prefill_parts` for a [S, W] table of global rBlock ids: id g is rBlock g % blocks_per_instance of
    instance g // blocks_per_instance."""
    tables = np.asarray(tables)
    if tables.ndim != 2:
        raise ValueError(f"tables must be [num_seqs, max_blocks] global rBlock ids, got shape {tables.shape}")
    if blocks_per_instance <= 0:
        raise ValueError(f"blocks_per_instance {blocks_per_instance} must be positive")
    _check_step(tables.shape[0], kv_lens, q_lens, block_size, instances)
    placements = []
    for s, kv_len in enumerate(kv_lens):
        ids = tables[s, :_used_entries(s, kv_len, tables.shape[1], block_size)].astype(np.int64)
        placements.append(np.stack([ids // blocks_per_instance, ids % blocks_per_instance]))
    return _past_rows(placements, kv_lens, q_lens, block_size=block_size, instances=instances, max_rows=max_rows,
                      max_blocks=max_blocks, max_tokens=max_tokens)
