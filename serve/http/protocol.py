"""OpenAI API request bodies (pydantic) and error shapes.

Requests are strict about the types of the fields they know (a string where a number belongs is a
400 naming the field) and ignore fields they do not know, as OpenAI's API does. Fields jaxllm
cannot honour yet are refused with a 400 rather than silently ignored (see `unsupported`).
Log-probabilities: completions' `logprobs: k`, chat's `logprobs: true` with `top_logprobs: k`
(`logprobs_wanted` turns either into the engine's k and the field that named it). Penalties: OpenAI's
`frequency_penalty`, `presence_penalty` and `logit_bias` (token ids as strings), vLLM's `repetition_penalty`
(`penalties` turns them into the engine's). jaxllm's own extras: `top_k`, `ignore_eos` and
`num_speculative_tokens` (0: no speculative decoding for this request). The prompt, stop and content fields have validators of
their own, so a bad one is named down to the element at fault ("prompt[0]: 1.5 is not a token id").
Also vLLM's /tokenize and /detokenize bodies.
"""

from __future__ import annotations

import re
from typing import Literal

import pydantic
from pydantic import BaseModel, ConfigDict, field_validator
from pydantic_core import PydanticCustomError

_CONFIG = ConfigDict(extra="ignore", strict=True)
_UNION_TAG = re.compile(r"^(str|int|float|bool|none|list\[.*\]|dict\[.*\]|[A-Z]\w*)$")
_BAD = "jaxllm_bad_value"  # a validator's own error: `parse` writes its text as it is, after the field's path
_PROMPT_KINDS = "a string, a list of strings, a list of token ids or a list of lists of token ids"
_MIXED = "; a list prompt holds strings or token ids, not both"
_TOKEN_KEY = re.compile(r"-?[0-9]+")  # a logit_bias key (fullmatch: no sign "+", spaces or "_" as int() takes)


def shown(value) -> str:
    """A JSON value as a message shows it: its JSON name for null, booleans, arrays and objects."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return repr(value) if not isinstance(value, str) or len(value) <= 40 else repr(value[:40]) + "..."


def _bad(where: str, text: str) -> PydanticCustomError:
    """An error `parse` reports as "<field><where><text>", e.g. "prompt" "[0]" ": 1.5 is not a token id"."""
    return PydanticCustomError(_BAD, "{where}{text}", {"where": where, "text": text})


def _is_token_id(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_token_ids(ids: list, where: str) -> list[int]:
    for i, t in enumerate(ids):
        if not _is_token_id(t):
            mixed = _MIXED if isinstance(t, str) else ""
            raise _bad(f"{where}[{i}]", f": {shown(t)} is not a token id (an integer){mixed}")
    return ids


def _check_prompt(value) -> str | list[str] | list[int] | list[list[int]]:
    """OpenAI's prompt shapes, and for anything else the element at fault and what is wrong with it."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise _bad("", f": input should be {_PROMPT_KINDS} (got {shown(value)})")
    if not value:
        return value
    first = value[0]
    if isinstance(first, str):
        for i, p in enumerate(value):
            if not isinstance(p, str):
                raise _bad(f"[{i}]", f": {shown(p)} is not a string{_MIXED if _is_token_id(p) else ''}")
        return value
    if isinstance(first, list):
        for i, p in enumerate(value):
            if not isinstance(p, list):
                raise _bad(f"[{i}]", f": {shown(p)} is not a list of token ids, as prompt[0] is")
            _check_token_ids(p, f"[{i}]")
        return value
    return _check_token_ids(value, "")


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    _TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
              413: "invalid_request_error", 415: "invalid_request_error", 429: "rate_limit_error",
              500: "server_error", 503: "service_unavailable"}

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self._TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    model_config = _CONFIG
    include_usage: bool = False
    # vLLM's extension: usage (tokens so far) in every chunk, and a chunk for every engine step that
    # produced tokens, even when they decode to no text yet (load tests time tokens, not text).
    continuous_usage_stats: bool = False


