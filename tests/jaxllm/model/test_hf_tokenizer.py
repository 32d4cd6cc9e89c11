"""HF tokenizer.json tokenizers built here with the `tokenizers` library (Llama-2-style byte-fallback BPE,
Llama-3-style byte-level BPE): round trips, special tokens, streaming that never splits a character,
load_tokenizer with tokenizer_config.json / generation_config.json, and LLM.chat end to end."""

from __future__ import annotations

import json

import numpy as np
import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from jaxllm.model.generation_config import GenerationDefaults, load_generation_defaults
from jaxllm.model.hf_tokenizer import HFTokenizer
from jaxllm.model.tokenizer import StreamDecoder
from jaxllm.model.tokenizer_files import load_tokenizer

_CORPUS = ["the quick brown fox jumps over the lazy dog", "hello world, hello tokens", "long context llama models"] * 5
TEXTS = ["hello world", "  two  spaces and a tab\there", "café naïve 日本語 🦙 ok", "🦙🦙", "x", "the <b> end\n"]


def _byte_fallback_bpe() -> Tokenizer:
    """Llama-2's tokenizer.json shape: Metaspace-like normaliser, BPE with byte fallback, <0xXX> byte tokens."""
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.train_from_iterator(_CORPUS, trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"]))
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):  # byte tokens as ordinary (non-special) vocabulary, as Llama-2 has them
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    tok = Tokenizer.from_str(json.dumps(spec))
    tok.add_special_tokens([AddedToken("<|eot|>", special=True)])
    return tok


def _byte_level_bpe() -> Tokenizer:
    """Llama-3's shape: byte-level BPE, specials <|begin_of_text|>, <|end_of_text|>, <|eot_id|>."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(_CORPUS, trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                          special_tokens=["<|begin_of_text|>", "<|end_of_text|>",
                                                                          "<|eot_id|>"]))
    return tok


LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")


@pytest.fixture(params=["byte_fallback", "byte_level"])
def hf_dir(request, tmp_path):
    if request.param == "byte_fallback":
        tok, cfg = _byte_fallback_bpe(), {"bos_token": "<s>", "eos_token": {"content": "</s>", "special": True}}
    else:
        tok = _byte_level_bpe()
        tok.add_special_tokens([AddedToken("<|start_header_id|>", special=True),
                                AddedToken("<|end_header_id|>", special=True)])
        cfg = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "chat_template": LLAMA3_TEMPLATE}
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return tmp_path


def test_round_trip_and_bos(hf_dir):
    tok = load_tokenizer(hf_dir)
    assert isinstance(tok, HFTokenizer)
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids[0] == tok.bos_id and tok.bos_id not in ids[1:]  # one BOS: the post-processor never adds another
        assert tok.decode(ids) == text
        assert tok.decode(tok.encode(text, add_bos=False, add_eos=True)) == text
    assert tok.encode("🦙", add_bos=False) != tok.encode("x", add_bos=False)
    # special-token text becomes its single id, and decodes to nothing
    eos = tok.eos_token
    ids = tok.encode(f"hi{eos}there", add_bos=False)
    assert tok.eos_id in ids and tok.decode(ids) in ("hithere", "hi there")
    assert tok.decode([tok.vocab_size + 5, tok.pad_id]) == ""


def test_stream_pieces_join_to_the_text_and_never_split_characters(hf_dir):
    tok = load_tokenizer(hf_dir)
    rng = np.random.default_rng(0)
    texts = TEXTS + ["".join(rng.choice(list("ab 日🦙é\n"), 30)) for _ in range(5)]
    for text in texts:
        ids = tok.encode(text)
        decoder = StreamDecoder(tok)
        pieces = [decoder.push(i) for i in ids] + [decoder.flush()]
        assert "".join(pieces) == tok.decode(ids) == text
        assert not any("\ufffd" in p for p in pieces)


def test_byte_fallback_really_falls_back():
    tok = _byte_fallback_bpe()
    pieces = tok.encode("日", add_special_tokens=False).tokens
    assert pieces[-3:] == ["<0xE6>", "<0x97>", "<0xA5>"]  # three bytes: a stream must hold the first two back


def test_eos_ids_and_generation_defaults(hf_dir):
    (hf_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 2], "do_sample": True,
                                                                "temperature": 0.6, "top_p": 0.9}))
    (hf_dir / "config.json").write_text(json.dumps({"eos_token_id": [9]}))
    tok = load_tokenizer(hf_dir)
    assert tok.eos_ids == tuple(dict.fromkeys((tok.eos_id, 7, 2, 9))) and tok.eos_ids[0] == tok.eos_id
    defaults = load_generation_defaults(hf_dir)
    assert defaults == GenerationDefaults(eos_token_ids=(7, 2, 9), temperature=0.6, top_p=0.9)
    assert defaults.resolve(None, None, None) == (0.6, 0, 0.9)
    assert defaults.resolve(0.0, 5, None) == (0.0, 5, 0.9)  # a request's own values win
    (hf_dir / "generation_config.json").write_text(json.dumps({"do_sample": False, "temperature": 0.6}))
    assert load_generation_defaults(hf_dir).resolve(None, None, None) == (0.0, 0, 1.0)  # greedy, as HF
    (hf_dir / "generation_config.json").write_text(json.dumps({"top_p": 1.5}))
    with pytest.raises(ValueError, match=r"generation_config\.json: top_p must be in \(0, 1\], got 1\.5"):
        load_generation_defaults(hf_dir)
    (hf_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [10**9]}))
    with pytest.raises(ValueError, match=r"EOS id 1000000000 is outside the tokenizer's vocabulary"):
        load_tokenizer(hf_dir)


def test_malformed_tokenizer_files(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a valid tokenizer.json"):
        load_tokenizer(tmp_path)
    _byte_level_bpe().save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|nope|>"}))
    with pytest.raises(ValueError, match=r"eos_token '<\|nope\|>' is not in the vocabulary"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("[1, 2")
    with pytest.raises(ValueError, match=r"tokenizer_config\.json is malformed"):
        load_tokenizer(tmp_path)
