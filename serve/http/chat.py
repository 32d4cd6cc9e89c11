"""Chat messages -> one prompt string, in Llama-2's `[INST]` format.

A stand-in until `jaxllm.model.chat.render_chat` (the checkpoints work: each model's own template)
lands; the API layer calls only `render_chat`, so swapping it is a one-line change.
"""

from __future__ import annotations

from typing import Sequence

ROLES = ("system", "user", "assistant")


def render_chat(messages: Sequence[tuple[str, str]]) -> str:
    """[(role, content), ...] -> the prompt text (the tokenizer adds BOS); ValueError naming the bad message.

    Llama-2 chat: an optional system message first, then user and assistant turns alternating,
    ending with a user turn that the model answers:
    `[INST] <<SYS>>\\n{system}\\n<</SYS>>\\n\\n{user} [/INST] {assistant} [INST] {user} [/INST]`.
    (The reference template also puts EOS/BOS between turns; as text they would be encoded as
    characters, not special tokens, so they are left out here.)
    """
    if not messages:
        raise ValueError("messages is empty: send at least one user message")
    system = None
    turns = list(messages)
    if turns[0][0] == "system":
        system = turns.pop(0)[1]
    if not turns:
        raise ValueError("messages has only a system message: end with a user message")
    parts = []
    for i, (role, content) in enumerate(turns):
        index = i + (system is not None)
        expected = "user" if i % 2 == 0 else "assistant"
        if role not in ROLES:
            raise ValueError(f"messages[{index}].role is {role!r}; it must be one of {', '.join(ROLES)}")
        if role != expected:
            raise ValueError(f"messages[{index}].role is {role!r} where {expected!r} was expected: after an "
                             f"optional system message, user and assistant turns alternate")
        if role == "user":
            if i == 0 and system is not None:
                content = f"<<SYS>>\n{system}\n<</SYS>>\n\n{content}"
            parts.append(f"[INST] {content.strip()} [/INST]")
        else:
            parts.append(f" {content.strip()} ")
    if turns[-1][0] != "user":
        raise ValueError(f"messages[{len(messages) - 1}] is an assistant message: end with a user message")
    return "".join(parts)
