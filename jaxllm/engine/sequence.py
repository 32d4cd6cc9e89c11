"""A sequence as the schedulers see it: a request's prompt and output ids, its sampling parameters and
where it stands (waiting, running, finished; tokens whose KV is computed; its prefix-cache keys). Pure Python."""

from __future__ import annotations

import dataclasses
import enum

from jaxllm.contract import SamplingParams

__all__ = ["Sequence", "Status"]


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass(eq=False)
class Sequence:
    seq_id: int
    prompt_ids: list[int]
    params: SamplingParams
    max_len: int  # prompt + new tokens may not exceed this (the context limit)
    output_ids: list[int] = dataclasses.field(default_factory=list)
    # One entry per output id when params.logprobs is set: (its logprob, ((id, logprob), ...) top k).
    output_logprobs: list[tuple[float, tuple[tuple[int, float], ...]]] = dataclasses.field(default_factory=list)
    # With params.prompt_logprobs: one entry per prompt token computed so far, None for the first (nothing
    # comes before it), then (its logprob, ((id, logprob), ...) top k) given the tokens before it.
    prompt_logprobs: list[tuple[float, tuple[tuple[int, float], ...]] | None] = dataclasses.field(
        default_factory=list)
    num_computed: int = 0  # tokens whose KV is in the pool
    status: Status = Status.WAITING
    finish_reason: str | None = None
    num_preemptions: int = 0
    reuse_prefix: bool = True  # may start from cached rBlocks (False: every position is computed)
    num_cached_prompt: int = 0  # tokens whose KV came from the prefix cache at its last admission
    block_keys: list[bytes] = dataclasses.field(default_factory=list)  # of its first full rBlocks
    num_registered: int = 0  # of its current rBlocks, the first this many are in the prefix cache
    num_swapped: int = 0  # while preempted: tokens whose KV waits in the host tier (0: it recomputes them)
    # With penalties (params.penalized), while it runs: its row of the instance's penalty state, the position its
    # first step after admission starts at, and its token count at admission (StepPlan's RowPenalties).
    penalty_slot: int = -1
    penalty_start: int = 0
    penalty_recount_end: int = 0

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def truncate_output(self, length: int) -> None:
        """Keep the first `length` output tokens (and their log-probabilities): a stop string ended the output
        inside the tokens one verify step kept. Only as the sequence finishes (a proposer's copy of its tokens
        only grows)."""
        del self.output_ids[length:]
        del self.output_logprobs[length:]

    def token_slice(self, start: int, end: int) -> list[int]:
        """token_ids[start:end] without building the whole list (a step's chunk of a long context)."""
        split = len(self.prompt_ids)
        if end <= split:
            return self.prompt_ids[start:end]
        if start >= split:
            return self.output_ids[start - split:end - split]
        return self.prompt_ids[start:] + self.output_ids[:end - split]
