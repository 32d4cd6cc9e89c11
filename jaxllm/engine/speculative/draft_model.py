"""`DraftModelProposer`: drafts from a small model with the target's tokenizer, run by an engine of its own.

The draft model runs in a second EngineCore (built by jaxllm.builder from EngineOptions.speculative_model: its own
model, KV pool and compiled steps, on the first device of the target's mesh). Each proposal is one greedy request
per speculating sequence, all in one batch: the sequence's tokens as its prompt, k new tokens. The draft keeps no
state per target sequence: its prefix cache holds the KV of the full rBlocks it computed last time, so a
proposal prefills only the tokens since the last full rBlock (what the target accepted, the token it drew, the
partial rBlock's tokens) and decodes k - 1 steps. The cache finds an rBlock by its tokens, so one that holds a
rejected draft is found only by a prompt holding those very tokens, where its KV is right. Drafting is greedy (the draft's
argmax, a point mass: what the verify step's rejection sampling assumes).
"""

from __future__ import annotations

from typing import Protocol

from jaxllm.contract import SamplingParams
from jaxllm.engine.core import Request, RequestOutput
from jaxllm.engine.requests import RequestLimits
from jaxllm.engine.sequence import Sequence

__all__ = ["DraftCore", "DraftModelProposer"]


class DraftCore(Protocol):
    """What the proposer drives: an EngineCore (jaxllm.engine.core) of the draft model."""

    limits: RequestLimits  # what a request may be: the proposer's are built within them (Request.checked)

    def add(self, request: Request) -> int: ...

    def step(self, run_ahead: bool = True) -> list[RequestOutput]: ...

    def has_step_in_flight(self) -> bool: ...

    def drain(self) -> list[RequestOutput]: ...

    def cancel(self, request_id: int) -> RequestOutput | None: ...


class DraftModelProposer:
    """The Proposer (jaxllm.engine.speculative.proposer) of a draft model's greedy tokens."""

    name = "draft-model"

    def __init__(self, core: DraftCore, *, vocab_size: int):
        """core: the draft model's engine; vocab_size: the target's (a draft id at or past it ends the draft: a
        draft vocabulary may be padded wider than the target's)."""
        self.core = core
        self.vocab_size = vocab_size

    def propose(self, requests: list[tuple[Sequence, int]]) -> list[list[int]]:
        limits = self.core.limits
        rows: dict[int, int] = {}  # the draft's request id -> the row it drafts for
        for row, (seq, k) in enumerate(requests):
            tokens = (*seq.prompt_ids, *seq.output_ids)
            k = min(k, limits.room(len(tokens)))
            if k < 1 or not tokens:
                continue
            # Token ids the target accepted are in the shared vocabulary and within the draft's context (the
            # target's max_context), so the core's check (O(tokens) a proposal) is skipped: `checked`.
            params = SamplingParams(max_new_tokens=k, temperature=0.0, ignore_eos=True)
            rows[self.core.add(Request(tokens, params, checked=limits))] = row
        drafts: list[list[int]] = [[] for _ in requests]
        pending = set(rows)
        try:
            while pending:
                for out in self.core.step():
                    if out.request_id in rows:
                        drafts[rows[out.request_id]].extend(out.token_ids)
                        if out.finish_reason is not None:
                            pending.discard(out.request_id)
            if self.core.has_step_in_flight():
                self.core.drain()  # a step past our requests' ends: nothing of theirs in it
        except BaseException:
            for request_id in pending:
                self.core.cancel(request_id)
            raise
        return [self._within_vocab(d[:k]) for d, (_, k) in zip(drafts, requests)]

    def _within_vocab(self, draft: list[int]) -> list[int]:
        for i, token in enumerate(draft):
            if token >= self.vocab_size:
                return draft[:i]
        return draft

    def forget(self, seq_id: int) -> None:
        pass  # nothing is kept per sequence (the draft's prefix cache forgets by itself)
