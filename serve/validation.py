"""GenerateRequest -> (prompt token ids, SamplingParams), or a ValueError naming the field and the limit.

Every check a client can fail happens here, before the request reaches the engine, so a bad
request costs no queue slot and the server answers INVALID_ARGUMENT with a message that says
which field is wrong and what it may be.
"""

from __future__ import annotations

import dataclasses
import math

from jaxllm.engine.sampling import SamplingParams

SEED_LIMIT = 2**31


@dataclasses.dataclass(frozen=True)
class RequestLimits:
    """What one request may ask for; the context limit comes from the loaded model and its KV pool."""

    context_limit: int  # prompt + output tokens
    vocab_size: int
    default_max_tokens: int = 256
    max_stop_strings: int = 16
    max_stop_length: int = 256  # characters per stop string

    def __post_init__(self):
        for name in ("context_limit", "vocab_size", "default_max_tokens", "max_stop_strings", "max_stop_length"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")


def prompt_ids(request, tokenizer, limits: RequestLimits) -> list[int]:
    """The prompt's token ids (BOS first for text, as LLM.generate encodes), checked against the limits."""
    has_text, has_ids = bool(request.prompt), len(request.prompt_token_ids) > 0
    if has_text and has_ids:
        raise ValueError("prompt and prompt_token_ids are both set; send exactly one of them")
    if not has_text and not has_ids:
        raise ValueError("prompt is empty: set prompt (text) or prompt_token_ids")
    ids = tokenizer.encode(request.prompt) if has_text else list(request.prompt_token_ids)
    # At least one new token must fit, so the prompt may use at most context_limit - 1 positions.
    if len(ids) >= limits.context_limit:
        raise ValueError(f"prompt has {len(ids)} tokens; the context limit is {limits.context_limit} tokens "
                         f"(prompt + max_tokens), so a prompt may have at most {limits.context_limit - 1}")
    if has_ids:
        for i, t in enumerate(ids):
            if not 0 <= t < limits.vocab_size:
                raise ValueError(f"prompt_token_ids[{i}] = {t} is outside the vocabulary [0, {limits.vocab_size})")
    return ids


def sampling_params(request, num_prompt_tokens: int, limits: RequestLimits) -> SamplingParams:
    """The request's SamplingParams; max_tokens defaults to the server's default, capped at the room left."""
    room = limits.context_limit - num_prompt_tokens
    if request.HasField("max_tokens"):
        max_tokens = request.max_tokens
        if max_tokens <= 0:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        if max_tokens > room:
            raise ValueError(f"max_tokens {max_tokens} is over the limit {room}: the context limit "
                             f"{limits.context_limit} minus the prompt's {num_prompt_tokens} tokens")
    else:
        max_tokens = min(limits.default_max_tokens, room)
    temperature = request.temperature
    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    top_p = request.top_p if request.HasField("top_p") else 1.0
    if not (0.0 < top_p <= 1.0):  # also false for NaN
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    if request.top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 disables it), got {request.top_k}")
    if not 0 <= request.seed < SEED_LIMIT:
        raise ValueError(f"seed must be in [0, 2**31), got {request.seed}")
    stop = tuple(request.stop)
    if len(stop) > limits.max_stop_strings:
        raise ValueError(f"stop has {len(stop)} strings, over the limit {limits.max_stop_strings}")
    for i, s in enumerate(stop):
        if not s:
            raise ValueError(f"stop[{i}] is empty; stop strings must be non-empty")
        if len(s) > limits.max_stop_length:
            raise ValueError(f"stop[{i}] has {len(s)} characters, over the limit {limits.max_stop_length}")
    # SamplingParams re-checks everything; its ValueErrors name the field too.
    return SamplingParams(max_new_tokens=max_tokens, temperature=float(temperature), top_k=int(request.top_k),
                          top_p=float(top_p), seed=int(request.seed), stop=stop, ignore_eos=bool(request.ignore_eos))


def to_engine_request(request, tokenizer, limits: RequestLimits) -> tuple[list[int], SamplingParams]:
    """Validate a GenerateRequest; raises ValueError (-> INVALID_ARGUMENT) naming the field and the limit."""
    ids = prompt_ids(request, tokenizer, limits)
    return ids, sampling_params(request, len(ids), limits)
