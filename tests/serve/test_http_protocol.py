"""The OpenAI API layer's pure parts, without a server: request parsing (chat templates: tests/jaxllm/model/test_chat.py)."""

from __future__ import annotations

import pytest

from serve.http.protocol import APIError, ChatCompletionRequest, CompletionRequest, parse


def test_parse_prompts_and_ignores_unknown_fields():
    r = parse(CompletionRequest, {"model": "m", "prompt": "hi", "temperature": 1, "unknown": {"x": 1}})
    assert r.prompts() == ["hi"] and r.temperature == 1.0
    assert parse(CompletionRequest, {"model": "m", "prompt": [1, 2]}).prompts() == [[1, 2]]
    assert parse(CompletionRequest, {"model": "m", "prompt": [[1], [2, 3]]}).prompts() == [[1], [2, 3]]
    assert parse(CompletionRequest, {"model": "m", "prompt": ["a", "b"], "stop": "x"}).stops() == ("x",)
    chat = parse(ChatCompletionRequest, {"model": "m", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "name": "u"}]})
    assert chat.messages[0].text() == "ab"


@pytest.mark.parametrize("body, param, message", [
    ({"prompt": "x"}, "model", "model is required"),
    ({"model": "m", "prompt": "x", "temperature": "hot"}, "temperature", "temperature: input should be a valid number"),
    ({"model": "m", "prompt": 5}, "prompt", "prompt: input should be"),
    ({"model": "m", "prompt": "x", "n": 1.5}, "n", "n: input should be a valid integer"),
    ({"model": "m", "prompt": "x", "stream": "yes"}, "stream", "stream: input should be a valid boolean"),
    ({"model": "m", "messages": [{"role": "user", "content": 3}]}, "messages[0].content", "messages[0].content:"),
])
def test_parse_names_the_bad_field(body, param, message):
    model = ChatCompletionRequest if "messages" in body else CompletionRequest
    with pytest.raises(APIError) as err:
        parse(model, body)
    assert (err.value.status, err.value.param) == (400, param) and message in err.value.message


def test_unsupported_fields_are_refused_not_ignored():
    for fields, message in [({"best_of": 3}, "best_of is not supported"),
                            ({"max_tokens": 3, "max_completion_tokens": 4}, "disagree")]:
        r = parse(CompletionRequest, {"model": "m", "prompt": "x", **fields})
        with pytest.raises(APIError, match=message):
            r.unsupported()
            r.output_limit()
    parse(CompletionRequest, {"model": "m", "prompt": "x", "frequency_penalty": 0, "best_of": 1}).unsupported()
    # Penalties are served (tests/serve/test_penalties.py): parsed into the engine's arguments, not refused.
    penalized = parse(CompletionRequest, {"model": "m", "prompt": "x", "frequency_penalty": 0.5, "presence_penalty": 1,
                                          "repetition_penalty": 1.1, "logit_bias": {"12": -100, "0": 3}})
    penalized.unsupported()
    assert penalized.penalties() == dict(frequency_penalty=0.5, presence_penalty=1.0, repetition_penalty=1.1,
                                         logit_bias={12: -100.0, 0: 3.0})
    echo = parse(CompletionRequest, {"model": "m", "prompt": "x", "echo": True, "logprobs": 2})
    echo.unsupported()  # echo with logprobs is supported: the prompt's tokens are scored
    assert echo.prompt_logprobs_wanted() == 2


def test_logprobs_wanted_in_both_shapes():
    """completions: logprobs k; chat: logprobs true with top_logprobs k (0 when unset); each names its field."""
    completion = lambda **f: parse(CompletionRequest, {"model": "m", "prompt": "x", **f})  # noqa: E731
    chat = lambda **f: parse(ChatCompletionRequest, {"model": "m", "messages": [], **f})  # noqa: E731
    assert completion().logprobs_wanted() == (None, "logprobs")
    assert completion(logprobs=0).logprobs_wanted() == (0, "logprobs")
    assert completion(logprobs=4).logprobs_wanted() == (4, "logprobs")
    assert chat().logprobs_wanted() == (None, "logprobs")
    assert chat(logprobs=False).logprobs_wanted() == (None, "logprobs")
    assert chat(logprobs=True).logprobs_wanted() == (0, "logprobs")
    assert chat(logprobs=True, top_logprobs=3).logprobs_wanted() == (3, "top_logprobs")
    for request, message, param in [(completion(logprobs=-1), "logprobs must be >= 0", "logprobs"),
                                    (completion(top_logprobs=2), "chat completions field", "top_logprobs"),
                                    (chat(top_logprobs=2), "top_logprobs needs logprobs: true", "top_logprobs"),
                                    (chat(logprobs=True, top_logprobs=-1), "top_logprobs must be >= 0",
                                     "top_logprobs")]:
        with pytest.raises(APIError, match=message) as err:
            request.logprobs_wanted()
        assert (err.value.status, err.value.param) == (400, param)


@pytest.mark.parametrize("body, param, message", [
    ({"prompt": [1.5]}, "prompt", "prompt[0]: 1.5 is not a token id (an integer)"),
    ({"prompt": [1, "a"]}, "prompt", "prompt[1]: 'a' is not a token id (an integer); a list prompt holds strings or "
                                     "token ids, not both"),
    ({"prompt": ["a", 1]}, "prompt", "prompt[1]: 1 is not a string; a list prompt holds strings or token ids, "
                                     "not both"),
    ({"prompt": [[1, 2], [3, True]]}, "prompt", "prompt[1][1]: true is not a token id (an integer)"),
    ({"prompt": [[1], "a"]}, "prompt", "prompt[1]: 'a' is not a list of token ids, as prompt[0] is"),
    ({"prompt": None}, "prompt", "prompt: input should be a string, a list of strings, a list of token ids or a list "
                                 "of lists of token ids (got null)"),
    ({"prompt": "x", "stop": [None]}, "stop", "stop[0] must be a string, got null"),
    ({"prompt": "x", "stop": ["a", 3]}, "stop", "stop[1] must be a string, got 3"),
    ({"prompt": "x", "stop": {"a": 1}}, "stop", "stop: input should be a string or a list of strings (got an object)"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]},
     "messages[0].content", "messages[0].content[0]: content parts of type image_url are not supported; only text"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text"}]}]},
     "messages[0].content", "messages[0].content[1].text must be a string, got null"),
    ({"messages": [{"role": "user", "content": ["a"]}]}, "messages[0].content",
     'messages[0].content[0]: a content part is an object like {"type": "text", "text": ...}, got \'a\''),
])
def test_type_errors_name_the_actual_problem(body, param, message):
    """Not pydantic's first union branch ("input should be a valid string (got list)"): the element at fault
    and what is wrong with it."""
    model = ChatCompletionRequest if "messages" in body else CompletionRequest
    with pytest.raises(APIError) as err:
        parse(model, {"model": "m", **body})
    assert (err.value.status, err.value.param, err.value.message) == (400, param, message)
