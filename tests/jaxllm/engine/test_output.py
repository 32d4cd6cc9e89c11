"""The output processor alone, with fake tokenizers and the byte tokenizer (no model, no device)."""

import numpy as np
import pytest

from jaxllm.engine.output import RequestClock, TextStream
from jaxllm.model.tokenizer import REPLACEMENT_CHAR, ByteTokenizer

ALPHABET = "abcdxyz"


class CharTokenizer:
    """Token i is the character ALPHABET[i]: every token boundary is a character boundary."""

    def encode(self, text):
        return [ALPHABET.index(c) for c in text]

    def decode(self, ids):
        return "".join(ALPHABET[i] for i in ids)

    decode_continuation = decode


def _run(text: str, stop) -> tuple[TextStream, list[str]]:
    """Push text one character-token at a time, taking the streamed piece after each, as the core does."""
    stream, pieces = TextStream(CharTokenizer(), tuple(stop)), []
    for token in CharTokenizer().encode(text):
        stream.push(token)
        pieces.append(stream.take())
        if stream.stopped:
            break
    stream.finish()
    pieces.append(stream.take(final=True))
    return stream, pieces


def test_stop_string_spanning_token_boundaries():
    stream, pieces = _run("abc", ["bc"])
    assert stream.stopped and stream.text == "a" and "".join(pieces) == "a"


@pytest.mark.parametrize("text, stop, expected", [
    ("abcabc", ["bc"], "a"),
    ("aabxbcd", ["bc"], "aabx"),
    ("abcd", ["cd", "abc"], ""),  # the earliest match wins, not the first stop listed
    ("xyzxyz", ["zx", "yzx"], "x"),
    ("abcd", ["d"], "abc"),
    ("dabc", ["dab"], ""),
    ("abab", ["abb"], "abab"),  # never completes: all text comes out at the end
])
def test_stop_strings_cut_the_text(text, stop, expected):
    stream, pieces = _run(text, stop)
    assert stream.text == expected and "".join(pieces) == expected
    assert stream.stopped == (expected != text)


def test_a_stop_string_found_only_across_many_tokens():
    # The match starts several tokens before the token that completes it: a search over the new text
    # only would miss it.
    stream, pieces = _run("xabcdz", ["abcd"])
    assert stream.text == "x" and "".join(pieces) == "x"


def test_hold_back_is_exact():
    stream = TextStream(CharTokenizer(), ("bcd",))
    shown = ""
    for ch, visible in zip("xabcx", ["x", "xa", "xa", "xa", "xabcx"]):
        stream.push(ALPHABET.index(ch))
        shown += stream.take()
        # After "xab" the tail "b" may start "bcd" ("ab" cannot): exactly one character is held.
        assert shown == visible, (ch, shown)
    assert not stream.stopped


def test_hold_back_of_the_longest_possible_prefix():
    stream = TextStream(CharTokenizer(), ("ab", "abcd"))
    for ch in "xabc":
        stream.push(ALPHABET.index(ch))
    assert stream.stopped and stream.text == "x"  # "ab" completed first
    stream = TextStream(CharTokenizer(), ("xyz", "abcd"))
    for ch in "dabc":
        stream.push(ALPHABET.index(ch))
    assert stream.held_back() == 3 and stream.take() == "d"


@pytest.mark.parametrize("text", ["abcabcd", "aabcdd", "abcabd", "dcbabcd"])
def test_streamed_text_never_shows_a_stop_prefix_that_later_completes(text):
    stop = "abcd"
    stream, pieces = _run(text, [stop])
    shown = ""
    for piece in pieces:
        shown += piece
        assert stop not in shown
        assert shown == stream.text[:len(shown)]  # what was shown is never taken back
    assert shown == stream.text


def test_without_stop_strings_everything_streams_at_once():
    stream = TextStream(CharTokenizer())
    for ch in "abc":
        stream.push(ALPHABET.index(ch))
        assert stream.take() == ch


def test_no_text_after_a_stop():
    stream = TextStream(CharTokenizer(), ("b",))
    for ch in "abcd":
        stream.push(ALPHABET.index(ch))
    stream.finish()
    assert stream.text == "a" and stream.take(final=True) == "a"


def test_clock_records_ttft_and_tpot_once():
    clock = RequestClock(arrival=10.0)
    assert clock.timings().ttft_s is None
    clock.tokens_at(10.5, 1)
    assert clock.timings().ttft_s == 0.5 and clock.timings().tpot_s is None
    clock.tokens_at(11.5, 2)  # two tokens in one step
    clock.tokens_at(12.0, 0)  # a step that gave it nothing changes nothing
    timings = clock.timings()
    assert timings.ttft_s == 0.5 and timings.tpot_s == pytest.approx(0.5)


# ----- properties over random token sequences (fixed seeds) -----

# Characters of 1, 2, 3 and 4 UTF-8 bytes: a byte-token stream delivers the longer ones over several pushes.
_CHARS = ["a", "b", "é", "日", "😀"]


