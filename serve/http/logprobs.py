"""Per-token log-probabilities in OpenAI's two shapes (the legacy completions one and the chat one), and
vLLM's prompt_logprobs.

The engine gives, per generated token id, `(its logprob, ((id, logprob), ...))` with the k most likely
tokens first (jaxllm.engine.core.RequestOutput.logprobs), and per prompt token the same, None for the
first (RequestOutput.prompt_logprobs); a token's text is the tokenizer's decode of that one id (`text_of`),
its bytes that text in UTF-8.
"""

from __future__ import annotations

from typing import Callable, Sequence

Entry = tuple[float, tuple[tuple[int, float], ...]]


def completion_logprobs(token_ids: Sequence[int], entries: Sequence[Entry | None], text_of: Callable[[int], str],
                        offset: int) -> tuple[dict, int]:
    """choices[i].logprobs of /v1/completions for these tokens, and the text offset after them.

    {tokens: [text], token_logprobs: [logprob], top_logprobs: [{text: logprob}], text_offset: [int]};
    offset: characters of the choice's text before the first of these tokens (a stream goes on from
    where its previous chunk ended). An entry None (an echoed prompt's first token: nothing precedes it)
    gives null logprob and top_logprobs, as OpenAI and vLLM answer.
    """
    tokens = [text_of(t) for t in token_ids]
    offsets = []
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": [None if e is None else e[0] for e in entries],
            "top_logprobs": [None if e is None else top_by_text(e[1], text_of) for e in entries],
            "text_offset": offsets}, offset


def prompt_logprobs(prompt_ids: Sequence[int], entries: Sequence[Entry | None], text_of: Callable[[int], str]
                    ) -> list[dict | None]:
    """vLLM's choices[i].prompt_logprobs: per prompt token, null for the first, else {id: {logprob, rank,
    decoded_token}} for the prompt token and the k most likely there (ids as strings, JSON's keys; rank is
    the place among those k, given where known)."""
    out: list[dict | None] = []
    for token, entry in zip(prompt_ids, entries):
        if entry is None:
            out.append(None)
            continue
        logprob, top = entry
        places = {t: rank for rank, (t, _) in enumerate(top, start=1)}
        item = {str(token): {"logprob": logprob, "rank": places.get(token), "decoded_token": text_of(token)}}
        for t, v in top:
            item.setdefault(str(t), {"logprob": v, "rank": places[t], "decoded_token": text_of(t)})
        out.append(item)
    return out


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
