"""Request limits and checks, in one place for every front end (LLM, threaded Engine, gRPC, HTTP).

The rules, the same everywhere:
- a prompt (text or token ids) is not empty, its ids lie in the vocabulary, and it has at most
  `context_limit - 1` tokens, so at least one new token fits;
- `max_tokens` may be at most the room left (`context_limit - prompt tokens`); more is refused
  with a ValueError naming the room, never capped silently; unset, it is the default capped at
  the room;
- stop strings: at most `max_stop_strings` of them, each non-empty and at most `max_stop_length`
  characters; `stop=""` and `stop=[""]` are the same empty stop string and both refused;
- logprobs and prompt_logprobs: at most `max_logprobs` top tokens per token (0: the engine returns none,
  and any request for them is refused); with prompt_logprobs, max_tokens may be 0 (score the prompt only);
- frequency_penalty and presence_penalty in [-2, 2], repetition_penalty > 0, logit_bias values in [-100, 100]
  (SamplingParams), logit_bias token ids in the vocabulary and at most `max_logit_bias` of them; an engine
  started without penalties (`penalties` False) refuses all four;
- text (a prompt, each stop string) is valid Unicode: a lone surrogate is refused naming the field
  (`check_unicode`; chat contents follow the same rule in jaxllm.model.chat);
- num_speculative_tokens: at most the engine's k (`max_speculative_tokens`; 0: the engine does not speculate,
  and a request asking for draft tokens is refused); 0 turns speculation off for the request;
- a server request without a seed gets a fresh random one (`random_seed`); a given seed reproduces.
Every check raises ValueError naming the value and the limit (servers answer INVALID_ARGUMENT / 400).
"""

from __future__ import annotations

import dataclasses
import numbers
import secrets
from typing import Sequence

from jaxllm.contract import SEED_LIMIT, SamplingParams
from jaxllm.model.tokenizer import check_unicode


@dataclasses.dataclass(frozen=True)
class RequestLimits:
    """What one request may ask for; the context limit comes from the loaded model and its KV pool."""

    context_limit: int  # prompt + generated tokens of one sequence
    vocab_size: int
    default_max_tokens: int = 256  # max_tokens of a request that sets none (capped at the room left)
    max_stop_strings: int = 16
    max_stop_length: int = 256  # characters per stop string
    max_logprobs: int = 0  # top tokens a request may ask log-probabilities of (0: logprobs are off)
    penalties: bool = True  # frequency / presence / repetition penalties and logit_bias are served
    max_logit_bias: int = 64  # logit_bias entries one request may give
    max_speculative_tokens: int = 0  # draft tokens a step a request may ask for (0: the engine does not speculate)

    def __post_init__(self):
        for name in ("max_logprobs", "max_logit_bias", "max_speculative_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        for name in ("context_limit", "vocab_size", "default_max_tokens", "max_stop_strings", "max_stop_length"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.context_limit < 2:
            raise ValueError(f"context_limit must be at least 2 (one prompt token and one new), got {self.context_limit}")

    @property
    def max_prompt_tokens(self) -> int:
        """The longest prompt accepted: one new token must still fit."""
        return self.context_limit - 1

    def room(self, num_prompt_tokens: int) -> int:
        """The most new tokens a prompt of this length may ask for."""
        return self.context_limit - num_prompt_tokens


def check_token_ids(ids: Sequence[int], limits: RequestLimits, what: str = "prompt", *,
                    max_tokens: int | None = None) -> list[int]:
    """Token ids a caller passed, as a list: not empty, in the vocabulary, and at most max_tokens long
    (default limits.max_prompt_tokens)."""
    ids = list(ids)
    if not ids:
        raise ValueError(f"{what} is empty")
    if all(type(t) is int for t in ids) and 0 <= min(ids) and max(ids) < limits.vocab_size:
        return check_length(ids, limits, what, max_tokens=max_tokens)  # the common case at C speed (128K ids: ms)
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, numbers.Integral) or not 0 <= t < limits.vocab_size:
            raise ValueError(f"{what}[{i}]: token id {t!r} is outside the vocabulary [0, {limits.vocab_size})")
    return check_length([int(t) for t in ids], limits, what, max_tokens=max_tokens)


