"""GenerateRequest -> (prompt token ids, SamplingParams): a thin adapter over jaxllm.engine.requests.

The rules and their messages live in `jaxllm.engine.requests`, shared with the Python API and
the HTTP server, so every front end accepts and refuses the same requests. A bad request raises
ValueError (the servicer answers INVALID_ARGUMENT) before it costs a queue slot. An unset seed is a
fresh random one (`random_seed`, the HTTP API's rule): only a given seed reproduces tokens.
"""

from __future__ import annotations

from jaxllm.engine.requests import RequestLimits, prompt_token_ids, random_seed, sampling_params
from jaxllm.contract import SamplingParams

__all__ = ["to_engine_request", "token_logprobs"]


def to_engine_request(request, tokenizer, limits: RequestLimits) -> tuple[list[int], SamplingParams]:
    """Validate a GenerateRequest against the engine's limits (`Engine.limits`); raises ValueError
    (-> INVALID_ARGUMENT) naming the field and the limit."""
    has_text, has_ids = bool(request.prompt), len(request.prompt_token_ids) > 0
    if has_text and has_ids:
        raise ValueError("prompt and prompt_token_ids are both set; send exactly one of them")
    if not has_text and not has_ids:
        raise ValueError("prompt is empty: set prompt (text) or prompt_token_ids")
    if has_text:
        ids = prompt_token_ids(request.prompt, tokenizer, limits, "prompt")
    else:
        ids = prompt_token_ids(list(request.prompt_token_ids), tokenizer, limits, "prompt_token_ids")
    params = sampling_params(
        limits, len(ids), max_tokens=request.max_tokens if request.HasField("max_tokens") else None,
        temperature=float(request.temperature), top_k=int(request.top_k),
        top_p=float(request.top_p) if request.HasField("top_p") else 1.0,
        seed=int(request.seed) if request.HasField("seed") else random_seed(),
        stop=tuple(request.stop), ignore_eos=bool(request.ignore_eos),
        frequency_penalty=float(request.frequency_penalty), presence_penalty=float(request.presence_penalty),
        repetition_penalty=float(request.repetition_penalty) if request.HasField("repetition_penalty") else 1.0,
        logit_bias={int(token): float(bias) for token, bias in request.logit_bias.items()},
        logprobs=int(request.logprobs) if request.HasField("logprobs") else None,
        prompt_logprobs=int(request.prompt_logprobs) if request.HasField("prompt_logprobs") else None,
        num_speculative_tokens=(int(request.num_speculative_tokens) if request.HasField("num_speculative_tokens")
                                else None))
    return ids, params


def token_logprobs(entries) -> list:
    """The engine's `(logprob, ((id, logprob), ...))` entries (None for the prompt's first token) with the
    token ids they belong to -> TokenLogprob messages' fields, as dicts for pb.TokenLogprob(**fields)."""
    out = []
    for token_id, entry in entries:
        fields = {"token_id": int(token_id)}
        if entry is not None:
            logprob, top = entry
            fields["logprob"] = float(logprob)
            fields["top"] = [{"token_id": int(t), "logprob": float(lp)} for t, lp in top]
        out.append(fields)
    return out
