"""Request limits: every limit on both sides (at the limit accepted, one past refused), and the Python
API, the threaded Engine and the gRPC adapter agreeing on the same prompts (max_context=64)."""

import ast
import pathlib
import types

import numpy as np
import pytest

from jaxllm import LLM, EngineOptions
from jaxllm.engine.requests import RequestLimits, check_params, prompt_token_ids, sampling_params
from jaxllm.contract import SamplingParams

LIMITS = RequestLimits(context_limit=64, vocab_size=259, default_max_tokens=16, max_stop_strings=3, max_stop_length=5)


def test_prompt_length_limit_both_sides():
    assert len(prompt_token_ids([7] * 63, None, LIMITS)) == 63
    with pytest.raises(ValueError, match="64 tokens, more than the context limit 64 allows: a prompt may have at most 63"):
        prompt_token_ids([7] * 64, None, LIMITS)


def test_vocabulary_both_sides():
    assert prompt_token_ids([0, 258], None, LIMITS) == [0, 258]
    for bad in (259, -1):
        with pytest.raises(ValueError, match=rf"prompt\[1\]: token id {bad} is outside the vocabulary \[0, 259\)"):
            prompt_token_ids([0, bad], None, LIMITS)
    with pytest.raises(ValueError, match="prompt is empty"):
        prompt_token_ids([], None, LIMITS)
    with pytest.raises(ValueError, match="prompt is empty"):
        prompt_token_ids("", None, LIMITS)


def test_max_tokens_equal_to_the_room_is_accepted_one_more_refused():
    assert sampling_params(LIMITS, 60, max_tokens=4).max_new_tokens == 4
    with pytest.raises(ValueError, match="max_tokens 5 is over the limit 4: the context limit 64 minus the prompt's 60"):
        sampling_params(LIMITS, 60, max_tokens=5)
    assert sampling_params(LIMITS, 63, max_tokens=1).max_new_tokens == 1
    with pytest.raises(ValueError, match="max_tokens must be >= 1, got 0"):
        sampling_params(LIMITS, 10, max_tokens=0)


def test_default_max_tokens_is_capped_at_the_room():
    assert sampling_params(LIMITS, 10).max_new_tokens == 16
    assert sampling_params(LIMITS, 60).max_new_tokens == 4


def test_stop_string_count_and_length_both_sides():
    assert sampling_params(LIMITS, 1, stop=["a", "b", "c"]).stop == ("a", "b", "c")
    with pytest.raises(ValueError, match="stop has 4 strings, over the limit 3"):
        sampling_params(LIMITS, 1, stop=["a", "b", "c", "d"])
    assert sampling_params(LIMITS, 1, stop="abcde").stop == ("abcde",)
    with pytest.raises(ValueError, match="stop\\[0\\] has 6 characters, over the limit 5"):
        sampling_params(LIMITS, 1, stop="abcdef")


@pytest.mark.parametrize("stop", ["", [""], ["ok", ""]])
def test_an_empty_stop_string_is_refused_however_written(stop):
    with pytest.raises(ValueError, match="is empty; stop strings must be non-empty"):
        sampling_params(LIMITS, 1, stop=stop)
    with pytest.raises(ValueError, match="stop strings must be non-empty"):
        SamplingParams(stop=stop)


def test_check_params_applies_the_same_rules_to_built_params():
    assert check_params(SamplingParams(max_new_tokens=4), 60, LIMITS).max_new_tokens == 4
    with pytest.raises(ValueError, match="over the limit 4"):
        check_params(SamplingParams(max_new_tokens=5), 60, LIMITS)
    with pytest.raises(ValueError, match="over the limit 3"):
        check_params(SamplingParams(max_new_tokens=4, stop=("a", "b", "c", "d")), 1, LIMITS)


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny", max_context=64, options=EngineOptions(block_size=4, max_tokens_per_step=32), progress=False)


