"""The threaded Engine over an EngineCore: built from the core, the tokenizer and the EngineInfo (no LLM),
it shows front ends the core's one RequestLimits, its streams yield the core's RequestOutputs, and a group of
requests is queued all together or not at all."""

import ast
import dataclasses
import inspect
import pathlib

import pytest

from jaxllm import LLM, EngineOptions
from jaxllm.engine.core import Request, RequestOutput
from jaxllm.contract import SamplingParams
from jaxllm.engine.threaded import Engine, EngineStopped, QueueFull


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny", max_context=64, options=EngineOptions(block_size=4, max_tokens_per_step=32), progress=False)


@pytest.fixture
def engine(llm):
    engine = Engine(llm.core, llm.tokenizer, llm.info(), max_waiting=2)
    yield engine
    engine.shutdown(grace_s=5.0)


def test_engine_shows_the_cores_tokenizer_limits_and_info(llm, engine):
    assert engine.tokenizer is llm.tokenizer and engine.limits is llm.limits is llm.core.limits
    assert engine.info() == dataclasses.replace(llm.info(), max_queue=2)
    text = "a short prompt"
    stream = engine.submit(text, SamplingParams(max_new_tokens=2, ignore_eos=True))
    assert stream.prompt_tokens == len(llm.tokenizer.encode(text))
    assert sum(len(event.token_ids) for event in stream) == 2


def test_info_of_another_engine_is_refused(llm):
    with pytest.raises(ValueError, match="context limit 32 and vocabulary 259, where the core's limits have 64"):
        Engine(llm.core, llm.tokenizer, dataclasses.replace(llm.info(), context_limit=32))


def test_streams_yield_the_cores_outputs_under_the_engines_ids(llm):
    prompts = [[5, 6, 7], [9] * 10]
    reference = llm.generate(prompts, max_new_tokens=4, ignore_eos=True)  # before the engine thread drives the core
    engine = Engine(llm.core, llm.tokenizer, llm.info())
    try:
        streams = [engine.submit(p, SamplingParams(max_new_tokens=4, ignore_eos=True)) for p in prompts]
        outputs = [list(stream) for stream in streams]
    finally:
        engine.shutdown(grace_s=5.0)
    assert streams[0].request_id != streams[1].request_id
    for prompt, stream, outs, ref in zip(prompts, streams, outputs, reference):
        assert all(type(o) is RequestOutput and o.request_id == stream.request_id and o.error is None for o in outs)
        assert [t for o in outs for t in o.token_ids] == ref.token_ids
        assert "".join(o.text for o in outs) == ref.text
        assert all(o.finish_reason is None for o in outs[:-1])
        last = outs[-1]
        assert (last.finish_reason, last.prompt_tokens, last.completion_tokens) == ("length", len(prompt), 4)
        assert last.timings is not None


def test_a_failed_step_ends_its_requests_with_one_error_output(llm, engine, monkeypatch):
    def dispatch(plan, *, token_source=None):
        raise RuntimeError("the device is gone")

    monkeypatch.setattr(llm.executor, "dispatch", dispatch)
    stream = engine.submit([5, 6, 7], SamplingParams(max_new_tokens=4))
    outputs = list(stream)
    assert len(outputs) == 1 and outputs[0].request_id == stream.request_id
    assert (outputs[0].finish_reason, outputs[0].error) == ("error", "RuntimeError: the device is gone")
    monkeypatch.undo()
    assert list(engine.submit([5, 6, 7], SamplingParams(max_new_tokens=2)))[-1].finish_reason in ("length", "stop")


def test_step_error_names_what_failed(llm, monkeypatch):
    """A multi-process server tells a failed step's requests which process died (jaxllm/serve.py's step_error)."""
    def dispatch(plan, *, token_source=None):
        raise ValueError("UNKNOWN: Gloo all-reduce failed: Connection closed by peer")

    monkeypatch.setattr(llm.executor, "dispatch", dispatch)
    engine = Engine(llm.core, llm.tokenizer, llm.info(), step_error=lambda e: "process 1 of 2 died")
    try:
        (output,) = list(engine.submit([5, 6, 7], SamplingParams(max_new_tokens=4)))
    finally:
        engine.shutdown(grace_s=5.0)
    assert (output.finish_reason, output.error) == ("error", "process 1 of 2 died")