class _Common(BaseModel):
    model_config = _CONFIG

    model: str
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    top_logprobs: int | None = None
    # null is the neutral value (0, 0, 1, no bias); vLLM's repetition_penalty beside OpenAI's three.
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # jaxllm's extras, and vLLM's prompt_logprobs (per prompt token: its logprob and the k most likely there).
    top_k: int = 0
    ignore_eos: bool = False
    prompt_logprobs: int | None = None
    # On a server with speculative decoding: the most draft tokens a step for this request (null: the server's
    # --num-speculative-tokens; 0: off for it). The output is the same either way.
    num_speculative_tokens: int | None = None

    @field_validator("stop", mode="plain")
    @classmethod
    def _stop(cls, value):
        if value is None or isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise _bad("", f": input should be a string or a list of strings (got {shown(value)})")
        for i, s in enumerate(value):
            if not isinstance(s, str):
                raise _bad(f"[{i}]", f" must be a string, got {shown(s)}")
        return value

    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def prompt_logprobs_wanted(self) -> int | None:
        """Top tokens per prompt token (vLLM's prompt_logprobs extra); None: none."""
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise APIError(400, f"prompt_logprobs must be >= 0, got {self.prompt_logprobs}", param="prompt_logprobs")
        return self.prompt_logprobs

    def penalties(self) -> dict:
        """The engine's penalty arguments (jaxllm.engine.requests.sampling_params); logit_bias keys must be token
        ids written in decimal."""
        bias = {}
        for key, value in (self.logit_bias or {}).items():
            if not _TOKEN_KEY.fullmatch(key):
                raise APIError(400, f"logit_bias: key {shown(key)} is not a token id (an integer)", param="logit_bias")
            bias[int(key)] = value
        return dict(frequency_penalty=0.0 if self.frequency_penalty is None else self.frequency_penalty,
                    presence_penalty=0.0 if self.presence_penalty is None else self.presence_penalty,
                    repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
                    logit_bias=bias)

    def output_limit(self) -> int | None:
        """max_completion_tokens (the newer name) or max_tokens; None: the server's default."""
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise APIError(400, f"max_tokens ({self.max_tokens}) and max_completion_tokens "
                                f"({self.max_completion_tokens}) disagree; send one of them", param="max_tokens")
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def unsupported(self) -> None:
        """Refuse what the engine cannot do yet, naming the field (one place to lift each limit): nothing common to
        both routes today (CompletionRequest refuses its own)."""


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt", mode="plain")
    @classmethod
    def _prompt(cls, value):
        return _check_prompt(value)

    def prompts(self) -> list[str | list[int]]:
        """Each prompt: text, or token ids (used as they are: no BOS is added)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [list(p)]
        return list(p)

    def logprobs_wanted(self) -> tuple[int | None, str]:
        """(top tokens per generated token, None for no logprobs; the field that asked)."""
        if self.top_logprobs is not None:
            raise APIError(400, "top_logprobs is a chat completions field; completions take logprobs: <int>",
                           param="top_logprobs")
        if self.logprobs is not None and self.logprobs < 0:
            raise APIError(400, f"logprobs must be >= 0, got {self.logprobs}", param="logprobs")
        return self.logprobs, "logprobs"

    def prompt_logprobs_wanted(self) -> int | None:
        """Top tokens per prompt token: echo with logprobs (OpenAI: the prompt's tokens get entries too, the first
        null), or vLLM's prompt_logprobs extra; None: none."""
        if self.echo and self.logprobs is not None:
            return max(self.logprobs, self.prompt_logprobs or 0)
        return super().prompt_logprobs_wanted()

    def unsupported(self) -> None:
        super().unsupported()
        if self.best_of not in (None, 1, self.n):
            raise APIError(400, "best_of is not supported yet (only equal to n)", param="best_of")
        if self.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")


class TextPart(BaseModel):
    model_config = _CONFIG
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = _CONFIG
    role: str
    content: str | list[TextPart] | None = None

    @field_validator("content", mode="plain")
    @classmethod
    def _content(cls, value):
        """A string, or content parts of which only text ones are supported: the part at fault is named."""
        if value is None or isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise _bad("", f": input should be a string or a list of text parts (got {shown(value)})")
        parts = []
        for i, part in enumerate(value):
            if not isinstance(part, dict):
                raise _bad(f"[{i}]", f": a content part is an object like {{\"type\": \"text\", \"text\": ...}}, "
                                     f"got {shown(part)}")
            kind = part.get("type")
            if kind != "text":
                raise _bad(f"[{i}]", f": content parts of type {shown(kind) if not isinstance(kind, str) else kind} "
                                     f"are not supported; only text")
            if not isinstance(part.get("text"), str):
                raise _bad(f"[{i}].text", f" must be a string, got {shown(part.get('text'))}")
            parts.append(TextPart(type="text", text=part["text"]))
        return parts

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(_Common):
    messages: list[Message]
    logprobs: bool | None = None

    def logprobs_wanted(self) -> tuple[int | None, str]:
        """(top tokens per generated token, None for no logprobs; the field that asked)."""
        if not self.logprobs:
            if self.top_logprobs is not None:
                raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
            return None, "logprobs"
        k = 0 if self.top_logprobs is None else self.top_logprobs
        if k < 0:
            raise APIError(400, f"top_logprobs must be >= 0, got {k}", param="top_logprobs")
        return k, "top_logprobs" if self.top_logprobs is not None else "logprobs"


# ----- vLLM's /tokenize and /detokenize (serve/http/tokenize.py answers them) -----

class TokenizeCompletionRequest(BaseModel):
    model_config = _CONFIG
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True  # BOS first, as generation encodes a text prompt
    return_token_strs: bool = False


class TokenizeChatRequest(BaseModel):
    model_config = _CONFIG
    model: str | None = None
    messages: list[Message]
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    # Accepted only at their defaults: jaxllm renders with the checkpoint's own template, whose BOS it keeps.
    add_special_tokens: bool = False
    continue_final_message: bool = False
    chat_template: str | None = None

    def unsupported(self) -> None:
        if self.add_special_tokens:
            raise APIError(400, "add_special_tokens: true is not supported with messages (the chat template's BOS "
                                "is kept, as chat completions keep it)", param="add_special_tokens")
        if self.continue_final_message:
            raise APIError(400, "continue_final_message is not supported", param="continue_final_message")
        if self.chat_template is not None:
            raise APIError(400, "chat_template is not supported: the checkpoint's own template is used",
                           param="chat_template")


class DetokenizeRequest(BaseModel):
    model_config = _CONFIG
    model: str | None = None
    tokens: list[int]


def parse(model: type[BaseModel], body: object) -> BaseModel:
    """Validate a decoded JSON body; a 400 naming the first bad field otherwise."""
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    try:
        return model.model_validate(body)
    except pydantic.ValidationError as e:
        first = e.errors()[0]
        param = ""
        for part in first["loc"]:
            if isinstance(part, int):
                param += f"[{part}]"
            elif not _UNION_TAG.match(part):  # unions name the branch tried (str, list[int]): not a field
                param += f".{part}" if param else part
        param = param or None
        if first["type"] == _BAD:  # a validator of ours said what is wrong, and where inside the field
            raise APIError(400, f"{param}{first['ctx']['where']}{first['ctx']['text']}", param=param) from None
        raise APIError(400, f"{param}: {first['msg'].lower()} (got {shown(first.get('input'))})"
                       if "missing" not in first["type"] else f"{param} is required", param=param) from None
