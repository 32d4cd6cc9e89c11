"""`Proposer`: the contract every draft source keeps; `Speculation`: one scheduler's settings and counters.

The scheduler (jaxllm.engine.scheduler, through jaxllm.engine.speculative.verify_rows) asks its proposer once a
step for the draft tokens of the running sequences that speculate, each with the most drafts it may take; the
verify step checks them all at once and the scheduler records what was accepted. A proposer only reads sequences
(their tokens, prompt and output): what was accepted it sees as the sequence's tokens at its next proposal, so a
proposer with state of its own (a draft model's KV) rolls it back to the sequence's tokens itself. `forget` tells
it a sequence ended or left the running set.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol, runtime_checkable

from jaxllm.contract import SpeculativeStats
from jaxllm.engine.sequence import Sequence

__all__ = ["Proposer", "Speculation"]


@runtime_checkable
class Proposer(Protocol):
    """A source of draft tokens (prompt lookup, a draft model, a benchmark's replay)."""

    name: str  # what metrics and logs call it ("ngram", "draft-model", ...)

    def propose(self, requests: list[tuple[Sequence, int]]) -> list[list[int]]:
        """For each (sequence, k): at most k tokens that may follow the sequence's tokens (prompt, then output),
        as a point mass (the one token it bets on at each place: the verify step's rejection sampling assumes it);
        [] where it has none. Every k is at least 1."""
        ...

    def forget(self, seq_id: int) -> None:
        """The sequence finished, was cancelled or preempted: drop whatever is kept for it."""
        ...


@dataclasses.dataclass
class Speculation:
    """One scheduler's speculative decoding: the proposer (shared by every instance's scheduler), the engine's k
    (`num_tokens`: the most draft tokens a sequence takes a step; a request may ask for fewer, never more), and
    what its verify steps did so far (vLLM's counters: draft tokens proposed, draft tokens accepted, drafts: the
    sequence-steps that had one)."""

    proposer: Proposer
    num_tokens: int
    draft_tokens: int = 0
    accepted_tokens: int = 0
    drafts: int = 0

    def __post_init__(self):
        if isinstance(self.num_tokens, bool) or not isinstance(self.num_tokens, int) or self.num_tokens < 1:
            raise ValueError(f"speculative decoding takes at least 1 draft token a step, got {self.num_tokens!r}")

    @property
    def queries(self) -> int:
        """Q, the tokens every sequence has in a verify step: its last token and k places for drafts."""
        return self.num_tokens + 1

    def tokens_for(self, seq: Sequence) -> int:
        """The most draft tokens seq may take this step: its request's k (None: the engine's; 0: off), none with
        penalties (their device state counts one token a step) or while it scores its prompt, and never past its
        max_tokens (the last kept token is drawn, not drafted: k drafts fit where k + 1 tokens are left)."""
        params = seq.params
        if params.penalized or params.prompt_logprobs is not None:
            return 0
        k = self.num_tokens if params.num_speculative_tokens is None else min(params.num_speculative_tokens,
                                                                               self.num_tokens)
        room = min(params.max_new_tokens - len(seq.output_ids), seq.max_len - seq.num_tokens) - 1
        return max(0, min(k, room))

    def record(self, drafted: int, accepted: int) -> None:
        """One sequence's verify: `drafted` draft tokens of which the first `accepted` were kept."""
        if drafted:
            self.drafts += 1
            self.draft_tokens += drafted
            self.accepted_tokens += accepted

    def stats(self) -> SpeculativeStats:
        return SpeculativeStats(draft_tokens_total=self.draft_tokens, accepted_tokens_total=self.accepted_tokens,
                                drafts_total=self.drafts)
