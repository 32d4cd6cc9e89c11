"""serve/http/logprobs.py: the engine's per-token entries in OpenAI's completions and chat shapes, and vLLM's
prompt_logprobs."""

from serve.http.logprobs import chat_logprobs, completion_logprobs, prompt_logprobs, top_by_text

TEXT = {1: "a", 2: "bc", 3: "é"}
ENTRIES = [(-0.5, ((1, -0.5), (2, -1.5))), (-2.0, ((3, -0.25), (2, -2.0)))]


def test_completion_shape_and_offsets_go_on_across_chunks():
    first, offset = completion_logprobs([1], ENTRIES[:1], TEXT.get, 4)  # 4: echoed text before it
    assert first == {"tokens": ["a"], "token_logprobs": [-0.5], "top_logprobs": [{"a": -0.5, "bc": -1.5}],
                     "text_offset": [4]}
    second, offset = completion_logprobs([2], ENTRIES[1:], TEXT.get, offset)
    assert second["text_offset"] == [5] and offset == 7
    assert second["top_logprobs"] == [{"é": -0.25, "bc": -2.0}]


def test_legacy_dict_keeps_the_likelier_of_equal_texts():
    assert top_by_text([(7, -0.1), (8, -0.2), (1, -0.3)], {7: "?", 8: "?", 1: "a"}.get) == {"?": -0.1, "a": -0.3}


def test_chat_shape_with_bytes():
    out = chat_logprobs([1, 2], ENTRIES, TEXT.get)
    assert out["content"][0] == {"token": "a", "logprob": -0.5, "bytes": [97],
                                 "top_logprobs": [{"token": "a", "logprob": -0.5, "bytes": [97]},
                                                  {"token": "bc", "logprob": -1.5, "bytes": [98, 99]}]}
    assert out["content"][1]["top_logprobs"][0] == {"token": "é", "logprob": -0.25, "bytes": [0xC3, 0xA9]}
    assert chat_logprobs([], [], TEXT.get) == {"content": []}


def test_prompt_logprobs_ranks_count_from_one():
    """vLLM's convention: the most likely token's rank is 1, the k-th's k; a prompt token outside the k most likely
    has no known rank (null)."""
    text = {**TEXT, 4: "d"}
    out = prompt_logprobs([4, 1, 2, 4], [None, *ENTRIES, (-3.0, ((3, -0.1), (1, -0.2), (2, -0.3)))], text.get)
    assert out[0] is None
    assert out[1] == {"1": {"logprob": -0.5, "rank": 1, "decoded_token": "a"},
                      "2": {"logprob": -1.5, "rank": 2, "decoded_token": "bc"}}
    assert out[2] == {"2": {"logprob": -2.0, "rank": 2, "decoded_token": "bc"},
                      "3": {"logprob": -0.25, "rank": 1, "decoded_token": "é"}}
    assert {t: v["rank"] for t, v in out[3].items()} == {"4": None, "3": 1, "1": 2, "2": 3}
    assert out[3]["4"] == {"logprob": -3.0, "rank": None, "decoded_token": "d"}
