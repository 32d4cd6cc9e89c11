"""The output processor alone, with a fake tokenizer of single-character tokens (no model, no device)."""

import pytest

from jaxllm.engine.output import RequestClock, TextStream

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