def _grpc_request(prompt_ids, max_tokens=None):
    """A stand-in for pb.GenerateRequest with the fields the adapter reads (no grpc import needed)."""
    fields = dict(prompt="", prompt_token_ids=list(prompt_ids), temperature=0.0, top_k=0, seed=0, stop=[],
                  ignore_eos=False, max_tokens=max_tokens, top_p=1.0, frequency_penalty=0.0, presence_penalty=0.0,
                  repetition_penalty=1.0, logit_bias={})
    request = types.SimpleNamespace(**fields)
    request.HasField = lambda name: name == "max_tokens" and max_tokens is not None
    return request


def test_python_api_engine_and_grpc_agree_at_max_context_64(llm):
    """With max_context=64 the same prompt lengths and max_tokens are accepted and refused everywhere."""
    validation = pytest.importorskip("serve.validation")
    from jaxllm.engine.threaded import Engine

    assert llm.context_limit == 64
    engine = Engine(llm.core, llm.tokenizer, llm.info())
    limits = engine.limits
    try:
        for n, max_tokens, ok in ((63, 1, True), (64, 1, False), (60, 4, True), (60, 5, False)):
            ids = [7] * n
            outcomes = []
            for call in (lambda: llm.generate([ids], max_new_tokens=max_tokens),
                         lambda: list(engine.submit(ids, SamplingParams(max_new_tokens=max_tokens))),
                         lambda: validation.to_engine_request(_grpc_request(ids, max_tokens), None, limits)):
                try:
                    call()
                    outcomes.append(True)
                except ValueError:
                    outcomes.append(False)
            assert outcomes == [ok] * 3, (n, max_tokens, outcomes)
    finally:
        engine.shutdown(grace_s=5.0)
    out = llm.generate([[7] * 60], max_new_tokens=4, ignore_eos=True)[0]
    assert len(out.token_ids) == 4 and out.finish_reason == "length"  # the whole room is usable


def test_text_prompt_at_the_limit(llm):
    text = "x" * 62  # 63 tokens with BOS
    assert len(llm.tokenizer.encode(text)) == 63
    assert len(llm.generate(text, max_new_tokens=1)[0].token_ids) <= 1
    with pytest.raises(ValueError, match="more than the context limit 64"):
        llm.generate(text + "x", max_new_tokens=1)
    with pytest.raises(ValueError, match="max_new_tokens 2 is over the limit 1"):
        llm.generate(text, max_new_tokens=2)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        llm.stream(text, max_new_tokens=0)  # checked at the call, before any iteration
    assert not llm.scheduler.has_work()


def test_request_limits_come_from_the_options():
    options = EngineOptions(block_size=4, max_tokens_per_step=32, default_max_tokens=3, max_stop_strings=20,
                            max_stop_length=8, max_logprobs=2)
    llm = LLM("tiny", max_context=64, options=options, progress=False)
    assert llm.limits == RequestLimits(context_limit=64, vocab_size=llm.config.vocab_size, default_max_tokens=3,
                                       max_stop_strings=20, max_stop_length=8, max_logprobs=2)
    assert llm.core.limits is llm.limits
    assert len(llm.generate("a", max_new_tokens=1, stop=["s"] * 20)) == 1
    with pytest.raises(ValueError, match="stop has 21 strings, over the limit 20"):
        llm.generate("a", max_new_tokens=1, stop=["s"] * 21)


@pytest.mark.parametrize("name", ["default_max_tokens", "max_stop_strings", "max_stop_length"])
def test_options_refuse_a_request_limit_below_one(name):
    with pytest.raises(ValueError, match=f"{name} must be a positive integer, got 0"):
        EngineOptions(**{name: 0})


