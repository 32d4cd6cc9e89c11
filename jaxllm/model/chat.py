"""Chat prompts: a checkpoint's own Jinja `chat_template`, rendered as transformers renders it, or
Llama-2's `[INST]` format when it has none. `LLM.chat` and the HTTP server both use `chat_prompt`.

transformers renders with a sandboxed Jinja environment (trim_blocks, lstrip_blocks, loop controls,
`raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII) and passes `messages`,
`bos_token`, `eos_token` and `add_generation_prompt`; so does this.
"""

from __future__ import annotations

import datetime
import functools
import json
from collections.abc import Mapping, Sequence

from jaxllm.model.tokenizer import check_unicode

# The roles each renderer takes: a checkpoint's template gets every role transformers passes on (the template
# itself may still refuse one, with its own raise_exception message); Llama-2's format has no tool turn.
TEMPLATE_ROLES = ("system", "user", "assistant", "tool")
LLAMA2_ROLES = ("system", "user", "assistant")
_B_INST, _E_INST = "[INST]", "[/INST]"
_B_SYS, _E_SYS = "<<SYS>>\n", "\n<</SYS>>\n\n"


class ChatError(ValueError):
    """Messages a chat template cannot render, or a template that fails."""


def check_messages(messages: Sequence[Mapping], roles: Sequence[str] = TEMPLATE_ROLES) -> list[dict]:
    """Messages as plain dicts; ChatError naming the message for a malformed one, a role outside `roles` (the
    renderer's: only roles it can render are listed) or content that is not valid text."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise ChatError(f"messages must be a non-empty list of {{'role', 'content'}} dicts, got {messages!r}")
    out = []
    for i, m in enumerate(messages):
        if isinstance(m, Mapping) and m.get("role") in TEMPLATE_ROLES and m.get("role") not in roles:
            raise ChatError(f"message {i} has role {m['role']!r}, which Llama-2's [INST] format (used where the "
                            f"checkpoint has no chat_template) cannot render; roles: {list(roles)}")
        if not isinstance(m, Mapping) or m.get("role") not in roles or not isinstance(m.get("content"), str):
            raise ChatError(f"message {i} must be a dict with role in {list(roles)} and string content, got {m!r}")
        try:
            check_unicode(m["content"], f"messages[{i}].content")
        except ValueError as e:
            raise ChatError(str(e)) from None
        out.append(dict(m))
    return out


@functools.lru_cache(maxsize=8)
def _compile(template: str):
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(template)
    except TemplateError as e:
        raise ChatError(f"chat_template does not parse: {e}") from e


def llama2_chat(messages: list[dict], *, bos_token: str = "<s>", eos_token: str = "</s>") -> str:
    """Llama-2-chat's format (Meta's reference `chat_completion`): an optional system prompt folded into
    the first user turn, `<s>[INST] user [/INST] answer </s>` per exchange, ending on the open user turn."""
    if messages[0]["role"] == "system":
        system, messages = messages[0]["content"], messages[1:]
        if not messages:
            raise ChatError("a system message must be followed by a user message")
        messages = [{"role": "user", "content": _B_SYS + system + _E_SYS + messages[0]["content"]}] + messages[1:]
    roles = [m["role"] for m in messages]
    if roles[::2] != ["user"] * len(roles[::2]) or roles[1::2] != ["assistant"] * len(roles[1::2]):
        raise ChatError(f"Llama-2 chat needs user and assistant turns alternating from the user's, got roles {roles}")
    if roles[-1] != "user":
        raise ChatError("the last message must be the user's")
    out = []
    for user, answer in zip(messages[::2], messages[1::2]):
        out.append(f"{bos_token}{_B_INST} {user['content'].strip()} {_E_INST} {answer['content'].strip()} {eos_token}")
    out.append(f"{bos_token}{_B_INST} {messages[-1]['content'].strip()} {_E_INST}")
    return "".join(out)


def render_chat(messages: Sequence[Mapping], *, template: str | None, bos_token: str = "<s>",
                eos_token: str = "</s>", add_generation_prompt: bool = True) -> str:
    """The prompt text of `messages` under `template` (Jinja, transformers' semantics), or under
    Llama-2's `[INST]` format when template is None."""
    messages = check_messages(messages, LLAMA2_ROLES if template is None else TEMPLATE_ROLES)
    if template is None:
        return llama2_chat(messages, bos_token=bos_token, eos_token=eos_token)
    from jinja2 import TemplateError

    try:
        return _compile(template).render(messages=messages, bos_token=bos_token, eos_token=eos_token,
                                         add_generation_prompt=add_generation_prompt)
    except TemplateError as e:
        raise ChatError(f"chat_template failed on these messages: {e}") from e


def chat_prompt(tokenizer, messages: Sequence[Mapping], *, add_generation_prompt: bool = True) -> str:
    """The text to give `generate` for `messages` under the tokenizer's chat template (or Llama-2's).

    A leading BOS the template writes is cut off: encode adds the BOS id itself, and a second one
    would change the model's input.
    """
    text = render_chat(messages, template=tokenizer.chat_template, bos_token=tokenizer.bos_token,
                       eos_token=tokenizer.eos_token, add_generation_prompt=add_generation_prompt)
    if tokenizer.bos_token and text.startswith(tokenizer.bos_token):
        text = text[len(tokenizer.bos_token):]
    return text
