"""HuggingFace `tokenizer.json` tokenizers (Llama-3's byte-level BPE, Llama-2's byte-fallback BPE)
through the `tokenizers` library, with BOS / EOS / pad from tokenizer_config.json as transformers reads them.

`encode` never runs the file's post-processor (Llama-3's adds BOS itself): BOS comes from
`add_bos`, as for the other tokenizers, so it is never doubled. Special-token text in the input
(e.g. "<|eot_id|>" written by a chat template) becomes its id, as in transformers.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from jaxllm.model.tokenizer import Tokenizer, REPLACEMENT_CHAR, check_text

# Names checkpoints give BOS / EOS when tokenizer_config.json does not say (Llama-2, Llama-3).
_BOS_NAMES = ("<s>", "<|begin_of_text|>")
_EOS_NAMES = ("</s>", "<|end_of_text|>", "<|eot_id|>")


def _token_text(value) -> str | None:
    # tokenizer_config.json writes a special token as text or as an AddedToken dict {"content": ...}.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class HFTokenizer(Tokenizer):
    """A `tokenizer.json` read by the `tokenizers` library.

    Raises FileNotFoundError when `path` is not a file and ValueError when it cannot be parsed or
    names no EOS token.
    """

    def __init__(self, path: str | os.PathLike, tokenizer_config: dict | None = None):
        from tokenizers import Tokenizer as RustTokenizer

        self.path = os.fspath(path)
        if not os.path.isfile(self.path):
            raise FileNotFoundError(f"tokenizer.json not found: {self.path!r} is not a file")
        try:
            self._tok = RustTokenizer.from_file(self.path)
        except Exception as e:  # the library raises a bare Exception for any parse error
            raise ValueError(f"{self.path!r} is not a valid tokenizer.json: {e}") from e
        cfg = tokenizer_config or {}
        self._vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self._bos_token, self._bos_id = self._special(cfg, "bos_token", _BOS_NAMES)
        self._eos_token, self._eos_id = self._special(cfg, "eos_token", _EOS_NAMES)
        if self._eos_id is None:
            raise ValueError(f"{self.path!r}: no EOS token (tokenizer_config.json eos_token, or one of {_EOS_NAMES})")
        self._add_bos = cfg.get("add_bos_token", True) is not False and self._bos_id is not None
        _, pad = self._special(cfg, "pad_token", ())
        self._pad_id = pad if pad is not None else self._eos_id  # EOS is special: it decodes to nothing too
        self._special_ids = frozenset(t for t, added in self._tok.get_added_tokens_decoder().items() if added.special)
        self._anchor_id, self._anchor_text = self._find_anchor()

    def _special(self, cfg: dict, key: str, names: tuple[str, ...]) -> tuple[str, int | None]:
        text = _token_text(cfg.get(key))
        candidates = (text,) if text is not None else names
        for name in candidates:
            token_id = self._tok.token_to_id(name)
            if token_id is not None:
                return name, token_id
        if text is not None:
            raise ValueError(f"{self.path!r}: tokenizer_config.json {key} {text!r} is not in the vocabulary")
        return "", None

    def _find_anchor(self) -> tuple[int, str]:
        """A token whose text is non-empty and complete, to stand before a continuation (see
        SentencePieceTokenizer._find_anchor): decoders that drop the first word's leading space
        (Metaspace, Strip) then treat the continuation as mid-text."""
        for i in range(self._vocab_size):
            if i in self._special_ids:
                continue
            text = self._tok.decode([i], skip_special_tokens=True)
            if text.strip() and REPLACEMENT_CHAR not in text:
                return i, text
        raise ValueError(f"{self.path!r} has no token that decodes to text")

    def encode(self, text: str, *, add_bos: bool = True, add_eos: bool = False) -> list[int]:
        """Token ids of `text` (special-token text becomes its id), BOS first when `add_bos` and the
        tokenizer adds one (tokenizer_config.json add_bos_token), EOS last when `add_eos`."""
        check_text(text)
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return ([self._bos_id] if add_bos and self._add_bos else []) + ids + ([self._eos_id] if add_eos else [])

    def _keep(self, ids: Sequence[int]) -> list[int]:
        n = self._vocab_size
        return [i for i in map(int, ids) if 0 <= i < n and i not in self._special_ids]

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`; special tokens and ids outside the vocabulary give none."""
        return self._tok.decode(self._keep(ids), skip_special_tokens=True)

    def decode_continuation(self, ids: Sequence[int]) -> str:
        kept = self._keep(ids)
        if not kept:
            return ""
        text = self._tok.decode([self._anchor_id] + kept, skip_special_tokens=True)
        if not text.startswith(self._anchor_text):
            raise RuntimeError(f"decoding after anchor token {self._anchor_id} changed the anchor's text")
        return text[len(self._anchor_text):]

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def bos_id(self) -> int:
        return self._bos_id if self._bos_id is not None else -1

    @property
    def eos_id(self) -> int:
        return self._eos_id

    @property
    def pad_id(self) -> int:
        return self._pad_id

    @property
    def bos_token(self) -> str:
        return self._bos_token

    @property
    def eos_token(self) -> str:
        return self._eos_token

    def __repr__(self) -> str:
        return f"HFTokenizer({self.path!r})"


def _byte_stand_ins() -> dict[int, str]:
    """Byte-level BPE's printable stand-in of each byte (GPT-2's bytes_to_unicode): printable Latin-1 bytes
    stand for themselves, the others for U+0100 onwards, in byte order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1), *range(ord("\u00ae"), 256)]
    table = {b: chr(b) for b in kept}
    for n, b in enumerate(b for b in range(256) if b not in table):
        table[b] = chr(256 + n)
    return table


def save_byte_tokenizer(out_dir: str | os.PathLike) -> None:
    """Write the tiny preset's byte tokenizer (tokenizer.ByteTokenizer) as tokenizer.json + tokenizer_config.json:
    Llama-2's id layout (0 <unk>, 1 <s>, 2 </s>, 3 + b the byte b) as a byte-level BPE with no merges, so every
    text gets the ByteTokenizer's ids and every id sequence its text (invalid UTF-8 included; text spelling a
    special token, e.g. "<s>", becomes its id, as in transformers). What `jaxllm convert <preset> DST` ships."""
    import json

    from tokenizers import AddedToken, Tokenizer as RustTokenizer, decoders, models, pre_tokenizers

    specials = ["<unk>", "<s>", "</s>"]
    stand_in = _byte_stand_ins()
    vocab = {name: i for i, name in enumerate(specials)}
    vocab.update({stand_in[b]: len(specials) + b for b in range(256)})
    tok = RustTokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)  # every byte a piece
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(name, special=True, normalized=False) for name in specials])
    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
              "unk_token": "<unk>", "pad_token": "<unk>", "add_bos_token": True, "add_eos_token": False}
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