def check_length(ids: list[int], limits: RequestLimits, what: str = "prompt", *,
                 max_tokens: int | None = None) -> list[int]:
    """ids, if there are at most max_tokens of them (default limits.max_prompt_tokens)."""
    if max_tokens is None:
        if len(ids) > limits.max_prompt_tokens:
            raise ValueError(f"{what} has {len(ids)} tokens, more than the context limit {limits.context_limit} allows: "
                             f"a prompt may have at most {limits.max_prompt_tokens}, so that one new token fits")
    elif len(ids) > max_tokens:
        raise ValueError(f"{what} has {len(ids)} tokens, more than the context limit {limits.context_limit} allows "
                         f"(at most {max_tokens})")
    return ids


def prompt_token_ids(prompt: str | Sequence[int], tokenizer, limits: RequestLimits, what: str = "prompt") -> list[int]:
    """A prompt's token ids (text is encoded with BOS first), checked against the limits."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError(f"{what} is empty")
        return check_length(tokenizer.encode(check_unicode(prompt, what)), limits, what)
    if isinstance(prompt, (bytes, dict)) or not isinstance(prompt, Sequence):
        raise TypeError(f"{what} must be a string or a list of token ids, got {type(prompt).__name__}")
    return check_token_ids(prompt, limits, what)


def normalize_stop(stop: str | Sequence[str] | None) -> tuple[str, ...]:
    """stop as a tuple: None -> (), "x" -> ("x",); "" is kept (and refused by check_params), never dropped."""
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    try:
        return tuple(stop)
    except TypeError:
        raise ValueError(f"stop must be a string or a list of strings, got {stop!r}") from None


def check_params(params: SamplingParams, num_prompt_tokens: int, limits: RequestLimits, *,
                 max_tokens_name: str = "max_tokens", logprobs_name: str = "logprobs") -> SamplingParams:
    """params, if they fit the limits for a prompt of num_prompt_tokens (max_tokens, stop strings, logprobs).

    max_tokens_name, logprobs_name: what the caller calls params.max_new_tokens and params.logprobs
    (OpenAI chat: top_logprobs), for the messages.
    """
    room = limits.room(num_prompt_tokens)
    if params.max_new_tokens > room:
        raise ValueError(f"{max_tokens_name} {params.max_new_tokens} is over the limit {room}: the context limit "
                         f"{limits.context_limit} minus the prompt's {num_prompt_tokens} tokens")
    check_stop(params.stop, limits)
    check_logprobs(params.logprobs, limits, logprobs_name)
    check_logprobs(params.prompt_logprobs, limits, "prompt_logprobs")
    check_penalties(params, limits)
    check_speculative(params.num_speculative_tokens, limits)
    return params


def check_speculative(k: int | None, limits: RequestLimits) -> int | None:
    """k (SamplingParams.num_speculative_tokens), if None, 0 or within limits.max_speculative_tokens."""
    if not k or k <= limits.max_speculative_tokens:
        return k
    if limits.max_speculative_tokens == 0:
        raise ValueError(f"num_speculative_tokens {k} is not served: this engine was started without speculative "
                         "decoding (EngineOptions.speculative or speculative_model; --speculative ngram:K or "
                         "--speculative-model M)")
    raise ValueError(f"num_speculative_tokens {k} is over the limit {limits.max_speculative_tokens} (the engine's "
                     "number of speculative tokens)")


def check_penalties(params: SamplingParams, limits: RequestLimits) -> SamplingParams:
    """params, if the engine serves their penalties and logit bias (SamplingParams checked the ranges)."""
    if not limits.penalties:
        for name, off in (("frequency_penalty", 0.0), ("presence_penalty", 0.0), ("repetition_penalty", 1.0)):
            if getattr(params, name) != off:
                raise ValueError(f"{name} {getattr(params, name):g} is not served: this engine was started without "
                                 f"penalties (EngineOptions.penalties False, --no-penalties)")
        if params.logit_bias:
            raise ValueError("logit_bias is not served: this engine was started without penalties "
                             "(EngineOptions.penalties False, --no-penalties)")
    if len(params.logit_bias) > limits.max_logit_bias:
        raise ValueError(f"logit_bias has {len(params.logit_bias)} entries, over the limit {limits.max_logit_bias}")
    for token, _ in params.logit_bias:
        if token >= limits.vocab_size:
            raise ValueError(f"logit_bias: token id {token} is outside the vocabulary [0, {limits.vocab_size})")
    return params


def check_logprobs(logprobs: int | None, limits: RequestLimits, name: str = "logprobs") -> int | None:
    """logprobs, if None or within limits.max_logprobs."""
    if logprobs is None:
        return None
    if limits.max_logprobs == 0:
        raise ValueError(f"{name} {logprobs} is over the limit 0: this engine returns no log-probabilities "
                         f"(start it with max_logprobs > 0)")
    if logprobs > limits.max_logprobs:
        raise ValueError(f"{name} {logprobs} is over the limit {limits.max_logprobs}")
    return logprobs


def check_stop(stop: tuple[str, ...], limits: RequestLimits) -> tuple[str, ...]:
    """stop, if within the count and length limits and none is empty."""
    if len(stop) > limits.max_stop_strings:
        raise ValueError(f"stop has {len(stop)} strings, over the limit {limits.max_stop_strings}")
    for i, s in enumerate(stop):
        if not isinstance(s, str):
            raise ValueError(f"stop[{i}] is not a string: {s!r}")
        if not s:
            raise ValueError(f"stop[{i}] is empty; stop strings must be non-empty")
        check_unicode(s, f"stop[{i}]")
        if len(s) > limits.max_stop_length:
            raise ValueError(f"stop[{i}] has {len(s)} characters, over the limit {limits.max_stop_length}")
    return stop


def random_seed() -> int:
    """A fresh seed in [0, SEED_LIMIT) for a server request that gave none (gRPC and HTTP alike): requests
    without a seed differ from each other, and one with a seed reproduces."""
    return secrets.randbelow(SEED_LIMIT)


def sampling_params(limits: RequestLimits, num_prompt_tokens: int, *, max_tokens: int | None = None,
                    temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
                    stop: str | Sequence[str] | None = None, stop_token_ids: Sequence[int] | None = None,
                    ignore_eos: bool = False, logprobs: int | None = None, prompt_logprobs: int | None = None,
                    frequency_penalty: float = 0.0, presence_penalty: float = 0.0, repetition_penalty: float = 1.0,
                    logit_bias=None, num_speculative_tokens: int | None = None, max_tokens_name: str = "max_tokens",
                    logprobs_name: str = "logprobs") -> SamplingParams:
    """Build and check one request's SamplingParams; max_tokens None means the default, capped at the room.

    max_tokens_name, logprobs_name: what the caller calls max_tokens (LLM.generate: max_new_tokens) and
    logprobs (OpenAI chat: top_logprobs), for messages.
    """
    if max_tokens is None:
        max_tokens = min(limits.default_max_tokens, limits.room(num_prompt_tokens))
    elif isinstance(max_tokens, bool) or not isinstance(max_tokens, numbers.Integral) or max_tokens < 1:
        if not (max_tokens == 0 and prompt_logprobs is not None and not isinstance(max_tokens, bool)):
            raise ValueError(f"{max_tokens_name} must be >= 1, got {max_tokens!r} (0 only scores a prompt, with "
                             "prompt_logprobs)")
    # Stop strings before SamplingParams: the count limit comes first, and each message names the index.
    stop = check_stop(normalize_stop(stop), limits)
    params = SamplingParams(max_new_tokens=int(max_tokens), temperature=temperature, top_k=top_k, top_p=top_p,
                            seed=seed, stop=stop, stop_token_ids=stop_token_ids, ignore_eos=ignore_eos,
                            logprobs=logprobs, prompt_logprobs=prompt_logprobs, frequency_penalty=frequency_penalty,
                            presence_penalty=presence_penalty, repetition_penalty=repetition_penalty,
                            logit_bias=logit_bias, num_speculative_tokens=num_speculative_tokens)
    return check_params(params, num_prompt_tokens, limits, max_tokens_name=max_tokens_name,
                        logprobs_name=logprobs_name)
