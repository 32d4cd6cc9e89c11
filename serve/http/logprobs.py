"""Per-token log-probabilities in OpenAI's two shapes: the legacy completions one and the chat one.

The engine gives, per generated token id, `(its logprob, ((id, logprob), ...))` with the k most likely
tokens first (jaxllm.engine.core.RequestOutput.logprobs); a token's text is the tokenizer's decode of
that one id (`text_of`), its bytes that text in UTF-8.
"""

from __future__ import annotations

from typing import Callable, Sequence

Entry = tuple[float, tuple[tuple[int, float], ...]]


def completion_logprobs(token_ids: Sequence[int], entries: Sequence[Entry], text_of: Callable[[int], str],
                        offset: int) -> tuple[dict, int]:
    """choices[i].logprobs of /v1/completions for these tokens, and the text offset after them.

    {tokens: [text], token_logprobs: [logprob], top_logprobs: [{text: logprob}], text_offset: [int]};
    offset: characters of the choice's text before the first of these tokens (a stream goes on from
    where its previous chunk ended).
    """
    tokens = [text_of(t) for t in token_ids]
    offsets = []
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": [logprob for logprob, _ in entries],
            "top_logprobs": [top_by_text(top, text_of) for _, top in entries], "text_offset": offsets}, offset


def top_by_text(top: Sequence[tuple[int, float]], text_of: Callable[[int], str]) -> dict[str, float]:
    """The legacy {text: logprob} of one token's alternatives. Two ids can decode to the same text
    (byte tokens of one character both show as U+FFFD): the text keeps the likelier one's logprob."""
    out: dict[str, float] = {}
    for i, v in top:
        out.setdefault(text_of(i), v)
    return out


def chat_logprobs(token_ids: Sequence[int], entries: Sequence[Entry], text_of: Callable[[int], str]) -> dict:
    """choices[i].logprobs of /v1/chat/completions: {content: [{token, logprob, bytes, top_logprobs:
    [{token, logprob, bytes}]}]}."""

    def item(token: int, logprob: float) -> dict:
        text = text_of(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**item(t, logprob), "top_logprobs": [item(i, v) for i, v in top]}
                        for t, (logprob, top) in zip(token_ids, entries)]}
