"""How one request samples and when it stops: `SamplingParams`, plain values (no jax).

The device sampler (jaxllm.executor.sampler) reads these per row; the scheduler and the request
checks read them on the host.
"""

from __future__ import annotations

import dataclasses
import numbers

SEED_LIMIT = 2**31  # seeds are in [0, SEED_LIMIT): they travel as int32


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
