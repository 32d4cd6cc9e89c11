"""`ReplayProposer`: a benchmark's and a test's draft source, proposing the tokens a plain run produced.

Told what a plain greedy run generated after a prompt (`expect`), it drafts exactly those tokens, so under greedy
decoding every draft is accepted at no draft cost: the mechanism's ceiling (scripts/bench_speculative.py), and in
tests a way to put a stop string or an EOS inside an accepted run. A sequence whose output has left the expected
tokens (sampling, another prompt) gets no draft. Not a serving option: EngineOptions names no replay.
"""

from __future__ import annotations

from jaxllm.engine.sequence import Sequence

__all__ = ["ReplayProposer"]


class ReplayProposer:
    """The Proposer (jaxllm.engine.speculative.proposer) of tokens known beforehand, by prompt."""

    name = "replay"

    def __init__(self):
        self._expected: dict[tuple[int, ...], list[int]] = {}

    def expect(self, prompt_ids, output_ids) -> None:
        """What follows `prompt_ids` (a plain run's output ids): drafted from now on for sequences of that prompt."""
        self._expected[tuple(int(t) for t in prompt_ids)] = [int(t) for t in output_ids]

    def propose(self, requests: list[tuple[Sequence, int]]) -> list[list[int]]:
        drafts = []
        for seq, k in requests:
            expected = self._expected.get(tuple(seq.prompt_ids))
            done = len(seq.output_ids)
            on_track = expected is not None and expected[:done] == seq.output_ids
            drafts.append(expected[done:done + k] if on_track else [])
        return drafts

    def forget(self, seq_id: int) -> None:
        pass  # it keeps nothing per sequence
