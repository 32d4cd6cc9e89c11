"""A joined step plan of several instances as per-instance step inputs, stacked on a leading instance axis.

`InstanceSchedulers.plan()` joins every instance's rows into one StepPlan with global rBlock ids (instance *
blocks_per_instance + local). The step runs per instance (jaxllm.engine.instance_runner), so every leaf of
its StepInputs gets a leading axis [I, ...]: instance i's rows, padded to one bucket shared by all (the
largest instance's), in local ids. A step in which every sequence's rBlocks are at home needs nothing more.
Otherwise it carries `DistParts` (sharding.dist_step) for every instance: where each gathered token's K/V is
written, and the rows of attention each instance computes over the rBlocks it holds.
Host-side NumPy only.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxllm.engine.scheduler import StepPlan
from jaxllm.engine.step import StepInputs, bucket, inert_step_inputs, padded_sizes
from sharding.dist_step import DistParts
from sharding.prefill_parts import prefill_parts_from_global

__all__ = ["InstanceInputs", "inert_instance_inputs", "instance_step_inputs", "is_borrowed"]


class InstanceInputs:
    """A step's stacked inputs and, per plan row, its flat index in the step's [I * S] outputs."""

    def __init__(self, inputs: StepInputs, rows: np.ndarray):
        self.inputs = inputs
        self.rows = rows


def is_borrowed(plan: StepPlan, blocks_per_instance: int, block_size: int) -> bool:
    """Whether some sequence of the plan has rBlocks on an instance other than its home."""
    used = _used_entries(plan, block_size)
    return bool(np.any(used & (plan.block_tables // blocks_per_instance != plan.instances[:, None])))


def _used_entries(plan: StepPlan, block_size: int) -> np.ndarray:
    """[S, W] bool: the table entries each sequence's kv_len reaches."""
    needed = -(-plan.kv_lens.astype(np.int64) // block_size)
    return np.arange(plan.block_tables.shape[1])[None, :] < needed[:, None]


def _stack(per_instance: list[StepInputs]) -> StepInputs:
    fields = ("tokens", "positions", "block_tables", "kv_lens", "cu_q_lens", "slot_mapping", "temperature", "top_k",
              "top_p", "seed")
    return StepInputs(**{f: np.stack([getattr(x, f) for x in per_instance]) for f in fields})


def instance_step_inputs(plan: StepPlan, *, instances: int, blocks_per_instance: int, block_size: int,
                         min_tokens: int, seq_cap: int, table_width: int, borrowed: bool | None = None
                         ) -> InstanceInputs:
    """The joined plan as stacked per-instance inputs (local rBlock ids), with DistParts when some sequence
    has borrowed rBlocks (`borrowed`: force the variant; None decides from the plan)."""
    if plan.instances is None:
        raise ValueError("instance_step_inputs needs a joined plan (StepPlan.instances set)")
    decode, bs, nb = plan.is_decode, block_size, blocks_per_instance
    if borrowed is None:
        borrowed = is_borrowed(plan, nb, bs)
    homes = plan.instances.astype(np.int64)
    q_lens = np.diff(plan.cu_q_lens).astype(np.int64)
    token_home = np.repeat(homes, q_lens)
    counts = np.bincount(homes, minlength=instances)
    token_counts = np.bincount(token_home, minlength=instances)
    if len(counts) > instances:
        raise ValueError(f"plan names instance {int(homes.max())}; the engine has {instances}")
    size = int(counts.max() if decode else token_counts.max())
    t_pad, s_pad = padded_sizes(decode, size, min_tokens=min_tokens, seq_cap=seq_cap)
    if int(counts.max()) > s_pad or plan.block_tables.shape[1] > table_width:
        raise ValueError(f"an instance's {int(counts.max())} sequences x {plan.block_tables.shape[1]} rBlocks "
                         f"exceed the runner's limits ({s_pad} x {table_width})")
    used = _used_entries(plan, bs)
    per_instance, rows = [], np.zeros(plan.num_seqs, np.int64)
    first_row = np.concatenate([[0], np.cumsum(counts)])
    first_token = np.concatenate([[0], np.cumsum(token_counts)])
    for i in range(instances):
        r0, r1, k0, k1 = first_row[i], first_row[i + 1], first_token[i], first_token[i + 1]
        if np.any(homes[r0:r1] != i):
            raise ValueError("a joined plan's rows must be grouped by instance, in instance order")
        out = inert_step_inputs(decode, t_pad, s_pad, table_width)
        n, t = r1 - r0, k1 - k0
        out.tokens[:t] = plan.token_ids[k0:k1]
        out.positions[:t] = plan.positions[k0:k1]
        out.kv_lens[:n] = plan.kv_lens[r0:r1]
        if not decode:
            out.cu_q_lens[:] = t
            out.cu_q_lens[:n + 1] = plan.cu_q_lens[r0:r1 + 1] - plan.cu_q_lens[r0]
        if not borrowed:  # every rBlock at home: local ids, the ordinary step
            local = np.where(used[r0:r1], plan.block_tables[r0:r1] - i * nb, 0)
            out.block_tables[:n, :local.shape[1]] = local
            out.slot_mapping[:t] = plan.slot_mapping[k0:k1] - i * nb * bs
        for name in ("temperature", "top_k", "top_p", "seed"):
            getattr(out, name)[:n] = getattr(plan, name)[r0:r1]
        per_instance.append(out)
        rows[r0:r1] = i * s_pad + np.arange(n)
    stacked = _stack(per_instance)
    if borrowed:
        stacked = _with_parts(stacked, plan, used, instances, nb, bs, t_pad, s_pad, table_width, first_row,
                              first_token, decode)
    return InstanceInputs(stacked, rows)


def _with_parts(inputs: StepInputs, plan: StepPlan, used, instances: int, nb: int, bs: int, t_pad: int, s_pad: int,
                width: int, first_row, first_token, decode: bool) -> StepInputs:
    """inputs with every instance's DistParts (the dataclass documents the fields)."""
    homes = plan.instances.astype(np.int64)
    # Gathered index of every plan token and every plan row (instance-major, each instance padded).
    q_lens = np.diff(plan.cu_q_lens).astype(np.int64)
    token_home = np.repeat(homes, q_lens)
    token_gathered = token_home * t_pad + (np.arange(plan.num_tokens) - first_token[token_home])
    row_gathered = homes * s_pad + (np.arange(plan.num_seqs) - first_row[homes])
    slot_block = plan.slot_mapping.astype(np.int64) // bs
    write_slots = np.full((instances, instances * t_pad), -1, np.int32)
    for h in range(instances):
        here = slot_block // nb == h
        write_slots[h, token_gathered[here]] = plan.slot_mapping[here] - h * nb * bs
    holder = np.where(used, plan.block_tables // nb, -1)
    if decode:
        # Per holder, each sequence's rBlocks there in table order (the partial last one stays last): no loop
        # over sequences, one over instances.
        tables = np.zeros((instances, instances * s_pad, width), np.int32)
        lens = np.zeros((instances, instances * s_pad), np.int32)
        entry_tokens = np.clip(plan.kv_lens[:, None].astype(np.int64) - np.arange(holder.shape[1]) * bs, 0, bs)
        for h in range(instances):
            mine = holder == h  # [S, W]
            rows, entries = np.nonzero(mine)
            columns = (np.cumsum(mine, axis=1) - 1)[rows, entries]
            tables[h, row_gathered[rows], columns] = plan.block_tables[rows, entries] - h * nb
            lens[h, row_gathered] = (entry_tokens * mine).sum(axis=1)
        parts = DistParts(write_slots=write_slots, row_tables=tables, row_lens=lens)
        return _replace_parts(inputs, parts)
    # Prefill: one row per run of consecutive table entries on one instance, holding the sequence's query
    # tokens that can see it (sharding.prefill_parts), padded to buckets shared by every instance.
    rows = prefill_parts_from_global(plan.block_tables, plan.kv_lens, q_lens, block_size=bs, blocks_per_instance=nb,
                                     instances=instances)
    num_rows = max(instances * s_pad, bucket(rows.tables.shape[1], 1))
    num_queries = max(instances * t_pad, bucket(rows.token_index.shape[1], 1))
    grow = lambda x, n, fill=0: np.pad(x, ((0, 0), (0, n - x.shape[1])), constant_values=fill)  # noqa: E731
    tables = np.zeros((instances, num_rows, width), np.int32)
    tables[:, :rows.tables.shape[1], :rows.tables.shape[2]] = rows.tables
    cu = grow(rows.cu_q_lens, num_rows + 1)
    cu[:, rows.cu_q_lens.shape[1]:] = rows.cu_q_lens[:, -1:]  # unused rows hold no query token
    token_index = grow(rows.token_index, num_queries, -1)
    parts = DistParts(write_slots=write_slots, row_tables=tables, row_lens=grow(rows.kv_lens, num_rows),
                      row_query_starts=grow(rows.query_starts, num_rows), row_cu_q_lens=cu.astype(np.int32),
                      row_tokens=np.where(token_index >= 0, token_gathered[np.maximum(token_index, 0)], 0)
                      .astype(np.int32))
    return _replace_parts(inputs, parts)


def _replace_parts(inputs: StepInputs, parts: DistParts) -> StepInputs:
    # A borrowed step writes and attends through its parts: the ordinary tables and slots stay inert.
    return dataclasses.replace(inputs, parts=parts)


def inert_instance_inputs(decode: bool, num_tokens: int, num_seqs: int, table_width: int, instances: int,
                          borrowed: bool) -> StepInputs:
    """Warm-up inputs of one bucket: real shapes, nothing written, nothing attended."""
    one = inert_step_inputs(decode, num_tokens, num_seqs, table_width)
    stacked = _stack([one] * instances)
    if not borrowed:
        return stacked
    rows, queries = instances * num_seqs, instances * num_tokens
    parts = DistParts(write_slots=np.full((instances, instances * num_tokens), -1, np.int32),
                      row_tables=np.zeros((instances, rows, table_width), np.int32),
                      row_lens=np.zeros((instances, rows), np.int32))
    if not decode:
        parts = DistParts(write_slots=parts.write_slots, row_tables=parts.row_tables, row_lens=parts.row_lens,
                          row_query_starts=np.zeros((instances, rows), np.int32),
                          row_cu_q_lens=np.zeros((instances, rows + 1), np.int32),
                          row_tokens=np.zeros((instances, queries), np.int32))
    return _replace_parts(stacked, parts)
