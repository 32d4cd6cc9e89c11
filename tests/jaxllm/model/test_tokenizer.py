"""Tokenizers: byte layout, Llama-2 BOS/EOS rules, round trips, streaming detokenization, load errors."""

import secrets

import numpy as np
import pytest
import sentencepiece

from jaxllm.model.tokenizer import (
    BYTE_VOCAB_SIZE,
    ByteTokenizer,
    SentencePieceTokenizer,
    StreamDecoder,
    Tokenizer,
)
from jaxllm.model.tokenizer_files import load_tokenizer

_WORDS = ("the quick brown fox jumps over the lazy dog while hello world says café naïve résumé "
          "Ünïcödé 日本 東京 こんにちは 😀 🚀 👍🏽 ∑ ß 12345 don't").split()
# Characters of 1, 2, 3 and 4 UTF-8 bytes, several absent from the training text (byte fallback).
_ALPHABET = list("abcXYZ09 .,!\n\t") + ["é", "ñ", "ß", "Ω", "日", "本", "語", "€", "😀", "🚀", "𝄞", "\u200d"]
_SP_VOCAB = 400


@pytest.fixture(scope="module")
def sp_model_dir(tmp_path_factory):
    """A tiny Llama-like SentencePiece model (BPE, byte fallback, <unk>=0 <s>=1 </s>=2, no pad), trained offline."""
    d = tmp_path_factory.mktemp("spm")
    rng = np.random.default_rng(0)  # the training text only shapes the vocabulary; the tests draw fresh inputs
    lines = [" ".join(rng.choice(_WORDS, size=rng.integers(3, 13))) for _ in range(1500)]
    (d / "corpus.txt").write_text("\n".join(lines), encoding="utf-8")
    sentencepiece.SentencePieceTrainer.train(
        input=str(d / "corpus.txt"), model_prefix=str(d / "tokenizer"), vocab_size=_SP_VOCAB, model_type="bpe",
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, byte_fallback=True, character_coverage=0.9995,
        # Llama-2's normalizer settings: no NFKC, keep whitespace as written, a dummy prefix space.
        normalization_rule_name="identity", remove_extra_whitespaces=False, add_dummy_prefix=True,
        split_digits=True, allow_whitespace_only_pieces=True, minloglevel=2)
    return d


@pytest.fixture(scope="module")
def sp_tok(sp_model_dir):
    return SentencePieceTokenizer(sp_model_dir / "tokenizer.model")


@pytest.fixture
def rng():
    seed = secrets.randbits(32)
    print(f"seed={seed}")  # shown by pytest on failure
    return np.random.default_rng(seed)


def _random_text(rng, n):
    return "".join(rng.choice(_ALPHABET, size=n))


# ---- ByteTokenizer ------------------------------------------------------------------------------------------


def test_byte_tokenizer_layout():
    tok = ByteTokenizer()
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id) == (259, 1, 2, 0) == (BYTE_VOCAB_SIZE, 1, 2, 0)
    assert tok.encode("A") == [1, 3 + 65]
    assert tok.encode("A", add_bos=False) == [3 + 65]
    assert tok.encode("A", add_eos=True) == [1, 68, 2]
    assert tok.encode("", add_bos=False) == []
    assert tok.encode("é", add_bos=False) == [3 + 0xC3, 3 + 0xA9]
    assert tok.encode("😀", add_bos=False) == [3 + b for b in "😀".encode()]
    assert tok.encode("\x00\xff", add_bos=False) == [3, 3 + 0xC3, 3 + 0xBF]
    assert max(tok.encode("\U0010ffff" * 3)) <= 258


def test_byte_tokenizer_round_trip(rng):
    tok = ByteTokenizer()
    for n in (0, 1, 7, 64):
        text = _random_text(rng, n)
        ids = tok.encode(text, add_eos=True)
        assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id and len(ids) == len(text.encode()) + 2
        assert tok.decode(ids) == text