def test_fail_ends_every_request_now_and_refuses_new_ones(llm, monkeypatch):
    """Engine.fail from another thread, while the engine's thread is blocked in a step that never returns
    (a collective that lost a peer): every stream ends at once with the error, new requests are refused."""
    import threading

    blocked, release = threading.Event(), threading.Event()
    dispatch = llm.executor.dispatch

    def stuck(plan, *, token_source=None):
        blocked.set()
        release.wait()
        return dispatch(plan, token_source=token_source)

    monkeypatch.setattr(llm.executor, "dispatch", stuck)
    engine = Engine(llm.core, llm.tokenizer, llm.info())
    try:
        streams = [engine.submit([5, 6, i], SamplingParams(max_new_tokens=4)) for i in range(2)]
        assert blocked.wait(30)
        engine.fail("process 1 of 2 died")
        for stream in streams:
            (output,) = list(stream)
            assert (output.request_id, output.finish_reason, output.error) == (stream.request_id, "error",
                                                                              "process 1 of 2 died")
        with pytest.raises(EngineStopped, match="process 1 of 2 died"):
            engine.submit([5], SamplingParams(max_new_tokens=1))
    finally:
        release.set()  # the step comes back (here it can): its outputs go nowhere, the thread ends
        engine.shutdown(grace_s=5.0)
    assert all(stream.finished.is_set() for stream in streams)


def test_submit_checked_queues_all_or_none(engine):
    before = engine.stats()
    requests = [Request([7, i], SamplingParams(max_new_tokens=1)) for i in range(3)]
    with pytest.raises(QueueFull, match=r"0 requests are already waiting \(limit 2\): no room for 3 more"):
        engine.submit_checked(requests)
    after = engine.stats()
    assert (after.core.requests_total, after.scheduler.waiting, after.scheduler.running) == \
           (before.core.requests_total, 0, 0)
    assert after.core.requests_rejected == before.core.requests_rejected + 3
    assert engine.idle()
    assert [list(s)[-1].finish_reason for s in engine.submit_checked(requests[:2])] == ["length"] * 2
    engine.stop_accepting()
    with pytest.raises(EngineStopped):
        engine.submit_checked(requests[:1])
    assert engine.stats().core.requests_total == before.core.requests_total + 2


def test_a_request_the_core_refuses_ends_with_one_error_output(engine):
    """submit_checked trusts its caller's check; the core checks again, and a refusal is the request's last
    output, not the engine's end."""
    bad = Request([7] * 60, SamplingParams(max_new_tokens=5))  # 60 + 5 > the context limit 64
    bad_stream, good_stream = engine.submit_checked([bad, Request([7] * 3, SamplingParams(max_new_tokens=2))])
    (output,) = list(bad_stream)
    assert (output.request_id, output.finish_reason) == (bad_stream.request_id, "error")
    assert "max_tokens 5 is over the limit 4" in output.error
    assert list(good_stream)[-1].finish_reason == "length"


# Public methods only tests call, and why they stay.
TEST_HOOKS = {"idle": "the check that nothing is left accepted or in flight (pipelining and queueing tests)"}


def test_every_public_method_is_used_by_the_packages():
    """No dead API: each public method of Engine is called somewhere in jaxllm/, serve/ or scripts/ (a
    name-based scan, so it can miss a method that shares a name with something else, never accuse one)."""
    root = pathlib.Path(__file__).resolve().parents[3]
    used = set()
    for package in ("jaxllm", "serve", "scripts"):
        for path in (root / package).rglob("*.py"):
            used |= {node.attr for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Attribute)}
    methods = {name for name, _ in inspect.getmembers(Engine, inspect.isfunction) if not name.startswith("_")}
    assert methods - used == set(TEST_HOOKS)
