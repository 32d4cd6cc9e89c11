"""A StepPlan as the device inputs of one step: padded to its bucket, stacked on a leading instance axis.

The step runs per instance (jaxllm.executor.programs), so every leaf of its StepInputs has a leading axis
[I, ...]: instance i's rows, padded to one bucket shared by all (the largest instance's), in local rBlock
ids (a plan's ids are global: instance * blocks_per_instance + local). One instance is the I = 1 case of the
same function (decision 11: one GPU is no separate path). A step in which every sequence's rBlocks are at
home needs nothing more. Otherwise it carries `DistParts` (sharding.dist_attention) for every instance:
where each gathered token's K/V is written, and the rows of attention each instance computes over the
rBlocks it holds. A decode continuation (StepPlan.next_decode: the same rows one token on) is not laid out anew:
`InputLayout.advance` writes the rows' moved values into copies of its source's arrays. Host-side NumPy only.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np

from jaxllm.contract import StepKind, StepPlan
from jaxllm.executor import penalties
from jaxllm.executor.step import StepInputs, inert_step_inputs
from jaxllm.tuner.buckets import Buckets
from sharding.dist_attention import DistParts
from sharding.prefill_parts import chunk_block_size, prefill_parts_from_global

__all__ = ["InputLayout", "StepBatch", "inert_inputs", "is_borrowed", "lent_entries", "token_rows", "used_entries"]


@dataclasses.dataclass(frozen=True)
class StepBatch:
    """A plan's stacked inputs, and what the executor needs beside them.

    inputs: StepInputs [I, ...] (host arrays). rows: per plan row, its flat index in the step's [I * S]
    outputs. size: the bucket (StepKind.size_unit: sequences for decode and verify, tokens for prefill). borrowed: some
    sequence has rBlocks on another instance (inputs.parts set). plan, busiest: the plan and the instance with the
    most work.
    """

    inputs: StepInputs
    rows: np.ndarray
    size: int
    borrowed: bool
    plan: StepPlan
    busiest: int = 0

    @functools.cached_property
    def heaviest(self) -> StepPlan:
        """The busiest instance's rows as a plan: what the tuner sizes the step by (every instance runs the same
        kernels, and the slowest sets the pace). Built when asked: a fixed tuner never asks."""
        if self.plan.instances is None:
            return self.plan
        bounds = np.searchsorted(self.plan.instances, [self.busiest, self.busiest + 1], side="left")
        return self.plan.rows(int(bounds[0]), int(bounds[1]))


@dataclasses.dataclass(frozen=True)
class InputLayout:
    """How plans become inputs: the mesh's instances, each one's pool, and the buckets (the one padding rule,
    jaxllm.tuner.buckets); bias_width: the engine's max_logit_bias with penalties on (StepInputs.penalties), None
    with them off."""

    instances: int
    blocks_per_instance: int
    block_size: int
    buckets: Buckets
    bias_width: int | None = None

    @property
    def table_width(self) -> int:
        return self.buckets.table_width

    def build(self, plan: StepPlan) -> StepBatch:
        """The plan padded and stacked (see the module docstring), for one instance or many alike: every instance's
        rows scattered into its slice of the stacked arrays at once (no loop over instances: this runs on the host
        for every step, in the time the devices run the previous one). ValueError when it exceeds the limits."""
        kind, bs, nb, n = plan.kind, self.block_size, self.blocks_per_instance, self.instances
        decode = kind is StepKind.DECODE
        by_seqs = kind is not StepKind.PREFILL  # a decode or verify bucket counts sequences (Buckets.padded)
        bounds = plan.instance_bounds(n)
        first_token = plan.cu_q_lens[bounds].astype(np.int64)
        counts, token_counts = np.diff(bounds), np.diff(first_token)
        size = int(counts.max() if by_seqs else token_counts.max())
        t_pad, s_pad = self.buckets.padded(kind, size)
        width = plan.block_tables.shape[1]
        if int(counts.max()) > s_pad or width > self.table_width:
            raise ValueError(f"an instance's {int(counts.max())} sequences x {width} rBlocks exceed the executor's "
                             f"limits ({s_pad} x {self.table_width})")
        homes = _homes(plan)
        local_row = np.arange(plan.num_seqs) - bounds[homes]  # each row's place in its instance's rows
        q_lens = np.diff(plan.cu_q_lens)
        token_home = homes if decode else np.repeat(homes, q_lens)
        local_token = np.arange(plan.num_tokens) - first_token[token_home]
        out = inert_inputs(kind, t_pad, s_pad, self.table_width, n, borrowed=False, bias_width=self.bias_width)
        out.tokens[token_home, local_token] = plan.token_ids
        out.positions[token_home, local_token] = plan.positions
        if plan.targets is not None:
            out.targets[token_home, local_token] = plan.targets
        out.kv_lens[homes, local_row] = plan.kv_lens
        for name in ("temperature", "top_k", "top_p", "seed"):
            getattr(out, name)[homes, local_row] = getattr(plan, name)
        if out.penalties is not None and (plan.penalties is not None or plan.logit_bias is not None):
            rows = penalties.penalty_inputs(plan, plan.num_seqs, self.bias_width)
            for f in dataclasses.fields(rows):
                getattr(out.penalties, f.name)[homes, local_row] = getattr(rows, f.name)
        if not decode:
            # Padding sequences have no query tokens; a decode step keeps cu == arange for the decode kernel's
            # contract (each padding sequence one padding token, kv_len 0: it attends to nothing). A verify step's
            # real rows have Q tokens each, so its tokens lie at s * Q + j as its attention reads them
            # (pallas_kernels.verify_attention), and its padding rows' Q tokens (kv_len 0) attend to nothing.
            out.cu_q_lens[:] = token_counts[:, None]
            out.cu_q_lens[:, 0] = 0
            out.cu_q_lens[homes, local_row + 1] = plan.cu_q_lens[1:] - first_token[homes]
        used = used_entries(plan, bs)
        borrowed = bool(np.any(lent_entries(plan, nb, used)))
        if borrowed:
            # A borrowed step writes and attends through its parts: the ordinary tables and slots stay inert.
            out = dataclasses.replace(out, parts=_dist_parts(plan, used, n, nb, bs, t_pad, s_pad, self.table_width,
                                                             bounds, first_token))
        else:  # every rBlock at home: local ids, the ordinary step
            out.block_tables[homes, local_row, :width] = np.where(used, plan.block_tables - (homes * nb)[:, None], 0)
            out.slot_mapping[token_home, local_token] = plan.slot_mapping - token_home * (nb * bs)
        rows = homes * s_pad + local_row
        work = plan.kv_lens if by_seqs else q_lens  # a decode or verify step reads its KV, a prefill computes
        busiest = int(np.argmax(np.bincount(homes, weights=work, minlength=n)))
        return StepBatch(out, rows, s_pad if by_seqs else t_pad, borrowed, plan, busiest)

    def advance(self, prev: StepBatch, plan: StepPlan) -> StepBatch:
        """The batch of `plan`, a continuation of prev's plan (StepPlan.next_decode), from prev's arrays: the same
        rows at the same places, so only the tokens, positions, kv_lens and KV slots move (each row's entry, no
        padding laid again); equal to build(plan). A plan whose tables grew (a row entered a new rBlock, which
        may lie on another instance), or a borrowed step, is built anew."""
        src = prev.plan
        if (prev.borrowed or plan.block_tables is not src.block_tables or plan.kind is not StepKind.DECODE
                or src.kind is not StepKind.DECODE or plan.num_seqs != src.num_seqs):
            return self.build(plan)
        inputs, rows = prev.inputs, prev.rows
        moved = {}
        homes = rows // inputs.num_seqs
        local_slots = plan.slot_mapping - homes * (self.blocks_per_instance * self.block_size)
        for name, values in (("tokens", plan.token_ids), ("positions", plan.positions), ("kv_lens", plan.kv_lens),
                             ("slot_mapping", local_slots)):
            moved[name] = getattr(inputs, name).copy()
            moved[name].reshape(-1)[rows] = values
        busiest = int(np.argmax(np.bincount(homes, weights=plan.kv_lens, minlength=self.instances)))
        return StepBatch(dataclasses.replace(inputs, **moved), rows, prev.size, False, plan, busiest)

    def inert(self, kind: StepKind, size: int, borrowed: bool = False) -> StepInputs:
        """Warm-up inputs of one bucket (`size`: sequences for decode and verify, tokens for prefill): real shapes,
        nothing written, nothing attended."""
        t_pad, s_pad = self.buckets.padded(kind, size)
        return inert_inputs(kind, t_pad, s_pad, self.table_width, self.instances, borrowed, self.bias_width,
                            self.block_size)


def token_rows(plan: StepPlan, instances: int, num_tokens: int) -> np.ndarray:
    """Per plan token, its flat index in a step's [I * num_tokens] per-token outputs (the logits)."""
    if instances == 1:
        return np.arange(plan.num_tokens)
    bounds = plan.instance_bounds(instances)
    first_token = plan.cu_q_lens[bounds].astype(np.int64)
    home = np.repeat(np.arange(instances), np.diff(first_token))
    return home * num_tokens + np.arange(plan.num_tokens) - first_token[home]


