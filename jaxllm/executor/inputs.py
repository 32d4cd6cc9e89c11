"""A StepPlan as the device inputs of one step: padded to its bucket, stacked on a leading instance axis.

The step runs per instance (jaxllm.executor.programs), so every leaf of its StepInputs has a leading axis
[I, ...]: instance i's rows, padded to one bucket shared by all (the largest instance's), in local rBlock
ids (a plan's ids are global: instance * blocks_per_instance + local). One instance is the I = 1 case: its
plan padded, with a leading axis of one (views, no copy). A step in which every sequence's rBlocks are at
home needs nothing more. Otherwise it carries `DistParts` (sharding.dist_attention) for every instance:
where each gathered token's K/V is written, and the rows of attention each instance computes over the
rBlocks it holds. Host-side NumPy only.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxllm.contract import StepPlan
from jaxllm.executor.step import StepInputs, bucket, inert_step_inputs, make_step_inputs, padded_sizes
from sharding.dist_attention import DistParts
from sharding.prefill_parts import prefill_parts_from_global

__all__ = ["InputLayout", "StepBatch", "inert_inputs", "is_borrowed", "token_rows"]

_FIELDS = ("tokens", "positions", "block_tables", "kv_lens", "cu_q_lens", "slot_mapping", "temperature", "top_k",
           "top_p", "seed")


@dataclasses.dataclass(frozen=True)
class StepBatch:
    """A plan's stacked inputs, and what the executor needs beside them.

    inputs: StepInputs [I, ...] (host arrays). rows: per plan row, its flat index in the step's [I * S]
    outputs. size: the bucket (sequences for decode, tokens for prefill). borrowed: some sequence has rBlocks
    on another instance (inputs.parts set). heaviest: the rows of the instance with the most work, as a plan
    (what the tuner sizes the step by: every instance runs the same kernels, the slowest sets the pace).
    """

    inputs: StepInputs
    rows: np.ndarray
    size: int
    borrowed: bool
    heaviest: StepPlan


@dataclasses.dataclass(frozen=True)
class InputLayout:
    """How plans become inputs: the mesh's instances, each one's pool, and the bucket rule's parameters."""

    instances: int
    blocks_per_instance: int
    block_size: int
    min_tokens: int
    seq_cap: int
    table_width: int

    def build(self, plan: StepPlan) -> StepBatch:
        """The plan padded and stacked (see the module docstring); ValueError when it exceeds the limits."""
        if self.instances == 1:
            inputs = make_step_inputs(plan, min_tokens=self.min_tokens, seq_cap=self.seq_cap,
                                      table_width=self.table_width)
            size = inputs.num_seqs if plan.is_decode else inputs.num_tokens
            stacked = StepInputs(**{f: getattr(inputs, f)[None] for f in _FIELDS})
            return StepBatch(stacked, np.arange(plan.num_seqs), size, False, plan)
        return self._build_instances(plan)

    def _build_instances(self, plan: StepPlan) -> StepBatch:
        decode, bs, nb, n = plan.is_decode, self.block_size, self.blocks_per_instance, self.instances
        bounds = plan.instance_bounds(n)
        first_token = plan.cu_q_lens[bounds].astype(np.int64)
        counts, token_counts = np.diff(bounds), np.diff(first_token)
        size = int(counts.max() if decode else token_counts.max())
        t_pad, s_pad = padded_sizes(decode, size, min_tokens=self.min_tokens, seq_cap=self.seq_cap)
        if int(counts.max()) > s_pad or plan.block_tables.shape[1] > self.table_width:
            raise ValueError(f"an instance's {int(counts.max())} sequences x {plan.block_tables.shape[1]} rBlocks "
                             f"exceed the executor's limits ({s_pad} x {self.table_width})")
        used = _used_entries(plan, bs)
        borrowed = plan.instances is not None and bool(
            np.any(used & (plan.block_tables // nb != plan.instances[:, None])))
        per_instance, rows = [], np.zeros(plan.num_seqs, np.int64)
        for i in range(n):
            r0, r1, k0, k1 = bounds[i], bounds[i + 1], first_token[i], first_token[i + 1]
            out = inert_step_inputs(decode, t_pad, s_pad, self.table_width)
            m, t = r1 - r0, k1 - k0
            out.tokens[:t] = plan.token_ids[k0:k1]
            out.positions[:t] = plan.positions[k0:k1]
            out.kv_lens[:m] = plan.kv_lens[r0:r1]
            if not decode:
                out.cu_q_lens[:] = t
                out.cu_q_lens[:m + 1] = plan.cu_q_lens[r0:r1 + 1] - plan.cu_q_lens[r0]
            if not borrowed:  # every rBlock at home: local ids, the ordinary step
                local = np.where(used[r0:r1], plan.block_tables[r0:r1] - i * nb, 0)
                out.block_tables[:m, :local.shape[1]] = local
                out.slot_mapping[:t] = plan.slot_mapping[k0:k1] - i * nb * bs
            for name in ("temperature", "top_k", "top_p", "seed"):
                getattr(out, name)[:m] = getattr(plan, name)[r0:r1]
            per_instance.append(out)
            rows[r0:r1] = i * s_pad + np.arange(m)
        stacked = _stack(per_instance)
        if borrowed:
            stacked = dataclasses.replace(stacked, parts=_dist_parts(plan, used, n, nb, bs, t_pad, s_pad,
                                                                      self.table_width, bounds, first_token))
        work = plan.kv_lens.astype(np.int64) if decode else np.diff(plan.cu_q_lens).astype(np.int64)
        busiest = int(np.argmax(np.bincount(plan.instances, weights=work, minlength=n)))
        heaviest = plan.rows(int(bounds[busiest]), int(bounds[busiest + 1]))
        return StepBatch(stacked, rows, t_pad if not decode else s_pad, borrowed, heaviest)

    def inert(self, decode: bool, size: int, borrowed: bool = False) -> StepInputs:
        """Warm-up inputs of one bucket (`size`: sequences for decode, tokens for prefill): real shapes,
        nothing written, nothing attended."""
        t_pad, s_pad = padded_sizes(decode, size, min_tokens=self.min_tokens, seq_cap=self.seq_cap)
        return inert_inputs(decode, t_pad, s_pad, self.table_width, self.instances, borrowed)


def token_rows(plan: StepPlan, instances: int, num_tokens: int) -> np.ndarray:
    """Per plan token, its flat index in a step's [I * num_tokens] per-token outputs (the logits)."""
    if instances == 1:
        return np.arange(plan.num_tokens)
    bounds = plan.instance_bounds(instances)
    first_token = plan.cu_q_lens[bounds].astype(np.int64)
    home = np.repeat(np.arange(instances), np.diff(first_token))
    return home * num_tokens + np.arange(plan.num_tokens) - first_token[home]


def is_borrowed(plan: StepPlan, blocks_per_instance: int, block_size: int) -> bool:
    """Whether some sequence of the plan has rBlocks on an instance other than its home (table entries past
    a sequence's kv_len are padding and point nowhere)."""
    if plan.instances is None:
        return False
    used = _used_entries(plan, block_size)
    return bool(np.any(used & (plan.block_tables // blocks_per_instance != plan.instances[:, None])))


def _used_entries(plan: StepPlan, block_size: int) -> np.ndarray:
    """[S, W] bool: the table entries each sequence's kv_len reaches."""
    needed = -(-plan.kv_lens.astype(np.int64) // block_size)
    return np.arange(plan.block_tables.shape[1])[None, :] < needed[:, None]


def _stack(per_instance: list[StepInputs]) -> StepInputs:
    return StepInputs(**{f: np.stack([getattr(x, f) for x in per_instance]) for f in _FIELDS})


def _dist_parts(plan: StepPlan, used, instances: int, nb: int, bs: int, t_pad: int, s_pad: int, width: int,
                first_row, first_token) -> DistParts:
    """Every instance's DistParts (the dataclass documents the fields), stacked [I, ...]."""
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
    if plan.is_decode:
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
        return DistParts(write_slots=write_slots, row_tables=tables, row_lens=lens)
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
    return DistParts(write_slots=write_slots, row_tables=tables, row_lens=grow(rows.kv_lens, num_rows),
                     row_query_starts=grow(rows.query_starts, num_rows), row_cu_q_lens=cu.astype(np.int32),
                     row_tokens=np.where(token_index >= 0, token_gathered[np.maximum(token_index, 0)], 0)
                     .astype(np.int32))


def inert_inputs(decode: bool, num_tokens: int, num_seqs: int, table_width: int, instances: int,
                 borrowed: bool) -> StepInputs:
    """Warm-up inputs of one bucket, stacked for `instances`: real shapes, nothing written, nothing attended."""
    stacked = _stack([inert_step_inputs(decode, num_tokens, num_seqs, table_width)] * instances)
    if not borrowed:
        return stacked
    rows, queries = instances * num_seqs, instances * num_tokens
    parts = DistParts(write_slots=np.full((instances, instances * num_tokens), -1, np.int32),
                      row_tables=np.zeros((instances, rows, table_width), np.int32),
                      row_lens=np.zeros((instances, rows), np.int32))
    if not decode:
        parts = dataclasses.replace(parts, row_query_starts=np.zeros((instances, rows), np.int32),
                                    row_cu_q_lens=np.zeros((instances, rows + 1), np.int32),
                                    row_tokens=np.zeros((instances, queries), np.int32))
    return dataclasses.replace(stacked, parts=parts)
