"""Output processing of one request: token ids -> text, stop strings, streamed deltas, timings.

Every front end (the synchronous `LLM`, the threaded `Engine`, gRPC, HTTP) gets its text from
here, so stop strings are matched in one place and TTFT/TPOT are recorded once.
"""

from __future__ import annotations

import dataclasses

from jaxllm.model.tokenizer import StreamDecoder


@dataclasses.dataclass(frozen=True)
class RequestTimings:
    """Per-request latencies (seconds); None until there is something to measure."""

    ttft_s: float | None = None  # arrival to the first generated token
    tpot_s: float | None = None  # mean time per output token after the first


class TextStream:
    """Incremental text of one request, with stop-string matching and a streaming hold-back.

    `push(token_id)` adds a token's text and truncates at the first stop string, even one that
    spans token boundaries; `take(final)` returns the text not yet handed out, holding back the
    longest tail that is still a prefix of some stop string (it may yet complete one and must then
    never have been shown).
    """

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.decoder = StreamDecoder(tokenizer)
        self.stop = tuple(stop)
        self.longest_stop = max((len(s) for s in self.stop), default=0)
        self.text = ""
        self.emitted = 0  # characters already handed out by take()
        self.stopped = False
        self.finished = False

    def push(self, token_id: int) -> None:
        """Add one generated token; sets `stopped` (and cuts the text) when a stop string completes."""
        if self.stopped or self.finished:
            return
        before = len(self.text)
        self.text += self.decoder.push(token_id)
        if self.stop and len(self.text) > before:
            # A match ending in the new text may start up to len(s) - 1 characters before it.
            window_start = max(0, before - self.longest_stop + 1)
            hits = [i for i in (self.text.find(s, window_start) for s in self.stop) if i >= 0]
            if hits:
                self.text = self.text[:min(hits)]
                self.stopped = True

    def finish(self) -> None:
        """No more tokens: flush the decoder's partial characters (unless a stop string ended the text)."""
        if not (self.stopped or self.finished):
            self.text += self.decoder.flush()
        self.finished = True

    def held_back(self) -> int:
        """Characters at the end of the text that could still grow into a stop string."""
        if self.stopped or self.finished:
            return 0
        text = self.text
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best

    def take(self, final: bool = False) -> str:
        """Text not yet handed out; with final (after finish()), all of it."""
        end = len(self.text) if final else len(self.text) - self.held_back()
        end = max(end, self.emitted)
        piece = self.text[self.emitted:end]
        self.emitted = end
        return piece


class RequestClock:
    """When a request arrived and produced tokens; yields its RequestTimings."""

    def __init__(self, arrival: float):
        self.arrival = arrival
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.tokens = 0

    def tokens_at(self, now: float, count: int) -> None:
        if count <= 0:
            return
        if self.first_token_at is None:
            self.first_token_at = now
        self.last_token_at = now
        self.tokens += count

    def timings(self) -> RequestTimings:
        if self.first_token_at is None:
            return RequestTimings()
        ttft = self.first_token_at - self.arrival
        tpot = None
        if self.tokens > 1:
            tpot = (self.last_token_at - self.first_token_at) / (self.tokens - 1)
        return RequestTimings(ttft_s=ttft, tpot_s=tpot)
