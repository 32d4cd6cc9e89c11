"""The HTTP front end's one window onto the engine: request checks, limits, model facts, load readings.

Everything the OpenAI API layer needs from `jaxllm` goes through `EngineAdapter`: the request checks
are jaxllm's own (`jaxllm.engine.requests`, the ones `LLM` and gRPC use, against the engine's one
`limits`, so every front end refuses the same requests with the same messages), and the model facts
and load readings come from the engine's `info()` / `stats()` snapshots.
"""

from __future__ import annotations

import dataclasses

from jaxllm.engine.core import Request
from jaxllm.engine.requests import RequestLimits, check_length, check_token_ids, prompt_token_ids, random_seed, \
    sampling_params
from jaxllm.contract import SEED_LIMIT, SamplingParams
from jaxllm.engine.threaded import Engine, EngineStopped, QueueFull, RequestStream
from jaxllm.model.chat import chat_prompt
from jaxllm.model.tokenizer import check_unicode

__all__ = ["EngineAdapter", "EngineStopped", "QueueFull", "RequestStream", "Sampling", "SEED_LIMIT", "random_seed"]


@dataclasses.dataclass(frozen=True)
class Sampling:
    """One engine request's sampling fields as the HTTP request gave them (None: the server's default)."""

    max_tokens: int | None = None
    temperature: float = 0.0
    top_p: float | None = None
    top_k: int = 0
    seed: int = 0
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # top tokens to return log-probabilities of; None: none
    logprobs_name: str = "logprobs"  # the request's field for it (chat: top_logprobs), for messages
    prompt_logprobs: int | None = None  # the same for the prompt's tokens (echo with logprobs, vLLM's extra)
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    num_speculative_tokens: int | None = None  # None: the engine's k; 0: off for this request


class EngineAdapter:
    """A loaded, warm engine as the OpenAI API sees it."""

    def __init__(self, engine: Engine, model_name: str):
        self.engine = engine
        self.model_name = model_name

    @property
    def limits(self) -> RequestLimits:
        """What one request may ask for: the engine's (EngineOptions' request limits, built once by LLM)."""
        return self.engine.limits

    @property
    def context_limit(self) -> int:
        """Prompt + output tokens one request may reach."""
        return self.limits.context_limit

    @property
    def vocab_size(self) -> int:
        return self.limits.vocab_size

    @property
    def max_waiting(self) -> int:
        """Engine requests the queue holds at once: one HTTP request's prompts x choices may be at most this."""
        return self.engine.max_waiting

    def check(self, prompt: str | list[int], sampling: Sampling) -> tuple[list[int], SamplingParams]:
        """(prompt token ids, SamplingParams), or a ValueError naming the field and the limit (-> 400)."""
        ids = prompt_token_ids(prompt, self.engine.tokenizer, self.limits)
        params = sampling_params(self.limits, len(ids), max_tokens=sampling.max_tokens,
                                 temperature=sampling.temperature, top_k=sampling.top_k,
                                 top_p=1.0 if sampling.top_p is None else sampling.top_p, seed=sampling.seed,
                                 stop=sampling.stop, ignore_eos=sampling.ignore_eos, logprobs=sampling.logprobs,
                                 prompt_logprobs=sampling.prompt_logprobs, logprobs_name=sampling.logprobs_name,
                                 frequency_penalty=sampling.frequency_penalty,
                                 presence_penalty=sampling.presence_penalty,
                                 repetition_penalty=sampling.repetition_penalty, logit_bias=sampling.logit_bias,
                                 num_speculative_tokens=sampling.num_speculative_tokens)
        return ids, params

    def chat_prompt(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text of chat messages under the checkpoint's own chat template (Llama-2's `[INST]`
        format without one): `LLM.chat`'s function; ValueError naming the bad message (-> 400)."""
        return chat_prompt(self.engine.tokenizer, messages, add_generation_prompt=add_generation_prompt)

    def tokenize(self, text: str, add_bos: bool = True) -> list[int]:
        """Token ids of any text (empty too), at most the context limit of them: a prompt's encoding, as
        generation encodes it, or a ValueError naming the count and the limit (-> 400)."""
        ids = self.engine.tokenizer.encode(check_unicode(text, "prompt"), add_bos=add_bos)
        return check_length(ids, self.limits, "prompt", max_tokens=self.context_limit)

    def detokenize(self, ids: list[int]) -> str:
        """Text of token ids (empty too): in the vocabulary and at most the context limit of them, or a
        ValueError naming the id or the count and the limit (-> 400)."""
        if ids:
            check_token_ids(ids, self.limits, "tokens", max_tokens=self.context_limit)
        return self.engine.tokenizer.decode(ids)

    def decode(self, ids: list[int]) -> str:
        """Text of token ids (for `echo` of a token-id prompt)."""
        return self.engine.tokenizer.decode(ids)

    def token_text(self, token_id: int) -> str:
        """One token's text, decoded alone (log-probability entries name tokens by it)."""
        return self.engine.tokenizer.decode([token_id])

    def submit(self, checked: list[tuple[list[int], SamplingParams]]) -> list[RequestStream]:
        """Queue requests `check` passed, all of them or none: QueueFull (-> 429) or EngineStopped (-> 503)
        leaves nothing queued."""
        return self.engine.submit_checked([Request(ids, params, checked=self.limits) for ids, params in checked])

    def stop_accepting(self) -> None:
        self.engine.stop_accepting()
