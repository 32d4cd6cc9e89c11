"""How one request samples and when it stops: `SamplingParams`, plain values (no jax).

The device sampler (jaxllm.executor.sampler, jaxllm.executor.penalties) reads these per row; the scheduler
and the request checks read them on the host.

Penalties and logit bias follow vLLM (its sampler's order and formulas), applied to the logits of the token
being sampled, in this order, before temperature, top-k and top-p (and before the greedy argmax):
  1. logit_bias: logits[t] += bias[t] for each (token id t, bias) given, bias in [-100, 100];
  2. repetition_penalty r > 0 (1: off): for every token t of the prompt or of the generated tokens,
     logits[t] = logits[t] / r if logits[t] > 0 else logits[t] * r;
  3. frequency_penalty f and presence_penalty p in [-2, 2] (0: off): logits[t] -= f * c[t] + p * (c[t] > 0),
     c[t] the number of times t occurs among the sequence's generated tokens (not the prompt's).
Log-probabilities (logprobs, prompt_logprobs) stay those of the model's raw distribution, before any of this
(vLLM's default, logprobs_mode "raw_logprobs").
"""

from __future__ import annotations

import dataclasses
import math
import numbers

SEED_LIMIT = 2**31  # seeds are in [0, SEED_LIMIT): they travel as int32
PENALTY_LIMIT = 2.0  # frequency_penalty and presence_penalty are in [-PENALTY_LIMIT, PENALTY_LIMIT] (OpenAI, vLLM)
BIAS_LIMIT = 100.0  # each logit_bias value is in [-BIAS_LIMIT, BIAS_LIMIT] (OpenAI)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False  # EOS only: stop_token_ids still stop
    stop_token_ids: tuple[int, ...] = ()  # token ids that end the request like EOS (not appended)
    # None: off. k >= 0: each new token's log-probability and the k most likely tokens' (id, logprob),
    # of the model's distribution before temperature/top-k/top-p (as OpenAI and vLLM report them).
    logprobs: int | None = None
    # None: off. k >= 0: the same for every prompt token after the first (its log-probability given the tokens
    # before it, and the k most likely there), computed in the prefill steps that run anyway; such a request
    # takes nothing from the prefix cache (its prompt's logits must be computed). With it, max_new_tokens may
    # be 0: the prompt is scored and nothing is generated (OpenAI's echo with max_tokens 0).
    prompt_logprobs: int | None = None
    # The module docstring gives their semantics (vLLM's). frequency and presence penalties count generated
    # tokens, the repetition penalty sees the prompt's and the generated ones: such a request holds a row of its
    # instance's penalty state while it runs (`penalized`). logit_bias: (token id, bias) pairs, a dict accepted;
    # kept sorted by token id.
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Speculative decoding on an engine that has it (EngineOptions.speculative): None takes the engine's k, 0 turns
    # it off for this request, k > 0 asks for at most k draft tokens a step (at most the engine's; checked by
    # jaxllm.engine.requests). Output is the same either way (greedy: the same tokens; sampled: the same
    # distribution); a penalized request never speculates.
    num_speculative_tokens: int | None = None

    @property
    def penalized(self) -> bool:
        """Some penalty is on (frequency, presence or repetition): the request needs a row of penalty state."""
        return self.frequency_penalty != 0 or self.presence_penalty != 0 or self.repetition_penalty != 1

    def __post_init__(self):
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if self.max_new_tokens == 0 and self.prompt_logprobs is None:
            raise ValueError("max_new_tokens 0 generates nothing: it is only for scoring a prompt (prompt_logprobs "
                             "set); ask for at least 1 token")
        if not (isinstance(self.temperature, (int, float)) and self.temperature >= 0 and self.temperature < float("inf")):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (an integer; 0 disables it), got {self.top_k!r}")
        if not (isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not (0 <= self.seed < SEED_LIMIT):
            raise ValueError(f"seed must be in [0, 2**31) (an integer), got {self.seed!r}")
        stop = self.stop
        if stop is None:
            stop = ()
        elif isinstance(stop, str):
            stop = (stop,)
        try:
            stop = tuple(stop)
        except TypeError:
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}") from None
        for s in stop:
            if not isinstance(s, str) or not s:
                # "" and [""] alike: an empty stop string would end every request at once.
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
        object.__setattr__(self, "stop", stop)
        ids = () if self.stop_token_ids is None else self.stop_token_ids
        try:
            ids = tuple(ids)
        except TypeError:
            raise ValueError(f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}") from None
        for t in ids:
            # numpy integers are fine; bools and floats are almost certainly a caller's mistake.
            if isinstance(t, bool) or not isinstance(t, numbers.Integral) or t < 0:
                raise ValueError(f"stop_token_ids must be non-negative integers, got {t!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in ids))
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0):
                raise ValueError(f"{name} must be None (off) or an integer >= 0, got {value!r}")
            if value is not None:
                object.__setattr__(self, name, int(value))
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -PENALTY_LIMIT <= value <= PENALTY_LIMIT:
                raise ValueError(f"{name} must be in [-{PENALTY_LIMIT:g}, {PENALTY_LIMIT:g}] (0 disables it), "
                                 f"got {value!r}")
            object.__setattr__(self, name, float(value))
        if not _is_number(self.repetition_penalty) or not 0 < self.repetition_penalty < math.inf:
            raise ValueError(f"repetition_penalty must be a finite number > 0 (1 disables it), "
                             f"got {self.repetition_penalty!r}")
        object.__setattr__(self, "repetition_penalty", float(self.repetition_penalty))
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        k = self.num_speculative_tokens
        if k is not None and (isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 0):
            raise ValueError(f"num_speculative_tokens must be None (the engine's), 0 (off) or an integer > 0, got {k!r}")
        if k is not None:
            object.__setattr__(self, "num_speculative_tokens", int(k))


def _is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def _logit_bias(value) -> tuple[tuple[int, float], ...]:
    """logit_bias as sorted (token id, bias) pairs, from a dict or pairs; ValueError naming the bad entry."""
    if value is None:
        return ()
    pairs = value.items() if isinstance(value, dict) else value
    try:
        pairs = [tuple(pair) for pair in pairs]
    except TypeError:
        raise ValueError(f"logit_bias must map token ids to biases, got {value!r}") from None
    seen = set()
    for pair in pairs:
        if len(pair) != 2:
            raise ValueError(f"logit_bias entries are (token id, bias) pairs, got {pair!r}")
        token, bias = pair
        if isinstance(token, bool) or not isinstance(token, numbers.Integral) or token < 0:
            raise ValueError(f"logit_bias: {token!r} is not a token id (an integer >= 0)")
        if not _is_number(bias) or not -BIAS_LIMIT <= bias <= BIAS_LIMIT:
            raise ValueError(f"logit_bias[{token}]: the bias must be in [-{BIAS_LIMIT:g}, {BIAS_LIMIT:g}], "
                             f"got {bias!r}")
        if int(token) in seen:
            raise ValueError(f"logit_bias names token {int(token)} twice")
        seen.add(int(token))
    return tuple(sorted((int(token), float(bias)) for token, bias in pairs))
