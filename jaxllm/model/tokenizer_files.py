"""Which tokenizer a model directory holds, and loading it: `load_tokenizer` over the byte tokenizer, HF
`tokenizer.json` (hf_tokenizer.py) and SentencePiece (tokenizer.py), with the chat template and the extra EOS ids.

Its own module so the tokenizers import only their interface (tokenizer.py) and nothing imports back.
"""

from __future__ import annotations

import json
import os

from jaxllm.model.generation_config import load_generation_defaults
from jaxllm.model.hf_tokenizer import HFTokenizer
from jaxllm.model.tokenizer import ByteTokenizer, SentencePieceTokenizer, Tokenizer

__all__ = ["CHAT_TEMPLATE_FILE", "has_tokenizer", "load_tokenizer", "read_tokenizer_config"]

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")  # tokenizer.json first: it is what transformers prefers


def has_tokenizer(model_dir: str | os.PathLike) -> bool:
    """Whether `model_dir` holds a tokenizer load_tokenizer can read."""
    return any(os.path.isfile(os.path.join(model_dir, name)) for name in _TOKENIZER_FILES)


def read_tokenizer_config(model_dir: str) -> dict:
    """tokenizer_config.json as a dict ({} when absent); ValueError naming the file when malformed."""
    path = os.path.join(model_dir, "tokenizer_config.json")
    if not os.path.isfile(path):
        return {}
    try:
        with open(path) as f:
            raw = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is malformed: {e}") from e
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    return raw


CHAT_TEMPLATE_FILE = "chat_template.jinja"


def _chat_template(model_dir: str, tokenizer_config: dict) -> str | None:
    """The checkpoint's chat template as transformers finds it: chat_template.jinja (where transformers 5's
    save_pretrained writes it) over tokenizer_config.json's `chat_template` (a string, or named templates:
    "default")."""
    path = os.path.join(model_dir, CHAT_TEMPLATE_FILE)
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):  # several named templates: transformers uses "default"
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    return template if isinstance(template, str) else None


def load_tokenizer(model_dir: str | os.PathLike | None) -> Tokenizer:
    """ByteTokenizer when `model_dir` is None; else `model_dir/tokenizer.json` (HF tokenizers, with its
    tokenizer_config.json) or, without one, the SentencePiece `model_dir/tokenizer.model`. The chat
    template comes from chat_template.jinja or tokenizer_config.json, extra EOS ids from generation_config.json /
    config.json."""
    if model_dir is None:
        return ByteTokenizer()
    model_dir = os.fspath(model_dir)
    if not os.path.isdir(model_dir):
        raise FileNotFoundError(f"model directory not found: {model_dir!r}")
    tokenizer_config = read_tokenizer_config(model_dir)
    if os.path.isfile(os.path.join(model_dir, "tokenizer.json")):
        tokenizer: Tokenizer = HFTokenizer(os.path.join(model_dir, "tokenizer.json"), tokenizer_config)
    else:
        path = os.path.join(model_dir, "tokenizer.model")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"model directory {model_dir!r} has no tokenizer.json or tokenizer.model "
                                    f"(looked for {path!r})")
        tokenizer = SentencePieceTokenizer(path)
    tokenizer.chat_template = _chat_template(model_dir, tokenizer_config)
    tokenizer.add_eos_ids(load_generation_defaults(model_dir).eos_token_ids)
    return tokenizer