def test_byte_tokenizer_decode_ignores_specials_and_unknown_ids():
    tok = ByteTokenizer()
    h, i = 3 + ord("h"), 3 + ord("i")
    assert tok.decode([1, h, 0, 2, 259, -1, 10**6, i, 2]) == "hi"
    assert tok.decode(np.array([h, i], dtype=np.int32)) == "hi"
    # Specials are gone before the bytes are decoded: a character split around one still joins up.
    e6, x97, xa5 = (3 + b for b in "日".encode())
    assert tok.decode([e6, 2, x97, 0, xa5]) == "日"


def test_byte_tokenizer_invalid_utf8_is_replaced():
    tok = ByteTokenizer()
    for raw in (b"\xe6A", b"\x80", b"a\xf0\x9f\x98", b"\xc3\xa9\xc3", b"\xed\xa0\x80z"):
        ids = [3 + b for b in raw]
        assert tok.decode(ids) == raw.decode("utf-8", errors="replace")
        assert "\ufffd" in tok.decode(ids)


# ---- SentencePieceTokenizer ---------------------------------------------------------------------------------


def test_sentencepiece_ids_and_bos_eos(sp_tok, sp_model_dir):
    sp = sentencepiece.SentencePieceProcessor(model_file=str(sp_model_dir / "tokenizer.model"))
    assert isinstance(sp_tok, Tokenizer)
    assert (sp_tok.vocab_size, sp_tok.bos_id, sp_tok.eos_id) == (_SP_VOCAB, 1, 2)
    assert sp_tok.pad_id == 0  # the model has no pad piece: pad with <unk>, as Llama-2 does
    text = "the lazy dog says 日本 😀"
    body = sp.encode(text)
    assert len(body) > 3 and 1 not in body and 2 not in body
    assert sp_tok.encode(text) == [1] + body  # Llama-2: BOS by default, no EOS
    assert sp_tok.encode(text, add_eos=True) == [1] + body + [2]
    assert sp_tok.encode(text, add_bos=False) == body
    assert sp_tok.encode(text, add_bos=False, add_eos=True) == body + [2]
    assert sp_tok.encode("") == [1]
    assert sp_tok.decode(sp_tok.encode(text, add_eos=True)) == text
    assert sp_tok.decode([1, 1, 2, 0, -1, _SP_VOCAB, 10**6]) == ""


def test_sentencepiece_round_trip(sp_tok, rng):
    for n in (1, 5, 40, 200):
        text = _random_text(rng, n)
        ids = sp_tok.encode(text)
        assert all(0 <= i < sp_tok.vocab_size for i in ids)
        assert sp_tok.decode(ids) == text, (text, ids)


def test_sentencepiece_decode_matches_sentencepiece(sp_tok, sp_model_dir, rng):
    sp = sentencepiece.SentencePieceProcessor(model_file=str(sp_model_dir / "tokenizer.model"))
    for _ in range(50):
        ids = rng.integers(3, _SP_VOCAB, size=rng.integers(1, 30)).tolist()  # no specials
        assert sp_tok.decode(ids) == sp.decode(ids)
    # With specials: they are dropped before decoding, so bytes around one join into a character.
    e6, x97, xa5 = (sp.piece_to_id(f"<0x{b:02X}>") for b in "日".encode())
    assert sp_tok.decode([1, e6, 2, x97, xa5]) == "日"
    # '▁' is a space, except that the first word's is dropped, even after BOS.
    the = sp.piece_to_id("▁the")
    assert sp_tok.decode([the, the]) == "the the"
    assert sp_tok.decode([1, the]) == "the"


@pytest.mark.parametrize("contents", [b"", b"not a sentencepiece model\x00\xff", b"\x0a\x05hello"])
def test_sentencepiece_malformed_file(tmp_path, contents):
    path = tmp_path / "tokenizer.model"
    path.write_bytes(contents)
    with pytest.raises(ValueError, match="tokenizer.model"):
        SentencePieceTokenizer(path)


def test_sentencepiece_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere.model"):
        SentencePieceTokenizer(tmp_path / "nowhere.model")
    with pytest.raises(FileNotFoundError, match="not a file"):
        SentencePieceTokenizer(tmp_path)


def test_encode_rejects_non_text(sp_tok):
    for tok in (ByteTokenizer(), sp_tok):
        with pytest.raises(TypeError, match="bytes"):
            tok.encode(b"abc")


# ---- load_tokenizer -----------------------------------------------------------------------------------------