def test_request_limits_are_built_in_one_place():
    """The builder builds the one RequestLimits from its options; front ends read it (Engine.limits), never build their own."""
    root = pathlib.Path(__file__).resolve().parents[3]
    built = []
    for package in ("jaxllm", "serve", "scripts"):
        for path in sorted((root / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Call) and ast.unparse(node.func).split(".")[-1] == "RequestLimits":
                    built.append(path.relative_to(root).as_posix())
    assert built == ["jaxllm/builder.py"]


def test_every_entry_point_takes_a_prompt_of_exactly_the_allowance(llm):
    """Property, over random prompts (token ids and text): LLM.generate, LLM.stream, the threaded Engine, the HTTP
    adapter and the gRPC adapter each run a prompt of context_limit - 1 tokens, and LLM.logits takes
    context_limit tokens; one token more is refused by each with a ValueError naming the context limit."""
    validation = pytest.importorskip("serve.validation")
    engine_adapter = pytest.importorskip("serve.http.engine_adapter")
    from jaxllm.engine.threaded import Engine

    rng = np.random.default_rng(12)
    limit = llm.context_limit
    engine = Engine(llm.core, llm.tokenizer, llm.info())
    http = engine_adapter.EngineAdapter(engine, "tiny")
    grpc_limits = engine.limits
    one = SamplingParams(max_new_tokens=1)
    try:
        prompts = [rng.integers(0, llm.config.vocab_size, size=limit - 1).tolist() for _ in range(2)]
        prompts.append("".join(rng.choice(list("abc é"), size=limit)))  # text: BOS, then its UTF-8 bytes
        for prompt in prompts:
            if isinstance(prompt, str):  # cut to exactly the allowance once encoded
                while len(llm.tokenizer.encode(prompt)) > limit - 1:
                    prompt = prompt[:-1]
                longer = prompt + "a"
                assert len(llm.tokenizer.encode(prompt)) == limit - 1 == len(llm.tokenizer.encode(longer)) - 1
            else:
                longer = prompt + [7]
            out = llm.generate(prompt, max_new_tokens=1)[0]
            assert len(out.token_ids) <= 1 and out.finish_reason in ("length", "stop")
            assert "".join(llm.stream(prompt, max_new_tokens=1)) == out.text
            events = list(engine.submit(prompt, one))
            assert events[-1].error is None and events[-1].prompt_tokens == limit - 1, events[-1]
            ids, params = http.check(prompt, engine_adapter.Sampling())
            assert len(ids) == limit - 1 and params.max_new_tokens == 1  # the default, capped at the room
            (stream,) = http.submit([(ids, params)])
            assert list(stream)[-1].error is None
            if not isinstance(prompt, str):
                assert len(validation.to_engine_request(_grpc_request(prompt), None, grpc_limits)[0]) == limit - 1
            refusals = [lambda: llm.generate(longer, max_new_tokens=1), lambda: llm.stream(longer, max_new_tokens=1),
                        lambda: engine.submit(longer, one), lambda: http.check(longer, engine_adapter.Sampling())]
            if not isinstance(prompt, str):
                refusals.append(lambda: validation.to_engine_request(_grpc_request(longer), None, grpc_limits))
            for refuse in refusals:
                with pytest.raises(ValueError, match=f"has {limit} tokens, more than the context limit {limit} allows"):
                    refuse()
        for _ in range(2):
            ids = rng.integers(0, llm.config.vocab_size, size=limit).tolist()
            assert llm.logits(ids).shape == (limit, llm.config.vocab_size)
            with pytest.raises(ValueError, match=f"has {limit + 1} tokens, more than the context limit {limit}"):
                llm.logits(ids + [7])
    finally:
        engine.shutdown(grace_s=5.0)
    stats = llm.core.stats()
    assert not llm.scheduler.has_work() and stats.scheduler.pool_blocks_free == stats.scheduler.pool_blocks


def test_a_request_is_checked_once_on_its_way_in(llm, monkeypatch):
    """The front end checks a request against the one RequestLimits; the core, seeing it was checked against
    its own limits, does not check it again (a request built by hand is checked by the core)."""
    from jaxllm.engine import requests as requests_module
    from jaxllm.engine.core import Request
    from jaxllm.engine.threaded import Engine

    checks = []
    real = requests_module.check_length
    monkeypatch.setattr(requests_module, "check_length", lambda *a, **k: checks.append(1) or real(*a, **k))
    llm.generate([5, 6, 7], max_new_tokens=1)
    assert len(checks) == 1
    checks.clear()
    llm.run([Request([5, 6, 7], SamplingParams(max_new_tokens=1))])  # not checked by a front end: the core does
    assert len(checks) == 1
    engine = Engine(llm.core, llm.tokenizer, llm.info())
    try:
        checks.clear()
        assert list(engine.submit([5, 6, 7], SamplingParams(max_new_tokens=1)))[-1].error is None
        assert len(checks) == 1
    finally:
        engine.shutdown(grace_s=5.0)
