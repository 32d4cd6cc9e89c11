"""Tokenizers: the `Tokenizer` interface, Llama-2's SentencePiece model, the tiny model's byte tokenizer, and
streaming detokenization (HF `tokenizer.json`, what Llama-3 ships, is hf_tokenizer.py; a model directory's
tokenizer is loaded by tokenizer_files.load_tokenizer).

Both tokenizers share Llama-2's id layout for specials and bytes: 0 = <unk> (also used as pad),
1 = <s> (BOS), 2 = </s> (EOS), 3..258 = the byte pieces <0x00>..<0xFF>. `encode` prepends BOS and
appends no EOS by default, as Llama-2's reference code does; `decode` drops BOS, EOS, pad and any id
outside the vocabulary (a model's embedding table may be padded past the tokenizer's vocabulary, and
such an id has no text).

`StreamDecoder` turns a stream of sampled ids into text pieces whose concatenation is exactly
`decode(all ids)`, holding back bytes of a UTF-8 character that has not fully arrived.
"""

from __future__ import annotations

import abc
import os
from collections.abc import Sequence

BYTE_VOCAB_SIZE = 259
_BYTE_OFFSET = 3  # ids 0..2 are <unk>/pad, <s>, </s>; byte b is id b + 3, as in Llama-2's vocabulary
REPLACEMENT_CHAR = "\ufffd"  # what an incomplete UTF-8 sequence decodes to, until the rest of it arrives