class PieceTokenizer:
    """Token i is PIECES[i], a string of 1..3 characters: one push may add several characters at once."""

    PIECES = ["a", "b", "ab", "ba", "aab", "é", "bé", "日", "a日b", "😀", "😀a"]

    def decode(self, ids):
        return "".join(self.PIECES[i] for i in ids)

    decode_continuation = decode


def _byte_ids(rng, length: int) -> list[int]:
    """Random byte-token ids: whole characters, characters cut short, stray bytes, specials (BOS/EOS/pad)."""
    tok, ids = ByteTokenizer(), []
    while len(ids) < length:
        kind = rng.random()
        if kind < 0.7:
            ids += tok.encode(str(rng.choice(_CHARS)), add_bos=False)
        elif kind < 0.85:  # the first bytes of a multi-byte character, never completed
            whole = tok.encode(str(rng.choice(_CHARS[2:])), add_bos=False)
            ids += whole[:int(rng.integers(1, len(whole)))]
        elif kind < 0.95:
            ids.append(int(rng.integers(3, 259)))  # any byte, valid or not where it lands
        else:
            ids.append(int(rng.integers(0, 3)))  # no text
    return ids


def _stop_strings(rng) -> tuple[str, ...]:
    """2..4 stop strings over the same few characters that overlap each other: prefixes, extensions and
    shifted windows of one random string."""
    base = "".join(rng.choice(_CHARS[:3], size=int(rng.integers(2, 6))))
    out = set()
    while len(out) < int(rng.integers(2, 5)):
        i = int(rng.integers(0, len(base)))
        j = int(rng.integers(i + 1, len(base) + 1))
        out.add(base[i:j] + ("".join(rng.choice(_CHARS[:3], size=int(rng.integers(0, 2))))))
    return tuple(sorted(out))


def _stream(tokenizer, ids, stop) -> tuple[TextStream, list[str]]:
    """Push ids as the core does (take after each), then finish; the text shown so far after every take."""
    stream, shown = TextStream(tokenizer, stop), [""]
    for token in ids:
        stream.push(token)
        shown.append(shown[-1] + stream.take())
        if stream.stopped:
            break
    stream.finish()
    shown.append(shown[-1] + stream.take(final=True))
    return stream, shown


def _expected_cut(tokenizer, ids, stop) -> str | None:
    """The text a stop string leaves, from the definitions: after the first push whose stable text (the
    decode so far, less a trailing incomplete character) holds some stop string, that text up to the
    earliest one; None when no stop string ever completes."""
    for k in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:k]).rstrip(REPLACEMENT_CHAR)
        starts = [i for i in (text.find(s) for s in stop) if i >= 0]
        if starts:
            return text[:min(starts)]
    return None


def test_text_equals_the_decode_of_its_tokens_when_no_stop_string_cut_it():
    """Property: with no stop string completing, the final text (and all the streamed pieces together) is
    exactly decode(token ids), a trailing incomplete character's U+FFFD included (the final flush is kept)."""
    rng = np.random.default_rng(6)
    tok, cut_short = ByteTokenizer(), 0
    for _ in range(500):
        ids = _byte_ids(rng, int(rng.integers(1, 40)))
        stop = () if rng.random() < 0.5 else ("z", "bz", "日z")  # stop strings that never complete: hold-back
        stream, shown = _stream(tok, ids, stop)
        assert not stream.stopped
        assert stream.text == shown[-1] == tok.decode(ids), ids
        cut_short += tok.decode(ids).endswith(REPLACEMENT_CHAR)
    assert cut_short > 50, cut_short  # the flush mattered often


@pytest.mark.parametrize("tokenizer", [ByteTokenizer(), PieceTokenizer()], ids=["bytes", "pieces"])
def test_several_stop_strings_never_show_a_prefix_of_the_one_that_completes(tokenizer):
    """Property: with several overlapping stop strings, what a stream has shown is at every moment a prefix of
    its final text; the final text is the decoded text up to the earliest stop string (none in it), or all
    of it when none completes."""
    rng = np.random.default_rng(7)
    stopped = 0
    for _ in range(600):
        if isinstance(tokenizer, ByteTokenizer):
            ids = _byte_ids(rng, int(rng.integers(1, 30)))
        else:
            ids = [int(i) for i in rng.integers(0, len(PieceTokenizer.PIECES), size=int(rng.integers(1, 15)))]
        stop = _stop_strings(rng)
        stream, shown = _stream(tokenizer, ids, stop)
        want = _expected_cut(tokenizer, ids, stop)
        ctx = (ids, stop, shown)
        assert stream.stopped == (want is not None), ctx
        final = tokenizer.decode(ids) if want is None else want
        assert stream.text == shown[-1] == final, ctx
        assert all(final.startswith(s) for s in shown), ctx
        assert not any(s in final for s in stop), ctx
        stopped += stream.stopped
    assert 100 < stopped < 550, stopped  # both outcomes, many times