def test_load_tokenizer(sp_model_dir, tmp_path):
    assert isinstance(load_tokenizer(None), ByteTokenizer)
    tok = load_tokenizer(str(sp_model_dir))
    assert isinstance(tok, SentencePieceTokenizer) and tok.vocab_size == _SP_VOCAB
    with pytest.raises(FileNotFoundError, match="tokenizer.model"):
        load_tokenizer(tmp_path)  # a model directory without the tokenizer
    with pytest.raises(FileNotFoundError, match="no-such-dir"):
        load_tokenizer(tmp_path / "no-such-dir")


# ---- StreamDecoder ------------------------------------------------------------------------------------------


def _check_stream(tok, ids):
    """Pushes ids one by one, checking after each that exactly the final text so far has come out."""
    stream, out = StreamDecoder(tok), []
    for k, i in enumerate(ids):
        out.append(stream.push(i))
        assert isinstance(out[-1], str)
        assert "".join(out) == tok.decode(ids[:k + 1]).rstrip("\ufffd"), (ids, k, out)
    out.append(stream.flush())
    assert "".join(out) == tok.decode(ids), (ids, out)
    return out


def _random_ids(rng, tok, n, byte_heavy):
    """Random ids over the whole vocabulary and a little past it; byte_heavy: mostly multi-byte lead and
    continuation bytes, so characters are split, truncated and malformed in every way."""
    ids = rng.integers(-2, tok.vocab_size + 3, size=n)
    if byte_heavy:
        raw = rng.choice([0x41, 0x20, 0xC3, 0xA9, 0xE6, 0x97, 0xA5, 0xF0, 0x9F, 0x98, 0x80, 0xBF], size=n)
        ids = np.where(rng.random(n) < 0.85, raw + 3, ids)  # bytes 0..255 are ids 3..258 in both tokenizers
    return ids.tolist()


@pytest.mark.parametrize("which", ["byte", "sentencepiece"])
def test_stream_random_ids(which, sp_tok, rng):
    tok = ByteTokenizer() if which == "byte" else sp_tok
    for trial in range(60):
        n = int(rng.integers(1, 40))
        _check_stream(tok, _random_ids(rng, tok, n, byte_heavy=trial % 2 == 0))


@pytest.mark.parametrize("which", ["byte", "sentencepiece"])
def test_stream_encoded_text(which, sp_tok, rng):
    tok = ByteTokenizer() if which == "byte" else sp_tok
    for n in (1, 3, 30, 120):
        text = _random_text(rng, n)
        ids = tok.encode(text, add_eos=True)
        assert "".join(_check_stream(tok, ids)) == text


def test_stream_holds_back_split_characters(sp_tok):
    byte_tok = ByteTokenizer()
    for tok in (byte_tok, sp_tok):
        stream = StreamDecoder(tok)
        ids = [3 + b for b in "日😀é".encode()]  # one byte per push; both tokenizers put byte b at id b+3
        out = [stream.push(i) for i in ids]
        assert out == ["", "", "日", "", "", "", "😀", "", "é"], (tok, out)
        assert stream.flush() == ""
        # A character cut short comes out as U+FFFD only when the stream ends.
        assert stream.push(3 + 0xE6) == "" and stream.push(3 + 0x97) == ""
        assert stream.flush() == tok.decode([3 + 0xE6, 3 + 0x97]) != ""


def test_stream_sentencepiece_leading_space(sp_tok, sp_model_dir):
    sp = sentencepiece.SentencePieceProcessor(model_file=str(sp_model_dir / "tokenizer.model"))
    the, dog, space = sp.piece_to_id("▁the"), sp.piece_to_id("▁dog"), sp.piece_to_id("▁")
    stream = StreamDecoder(sp_tok)
    # The first word loses its space, later words keep theirs, whatever specials come between.
    assert [stream.push(i) for i in (1, the, dog, 2, the)] == ["", "the", " dog", "", " the"]
    assert stream.flush() == ""
    # After flush the decoder starts a new text.
    assert stream.push(dog) == "dog"
    # A lone '▁' at the start decodes to nothing, and takes the next word's space with it.
    _check_stream(sp_tok, [space, the, space, space, dog])
