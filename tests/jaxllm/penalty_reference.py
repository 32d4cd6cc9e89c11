"""The documented semantics of penalties and logit bias (jaxllm.contract.sampling_params: vLLM's) in float64 NumPy,
and a check that an engine's greedy tokens are what they give over the model's teacher-forced logits."""

from __future__ import annotations

import numpy as np

from jaxllm.contract import SamplingParams
from tests.jaxllm.tokens import TIE


def penalized_logits(logits: np.ndarray, prompt: list[int], generated: list[int], frequency: float = 0.0,
                     presence: float = 0.0, repetition: float = 1.0, bias: dict[int, float] | None = None
                     ) -> np.ndarray:
    """One row's logits [vocab] after logit bias, then the repetition penalty over prompt and generated tokens,
    then frequency and presence penalties over the generated tokens' counts (float64)."""
    z = logits.astype(np.float64).copy()
    for token, b in (bias or {}).items():
        z[token] += b
    counts = np.bincount(np.asarray(generated, np.int64), minlength=len(z)).astype(np.float64)
    seen = counts > 0
    seen[np.asarray(prompt, np.int64)] = True
    z = np.where(seen, np.where(z > 0, z / repetition, z * repetition), z)
    return z - frequency * counts - presence * (counts > 0)


def assert_greedy_replays(llm, prompt: list[int], generated: list[int], params: SamplingParams) -> int:
    """Replay a greedy completion: at every step the token taken is the argmax of the reference's penalized
    logits, computed from the model's teacher-forced logits (LLM.logits of prompt + the tokens before it), up to a
    tie (the engine's logits come from other step shapes: tests/jaxllm/tokens.py). Returns how many steps had a
    clear winner, all of which must match exactly."""
    logits = llm.logits(prompt + generated)[len(prompt) - 1:len(prompt) - 1 + len(generated)]
    clear = 0
    for i, token in enumerate(generated):
        want = penalized_logits(logits[i], prompt, generated[:i], params.frequency_penalty, params.presence_penalty,
                                params.repetition_penalty, dict(params.logit_bias))
        tol = TIE * max(params.repetition_penalty, 1.0)
        assert want[token] >= want.max() - tol, (i, token, int(np.argmax(want)), want[token], want.max())
        if np.sort(want)[-2] < want.max() - tol:
            clear += 1
            assert token == int(np.argmax(want)), (i, token)
    return clear
