"""EngineCore: cancelling a running request, counted in engine steps (not seconds); the plan of each step it
recorded."""

from jaxllm import LLM, EngineOptions
from jaxllm.engine.core import Request
from jaxllm.contract import SamplingParams


def test_cancel_frees_rblocks_within_one_step_and_stops_tokens():
    llm = LLM("tiny", max_context=128, options=EngineOptions(block_size=4, max_tokens_per_step=32), progress=False)
    core, allocator = llm.core, llm.scheduler.allocator
    params = SamplingParams(max_new_tokens=100, ignore_eos=True)
    victim = core.add(Request(llm.tokenizer.encode("cancel me"), params))
    other = core.add(Request(llm.tokenizer.encode("keep me"), SamplingParams(max_new_tokens=6, ignore_eos=True)))
    seen = {victim: 0, other: 0}
    assert core.last_plan is None
    kinds = []
    for _ in range(4):  # prefill, then decode steps with a continuation in flight
        for out in core.step():
            seen[out.request_id] += len(out.token_ids)
        kinds.append(core.last_plan.kind.label)  # the plan of the step just recorded
    assert kinds == ["prefill", "decode", "decode", "decode"]
    assert seen[victim] >= 2 and core.has_step_in_flight()
    held = allocator.num_blocks - allocator.num_free
    final = core.cancel(victim)
    assert final.finish_reason == "cancelled" and final.request_id == victim
    assert core.cancel(victim) is None  # once only
    assert allocator.num_blocks - allocator.num_free < held  # freed at once, with a step still in flight
    after = []
    steps = 0
    while core.has_work():
        after += core.step()
        steps += 1
        assert steps <= 6, "the other request should end within its 6 tokens"
    assert all(out.request_id == other for out in after), "the cancelled request produced more output"
    assert allocator.num_free == allocator.num_blocks and not core.has_step_in_flight()
    assert core.stats().core.requests_cancelled == 1 and core.num_requests == 0
