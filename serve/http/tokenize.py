"""vLLM's `POST /tokenize` and `POST /detokenize`, in its request and response shapes.

    /tokenize   {"prompt": "...", "add_special_tokens": true, "return_token_strs": false}
             or {"messages": [...], "add_generation_prompt": true}
             -> {"count": N, "max_model_len": L, "tokens": [...], "token_strs": null | [...]}
    /detokenize {"tokens": [...]} -> {"prompt": "..."}

`model` is optional (when given it must be the served one). Chat messages are rendered and encoded
exactly as /v1/chat/completions renders and encodes them, so `count` is that request's prompt_tokens.
Both directions are capped at the context limit (`max_model_len`, what /v1/models states): more ids
than one sequence can hold are refused with a 400 naming the count and the limit, so a large text
cannot make a response of millions of ids (the request body is capped by --max-message-bytes).
"""

from __future__ import annotations

from serve.http.engine_adapter import EngineAdapter
from serve.http.protocol import APIError, DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest, parse


def _check_model(adapter: EngineAdapter, model: str | None) -> None:
    if model is not None and model != adapter.model_name:
        raise APIError(404, f"the model {model!r} does not exist; this server serves {adapter.model_name!r}",
                       param="model", code="model_not_found")


def tokenize(adapter: EngineAdapter, body: object) -> dict:
    """A /tokenize body -> vLLM's TokenizeResponse."""
    chat = isinstance(body, dict) and "messages" in body
    req = parse(TokenizeChatRequest if chat else TokenizeCompletionRequest, body)
    _check_model(adapter, req.model)
    try:
        if chat:
            req.unsupported()
            text = adapter.chat_prompt([{"role": m.role, "content": m.text()} for m in req.messages],
                                       add_generation_prompt=req.add_generation_prompt)
            ids = adapter.tokenize(text)
        else:
            ids = adapter.tokenize(req.prompt, add_bos=req.add_special_tokens)
    except ValueError as e:
        raise APIError(400, str(e), param="messages" if chat else "prompt") from None
    return {"count": len(ids), "max_model_len": adapter.context_limit, "tokens": ids,
            "token_strs": [adapter.token_text(t) for t in ids] if req.return_token_strs else None}


def detokenize(adapter: EngineAdapter, body: object) -> dict:
    """A /detokenize body -> vLLM's DetokenizeResponse."""
    req = parse(DetokenizeRequest, body)
    _check_model(adapter, req.model)
    try:
        return {"prompt": adapter.detokenize(req.tokens)}
    except ValueError as e:
        raise APIError(400, str(e), param="tokens") from None