class Tokenizer(abc.ABC):
    """Text <-> token ids. Subclasses implement `encode`, `decode` and the id properties.

    `chat_template` is the checkpoint's Jinja chat template (chat_template.jinja or tokenizer_config.json), None
    without one; `eos_ids` every id that ends generation (the tokenizer's EOS first, then any the checkpoint's
    generation_config.json / config.json add: Llama-3.1 stops on three).
    """

    chat_template: str | None = None
    _extra_eos_ids: tuple[int, ...] = ()

    @abc.abstractmethod
    def encode(self, text: str, *, add_bos: bool = True, add_eos: bool = False) -> list[int]:
        """Token ids of `text`, with BOS first when `add_bos` and EOS last when `add_eos`."""

    @abc.abstractmethod
    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`; specials (BOS, EOS, pad) and ids outside the vocabulary produce no text."""

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        """Number of ids the tokenizer knows: valid ids are 0..vocab_size-1."""

    @property
    @abc.abstractmethod
    def bos_id(self) -> int:
        """Beginning-of-sequence id."""

    @property
    @abc.abstractmethod
    def eos_id(self) -> int:
        """End-of-sequence id: generation stops when the model samples it."""

    @property
    @abc.abstractmethod
    def pad_id(self) -> int:
        """A valid id to fill unused token slots with; it decodes to nothing."""

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """Every id that ends generation: eos_id first."""
        return tuple(dict.fromkeys((self.eos_id, *self._extra_eos_ids)))

    def add_eos_ids(self, ids: Sequence[int]) -> None:
        """Also stop on `ids` (a checkpoint's generation_config.json EOS list); ids outside the vocabulary are refused."""
        bad = [i for i in ids if not 0 <= int(i) < self.vocab_size]
        if bad:
            raise ValueError(f"EOS id {bad[0]} is outside the tokenizer's vocabulary [0, {self.vocab_size})")
        self._extra_eos_ids = tuple(dict.fromkeys((*self._extra_eos_ids, *map(int, ids))))

    @property
    def bos_token(self) -> str:
        """BOS as text (what a chat template writes), e.g. "<s>" or "<|begin_of_text|>"."""
        return "<s>"

    @property
    def eos_token(self) -> str:
        """EOS as text, e.g. "</s>" or "<|eot_id|>"."""
        return "</s>"

    def decode_continuation(self, ids: Sequence[int]) -> str:
        """Text `ids` add when they follow non-empty text that ended on a complete character.

        `decode` of a whole sequence may treat its start specially (SentencePiece drops the leading
        space of the first word); this is the text of `ids` in the middle of a longer sequence, so
        that decode(a + b) == decode(a) + decode_continuation(b) whenever decode(a) is non-empty and
        does not end in U+FFFD. The default suits tokenizers whose decode has no such start rule.
        """
        return self.decode(ids)


def check_text(text: str) -> None:
    if not isinstance(text, str):
        raise TypeError(f"encode takes a str, got {type(text).__name__}")


def check_unicode(text: str, what: str = "text") -> str:
    """text, if it is valid Unicode (encodable as UTF-8); a lone surrogate (JSON's "\\ud800" escape, or its
    UTF-8-style bytes over gRPC) is a ValueError naming `what`, the character and its position. The one rule
    for every text field a request carries (prompt, stop strings, chat contents), in every front end."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} is not valid text: it holds the lone surrogate U+{ord(text[e.start]):04X} at "
                         f"position {e.start} (text must be valid Unicode, encodable as UTF-8)") from None
    return text


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as tokens, vocab 259: 0 = <unk>/pad, 1 = <s>, 2 = </s>, 3..258 = bytes 0..255."""

    def encode(self, text: str, *, add_bos: bool = True, add_eos: bool = False) -> list[int]:
        """One id per UTF-8 byte of `text` (byte b -> id b + 3), plus BOS/EOS as asked."""
        check_text(text)
        ids = [b + _BYTE_OFFSET for b in text.encode("utf-8")]
        return ([self.bos_id] if add_bos else []) + ids + ([self.eos_id] if add_eos else [])

    def decode(self, ids: Sequence[int]) -> str:
        """Bytes of the byte ids, as UTF-8; invalid sequences become U+FFFD, other ids are ignored."""
        data = bytes(i - _BYTE_OFFSET for i in map(int, ids) if _BYTE_OFFSET <= i < BYTE_VOCAB_SIZE)
        return data.decode("utf-8", errors="replace")

    @property
    def vocab_size(self) -> int:
        return BYTE_VOCAB_SIZE

    @property
    def bos_id(self) -> int:
        return 1

    @property
    def eos_id(self) -> int:
        return 2

    @property
    def pad_id(self) -> int:
        return 0

    def __repr__(self) -> str:
        return "ByteTokenizer()"


class SentencePieceTokenizer(Tokenizer):
    """Llama-2's tokenizer: a SentencePiece `tokenizer.model` file.

    Raises FileNotFoundError when `path` is not a file, ValueError when it cannot be read or is not
    a SentencePiece model.
    """

    def __init__(self, path: str | os.PathLike):
        import sentencepiece  # imported here so the byte tokenizer works without the package

        self.path = os.fspath(path)
        if not os.path.isfile(self.path):
            raise FileNotFoundError(f"SentencePiece tokenizer model not found: {self.path!r} is not a file")
        try:
            with open(self.path, "rb") as f:
                proto = f.read()
        except OSError as e:
            raise ValueError(f"cannot read SentencePiece tokenizer model {self.path!r}: {e}") from e
        if not proto:
            raise ValueError(f"SentencePiece tokenizer model {self.path!r} is empty")
        sp = sentencepiece.SentencePieceProcessor()
        try:
            sp.LoadFromSerializedProto(proto)
        except (RuntimeError, OSError) as e:
            raise ValueError(f"{self.path!r} is not a valid SentencePiece tokenizer model: {e}") from e
        if sp.GetPieceSize() <= 0:
            raise ValueError(f"SentencePiece tokenizer model {self.path!r} has an empty vocabulary")
        self._sp = sp
        self._vocab_size = sp.GetPieceSize()
        self._bos_id = sp.bos_id()
        self._eos_id = sp.eos_id()
        # Llama-2 defines no pad piece (pad_id -1, not a usable index); like its HF generation
        # config, pad with <unk> (0), which decode then drops.
        self._pad_id = sp.pad_id() if sp.pad_id() >= 0 else max(sp.unk_id(), 0)
        self._skipped = frozenset(i for i in (self._bos_id, self._eos_id, self._pad_id) if i >= 0)
        self._anchor_id, self._anchor_text = self._find_anchor()

    def _find_anchor(self) -> tuple[int, str]:
        """A piece whose text is non-empty and complete, to stand before a continuation.

        decode_continuation decodes [anchor] + ids and cuts the anchor's text off: after non-empty
        text SentencePiece no longer drops a leading space, so the result is what ids add mid-text.
        """
        sp = self._sp
        # Prefer a word piece; a byte piece merges with following bytes, which is harmless only because
        # it must decode to a whole character by itself (checked below), so it is the fallback.
        for want_byte in (False, True):
            for i in range(self._vocab_size):
                if (i in self._skipped or sp.IsByte(i) != want_byte or sp.IsControl(i) or sp.IsUnknown(i)
                        or sp.IsUnused(i)):
                    continue
                text = sp.DecodeIds([i])
                if text and REPLACEMENT_CHAR not in text:
                    return i, text
        raise ValueError(f"SentencePiece tokenizer model {self.path!r} has no piece that decodes to text")

    def encode(self, text: str, *, add_bos: bool = True, add_eos: bool = False) -> list[int]:
        """SentencePiece ids of `text`, with BOS prepended and EOS appended as asked (Llama-2's way)."""
        check_text(text)
        for wanted, name, value in ((add_bos, "BOS", self._bos_id), (add_eos, "EOS", self._eos_id)):
            if wanted and value < 0:
                raise ValueError(f"tokenizer model {self.path!r} defines no {name} piece; pass add_{name.lower()}=False")
        ids = self._sp.EncodeAsIds(text)
        return ([self._bos_id] if add_bos else []) + ids + ([self._eos_id] if add_eos else [])

    def _keep(self, ids: Sequence[int]) -> list[int]:
        # Dropping specials before SentencePiece sees them (rather than decoding them to "") means byte
        # pieces on either side of one join up, as in ByteTokenizer.
        n, skipped = self._vocab_size, self._skipped
        return [i for i in map(int, ids) if 0 <= i < n and i not in skipped]

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`, SentencePiece's way: '▁' is a space, the first word's leading space is dropped."""
        return self._sp.DecodeIds(self._keep(ids))

    def decode_continuation(self, ids: Sequence[int]) -> str:
        kept = self._keep(ids)
        if not kept:
            return ""
        text = self._sp.DecodeIds([self._anchor_id] + kept)
        if not text.startswith(self._anchor_text):  # cannot happen for SentencePiece's decoder; guard anyway
            raise RuntimeError(f"decoding after anchor piece {self._anchor_id} changed the anchor's text")
        return text[len(self._anchor_text):]

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def bos_id(self) -> int:
        return self._bos_id

    @property
    def eos_id(self) -> int:
        return self._eos_id

    @property
    def pad_id(self) -> int:
        return self._pad_id

    @property
    def bos_token(self) -> str:
        return self._sp.IdToPiece(self._bos_id) if self._bos_id >= 0 else ""

    @property
    def eos_token(self) -> str:
        return self._sp.IdToPiece(self._eos_id) if self._eos_id >= 0 else ""

    def __repr__(self) -> str:
        return f"SentencePieceTokenizer({self.path!r})"


class StreamDecoder:
    """Incremental detokenizer: `push` one id at a time, get back the text that is now final.

    The concatenation of every `push` result and the final `flush` equals `tokenizer.decode` of all
    pushed ids, and after each push the text returned so far is decode(ids so far) less any trailing
    U+FFFD (the bytes of a character still arriving). Work per push is bounded by the few ids since the
    text last ended on a complete character, not by the length of the sequence.
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._reset()

    def _reset(self) -> None:
        self._window: list[int] = []  # ids since the last point where the text was final
        self._emitted = ""  # text of the window already returned
        # Until some text is final, the window holds every id from the start and is decoded as a whole
        # sequence (SentencePiece's leading-space rule depends on it); afterwards as a continuation.
        self._started = False

    def _window_text(self) -> str:
        if self._started:
            return self.tokenizer.decode_continuation(self._window)
        return self.tokenizer.decode(self._window)

    def push(self, token_id: int) -> str:
        """Adds one id; returns the text that became final with it (often one piece, maybe "")."""
        self._window.append(int(token_id))
        text = self._window_text()
        # Trailing U+FFFD may be an incomplete character that later bytes complete: hold it back.
        # UTF-8 decodes left to right, so everything before it can no longer change.
        stable = text.rstrip(REPLACEMENT_CHAR)
        if not stable.startswith(self._emitted):
            raise RuntimeError(f"{type(self.tokenizer).__name__} decoded a prefix differently once more ids came")
        piece = stable[len(self._emitted):]
        if stable == text and (text or self._started):
            # The text ends on a complete character (or, mid-text, the window added nothing): start a new
            # window, so later pushes decode only the ids after this point.
            self._started = True
            self._window, self._emitted = [], ""
        else:
            self._emitted = stable
        return piece

    def flush(self) -> str:
        """Ends the sequence: returns all text still held back (incomplete bytes as U+FFFD) and resets."""
        text = self._window_text() if self._window else ""
        piece = text[len(self._emitted):]
        self._reset()
        return piece
