"""A step's rows as its StepPlan: the plain arrays the executor reads (positions, KV slots, sampling parameters,
penalties, logit bias, prompt-scoring targets), built in one pass over the packed tokens.

The scheduler chooses the rows (which sequences, how many tokens each); this module only lays them out, so the
rule that turns a row into plan arrays is written once for one instance's scheduler and read by the instance set's
join (jaxllm.engine.instances) through the plans it returns.
"""

from __future__ import annotations

import numpy as np

from jaxllm.contract import HostCopies, LogitBias, RowPenalties, SamplingParams, StepKind, StepPlan
from jaxllm.engine.sequence import Sequence

# (sequence, first position, token ids from there, samples a new token)
PlanRow = tuple[Sequence, int, list[int], bool]

__all__ = ["PlanRow", "assemble_plan"]


def assemble_plan(rows: list[PlanRow], tables: list[list[int]], block_size: int, *,
                  kv_extent: tuple[int, int] | None = None, host_copies: HostCopies | None = None,
                  kind: StepKind | None = None, targets: np.ndarray | None = None) -> StepPlan:
    """The StepPlan of `rows` (each (sequence, first position, token ids from there, samples a new token)) over
    their rBlock tables (`tables`, global ids, one per row); kv_extent: the plan's (total, longest) KV where the
    caller knows it (else the plan computes it); host_copies: the host tier's copies to run first. kind and
    targets: a verify step's (its kind, each token's draft after it); by default the plan derives its kind and
    its targets are the prompt-scoring ones."""
    bs = block_size
    block_tables = np.zeros((len(rows), max(len(t) for t in tables)), np.int32)
    for i, t in enumerate(tables):
        block_tables[i, :len(t)] = t
    # Every token's position and slot in one pass over the packed tokens (no per-row arrays).
    q_lens = np.fromiter((len(ids) for _, _, ids, _ in rows), np.int64, len(rows))
    starts = np.fromiter((start for _, start, _, _ in rows), np.int64, len(rows))
    cu = np.concatenate([[0], np.cumsum(q_lens)])
    row = np.repeat(np.arange(len(rows)), q_lens)
    positions = starts[row] + np.arange(cu[-1]) - cu[row]
    slots = block_tables[row, positions // bs].astype(np.int64) * bs + positions % bs
    params = [r[0].params for r in rows]
    return StepPlan(
        seq_ids=np.fromiter((r[0].seq_id for r in rows), np.int64, len(rows)),
        token_ids=np.fromiter((t for _, _, ids, _ in rows for t in ids), np.int32, int(cu[-1])),
        positions=positions.astype(np.int32),
        slot_mapping=slots.astype(np.int32),
        cu_q_lens=cu.astype(np.int32),
        kv_lens=(starts + q_lens).astype(np.int32),
        block_tables=block_tables,
        sample=np.fromiter((r[3] for r in rows), bool, len(rows)),
        temperature=np.fromiter((p.temperature for p in params), np.float32, len(rows)),
        top_k=np.fromiter((p.top_k for p in params), np.int32, len(rows)),
        top_p=np.fromiter((p.top_p for p in params), np.float32, len(rows)),
        seed=np.fromiter((p.seed for p in params), np.int32, len(rows)),
        logprobs=np.fromiter((-1 if p.logprobs is None else p.logprobs for p in params), np.int32, len(rows)),
        targets=targets if kind is StepKind.VERIFY else (_targets(rows, cu) if any(p.prompt_logprobs is not None
                                                                                 for p in params) else None),
        penalties=_penalties(rows) if any(r[0].penalty_slot >= 0 for r in rows) else None,
        logit_bias=_logit_bias(params) if any(p.logit_bias for p in params) else None,
        kv_extent=kv_extent,
        host_copies=host_copies,
        kind=kind,
    )


def _penalties(rows: list[PlanRow]) -> RowPenalties:
    seqs = [r[0] for r in rows]
    ints = lambda values: np.fromiter(values, np.int32, len(seqs))  # noqa: E731
    floats = lambda name: np.fromiter((getattr(s.params, name) for s in seqs), np.float32, len(seqs))  # noqa: E731
    held = [s.penalty_slot >= 0 for s in seqs]  # a row without penalties keeps the inert values
    return RowPenalties(
        slot=ints(s.penalty_slot for s in seqs), start=ints(s.penalty_start for s in seqs),
        prompt_len=ints(len(s.prompt_ids) if h else 0 for s, h in zip(seqs, held)),
        recount_end=ints(s.penalty_recount_end if h else 0 for s, h in zip(seqs, held)),
        frequency=floats("frequency_penalty"), presence=floats("presence_penalty"),
        repetition=floats("repetition_penalty"))


def _logit_bias(params: list[SamplingParams]) -> LogitBias:
    ids = np.full((len(params), max(len(p.logit_bias) for p in params)), -1, np.int32)
    values = np.zeros(ids.shape, np.float32)
    for i, p in enumerate(params):
        for j, (token, bias) in enumerate(p.logit_bias):
            ids[i, j], values[i, j] = token, bias
    return LogitBias(ids, values)


def _targets(rows: list[PlanRow], cu: np.ndarray) -> np.ndarray:
    """StepPlan.targets: for each token of a sequence scoring its prompt, the prompt token after it."""
    targets = np.full(int(cu[-1]), -1, np.int32)
    for (seq, start, ids, _), first in zip(rows, cu):
        if seq.params.prompt_logprobs is None:
            continue
        following = seq.token_slice(start + 1, min(start + len(ids) + 1, len(seq.prompt_ids)))
        targets[first:first + len(following)] = following
    return targets