def is_borrowed(plan: StepPlan, blocks_per_instance: int, block_size: int) -> bool:
    """Whether some sequence of the plan has rBlocks on an instance other than its home: what InputLayout.build
    decides a step by (the same `lent_entries`)."""
    return bool(np.any(lent_entries(plan, blocks_per_instance, used_entries(plan, block_size))))


def used_entries(plan: StepPlan, block_size: int) -> np.ndarray:
    """[S, W] bool: the table entries each sequence's kv_len reaches (those past it are padding and point
    nowhere)."""
    needed = -(-plan.kv_lens.astype(np.int64) // block_size)
    return np.arange(plan.block_tables.shape[1])[None, :] < needed[:, None]


def lent_entries(plan: StepPlan, blocks_per_instance: int, used: np.ndarray) -> np.ndarray:
    """[S, W] bool: the used table entries (`used_entries`) whose rBlock lies on another instance than the row's
    home: the one borrowed mask. A plan of one instance (instances None) has none."""
    if plan.instances is None:
        return np.zeros(used.shape, bool)
    return used & (plan.block_tables // blocks_per_instance != plan.instances[:, None])


def _homes(plan: StepPlan) -> np.ndarray:
    """[S] int64: each row's home instance (0 for every row of a one-instance plan)."""
    if plan.instances is None:
        return np.zeros(plan.num_seqs, np.int64)
    return plan.instances.astype(np.int64)


def _stack(per_instance: list[StepInputs]) -> StepInputs:
    return jax.tree.map(lambda *xs: np.stack(xs), *per_instance)


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
    if plan.kind is StepKind.DECODE:
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
    # Prefill: per instance, one row per sequence with past keys there, holding its queries (sharding.prefill_parts),
    # padded to the bucket's rows and tokens (never more: a row per sequence, its queries once), and each home's
    # chunk: its own tokens' K/V in a pool of their own, attended causally there.
    rows = prefill_parts_from_global(plan.block_tables, plan.kv_lens, q_lens, block_size=bs, blocks_per_instance=nb,
                                     instances=instances, max_rows=instances * s_pad, max_blocks=width,
                                     max_tokens=instances * t_pad)
    row_tokens = np.where(rows.token_index >= 0, token_gathered[np.maximum(rows.token_index, 0)], 0).astype(np.int32)
    token_rows = np.full((instances, instances * t_pad), -1, np.int32)  # each gathered token's row query here
    holder, packed = np.nonzero(rows.token_index >= 0)
    token_rows[holder, row_tokens[holder, packed]] = packed
    return DistParts(write_slots=write_slots, row_tables=rows.tables, row_lens=rows.kv_lens,
                     row_query_starts=rows.query_starts, row_cu_q_lens=rows.cu_q_lens, row_tokens=row_tokens,
                     token_rows=token_rows,
                     **_chunk_fields(q_lens, homes, first_row, instances, chunk_block_size(bs), t_pad, s_pad))


def _chunk_fields(q_lens, homes, first_row, instances: int, chunk_bs: int, t_pad: int, s_pad: int) -> dict:
    """Each home's chunk pool layout (DistParts' chunk_* fields, stacked [I, ...]): sequence s's q_len tokens at
    consecutive slots from a chunk rBlock of its own (its row's table), in its home's row order, the tokens packed
    as the step's cu_q_lens. No sequences: the bucket's inert fields."""
    blocks = -(-q_lens // chunk_bs)  # chunk rBlocks of each sequence
    before = np.cumsum(blocks) - blocks  # chunk rBlocks of the plan's earlier sequences
    first = before - before[first_row[homes]]  # ... of its home's earlier sequences (plan rows are home-major)
    local_row = np.arange(len(q_lens)) - first_row[homes]
    width = -(-t_pad // chunk_bs)
    tables = np.zeros((instances, s_pad, width), np.int32)
    entry = np.arange(width)
    tables[homes, local_row] = np.where(entry[None, :] < blocks[:, None], first[:, None] + entry[None, :], 0)
    tokens = np.zeros((instances, (width + s_pad) * chunk_bs), np.int32)
    token_row = np.repeat(np.arange(len(q_lens)), q_lens)
    offset = np.arange(len(token_row)) - np.repeat(np.cumsum(q_lens) - q_lens, q_lens)  # within its sequence
    starts = np.cumsum(q_lens) - q_lens  # each sequence's first token in the plan
    packed_before = starts - starts[first_row[homes]]  # ... in its home's packed tokens
    tokens[homes[token_row], first[token_row] * chunk_bs + offset] = packed_before[token_row] + offset
    return dict(chunk_tokens=tokens, chunk_tables=tables)


def inert_inputs(kind: StepKind, num_tokens: int, num_seqs: int, table_width: int, instances: int,
                 borrowed: bool, bias_width: int | None = None, block_size: int | None = None) -> StepInputs:
    """Warm-up inputs of one bucket, stacked for `instances`: real shapes, nothing written, nothing attended, no
    penalties (bias_width as InputLayout's; block_size: the pool's, which sizes a borrowed prefill's chunk
    tables)."""
    stacked = _stack([inert_step_inputs(kind, num_tokens, num_seqs, table_width, bias_width)] * instances)
    if not borrowed:
        return stacked
    rows, queries = instances * num_seqs, instances * num_tokens
    parts = DistParts(write_slots=np.full((instances, instances * num_tokens), -1, np.int32),
                      row_tables=np.zeros((instances, rows, table_width), np.int32),
                      row_lens=np.zeros((instances, rows), np.int32))
    if kind is not StepKind.DECODE:  # prefill and verify steps attend through the prefill parts
        if block_size is None:
            raise ValueError("a borrowed prefill step's inputs need the pool's block_size (its chunk tables)")
        none = np.zeros(0, np.int64)
        chunk = _chunk_fields(none, none, np.zeros(instances + 1, np.int64), instances, chunk_block_size(block_size),
                              num_tokens, num_seqs)
        parts = dataclasses.replace(parts, row_query_starts=np.zeros((instances, rows), np.int32),
                                    row_cu_q_lens=np.zeros((instances, rows + 1), np.int32),
                                    row_tokens=np.zeros((instances, queries), np.int32),
                                    token_rows=np.full((instances, queries), -1, np.int32), **chunk)
    return dataclasses.replace(stacked, parts=parts)
