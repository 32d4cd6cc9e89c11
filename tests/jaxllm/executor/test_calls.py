"""StepCall's words: what process 0 sends its followers names the same call on the other side, for every op, kind and
variant flag (a word dropped or read in the wrong place would run another program there)."""

import itertools

import numpy as np

from jaxllm.contract import StepKind
from jaxllm.executor.calls import Op, StepCall, TokenSource


def test_every_call_survives_the_wire():
    calls = [StepCall(op, kind, greedy, logprobs, variant, borrowed, source)
             for op, kind, greedy, logprobs, variant, borrowed, source in itertools.product(
                 Op, StepKind, (False, True), (False, True), (0, 3), (False, True), TokenSource)]
    words = [call.to_wire() for call in calls]
    assert all(w.dtype == np.int32 and w.shape == (7,) for w in words)
    assert [StepCall.from_wire(w) for w in words] == calls
    assert len({tuple(w) for w in words}) == len(calls)  # no two calls share their words


def test_a_call_names_its_program():
    assert StepCall(Op.STEP, StepKind.DECODE).program == "decode"
    assert StepCall(Op.STEP, StepKind.PREFILL).program == "prefill"
    assert StepCall(Op.LOGITS).program == "logits" and StepCall(Op.COPY).program == "copy"
    assert [StepKind.from_wire(k.wire) for k in StepKind] == list(StepKind)
    assert StepKind.from_label("decode") is StepKind.DECODE and not StepKind.DECODE == True  # noqa: E712
