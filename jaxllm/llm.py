"""The Python generate API: `LLM(model).generate(...)`, `.stream(...)`, `.logits(...)`, `.chat(...)`.

`LLM` is a facade: jaxllm.builder builds the engine (`build_engine`), and `LLM` drives its core synchronously.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterable, Iterator, Sequence as Seq

import numpy as np

from jaxllm.builder import BuiltEngine, build_engine
from jaxllm.contract import EngineStats
from jaxllm.engine.core import EngineCore, EngineInfo, Request, RequestOutput
from jaxllm.engine.requests import prompt_token_ids, sampling_params
from jaxllm.engine_config import EngineConfig, EngineOptions
from jaxllm.memory_plan import MemoryPlan, plan_memory
from jaxllm.model.chat import chat_prompt

__all__ = ["Completion", "EngineConfig", "EngineOptions", "EngineStats", "LLM", "MemoryPlan", "plan_memory"]


@dataclasses.dataclass(frozen=True)
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS or a stop string), "length" (max_new_tokens or context limit)
    # None unless generate(logprobs=k): per token id, (its logprob, ((id, logprob), ...) the k most likely).
    logprobs: list[tuple[float, tuple[tuple[int, float], ...]]] | None = None
    # None unless generate(prompt_logprobs=k): per prompt token, None for the first, then the same given the
    # tokens before it.
    prompt_logprobs: list[tuple[float, tuple[tuple[int, float], ...]] | None] | None = None


class LLM:
    """A model ready to generate: the engine jaxllm.builder builds, driven synchronously.

    Args: model (or a whole EngineConfig in its place), dtype, max_context, allow_long_context and options as EngineConfig's (jaxllm.engine_config:
    a preset name or a checkpoint directory, the dtype, the longest sequence accepted, past the model's window
    or not, the pool and batching limits); progress: print loading, planning and warm-up progress; proposer:
    speculative decoding's draft source in place of EngineOptions.speculative's (build_engine's: benchmarks, tests).
    `engine` holds every part (jaxllm.builder.BuiltEngine); the ones callers read most are attributes here too.
    """

    def __init__(self, model: str | EngineConfig, *, dtype=None, max_context: int | None = None,
                 allow_long_context: bool = False, options: EngineOptions | None = None, progress: bool = True,
                 proposer=None):
        if isinstance(model, EngineConfig):
            if (dtype, max_context, allow_long_context, options) != (None, None, False, None):
                raise ValueError("LLM(EngineConfig) takes its dtype, max_context, allow_long_context and options "
                                 "from the config; give them there")
            config = model
        else:
            config = EngineConfig(model, dtype=dtype, max_context=max_context, allow_long_context=allow_long_context,
                                  options=options or EngineOptions())
        self._attach(build_engine(config, progress=progress, proposer=proposer))

    def _attach(self, engine: BuiltEngine) -> None:
        self.engine = engine
        # The parts callers read most, by their names (the engine holds them all).
        self.core: EngineCore = engine.core
        self.executor, self.scheduler, self.tokenizer, self.limits = (engine.executor, engine.scheduler,
                                                                      engine.tokenizer, engine.limits)
        self.config, self.model, self.mesh = engine.model_config, engine.model, engine.mesh
        self.options, self.memory_plan, self.generation_defaults = (engine.options, engine.memory_plan,
                                                                    engine.generation_defaults)
        self.max_context, self.num_blocks, self.host_blocks = engine.max_context, engine.num_blocks, engine.host_blocks

    def close(self) -> None:
        """End a multi-process run: the other processes' runners stop following and their programs exit.
        Call it on process 0 when done (entry points do, also on errors and SIGTERM); idempotent; nothing
        to do on one process."""
        self.engine.close()

    def follow(self) -> int:
        """A process other than 0 of a multi-process run: run process 0's steps until it closes (BuiltEngine.follow);
        returns the number of calls run."""
        return self.engine.follow()

    # ----- what it is -----

    def warm_up(self, progress: bool = True) -> None:
        """Compile every step shape up front (servers do this before reporting ready)."""
        self.engine.warm_up(progress=progress)

    @property
    def compile_count(self) -> int:
        """Step functions compiled so far, a draft model's included (the metric that must stay flat after warm-up)."""
        return self.engine.compile_count

    @property
    def pool_tokens(self) -> int:
        """Tokens the KV pool holds (all rBlocks)."""
        return self.num_blocks * self.executor.block_size

    @property
    def context_limit(self) -> int:
        """The most tokens (prompt + generated) one sequence can reach: max_context, or the pool if smaller.
        A prompt may have at most context_limit - 1 tokens (one new token must fit)."""
        return self.limits.context_limit

    def info(self) -> EngineInfo:
        """A frozen description of the loaded model and engine."""
        return self.engine.info()

    def stats(self) -> EngineStats:
        """Counters and current load, a snapshot: the engine's stats tree (jaxllm.contract.stats), one part each
        (`stats().scheduler.preemptions`, `stats().executor.compile_count`, ...)."""
        return self.core.stats()

    # ----- generation -----

    def _requests(self, prompts: Seq, sampling: dict) -> list[Request]:
        """Check every prompt and its sampling settings before any is queued."""
        requests = []
        for i, prompt in enumerate(prompts):
            ids = prompt_token_ids(prompt, self.tokenizer, self.limits, what=f"prompt {i}")
            requests.append(Request(ids, sampling_params(self.limits, len(ids), **sampling), checked=self.limits))
        return requests

    def run(self, requests: Iterable[Request],
            on_step: Callable[[list[RequestOutput]], None] | None = None) -> dict[int, list[RequestOutput]]:
        """Run requests (already built) to their ends; returns every output by request id, in order.

        on_step(outputs) is called after each recorded step (benchmarks time the gaps). Returns with no
        step in flight; on an error (or KeyboardInterrupt) every request is cancelled first.
        """
        ids = [self.core.add(r) for r in requests]
        outputs: dict[int, list[RequestOutput]] = {i: [] for i in ids}
        pending = set(ids)
        try:
            while pending:
                step_outputs = self.core.step()
                self._record(step_outputs, outputs, pending)
                if on_step is not None:
                    on_step(step_outputs)
            if self.core.has_step_in_flight():
                step_outputs = self.core.drain()
                if on_step is not None:
                    on_step(step_outputs)
        except BaseException:
            self.core.drop_in_flight()  # dropped unrecorded: harmless (EngineCore says why)
            for i in pending:
                self.core.cancel(i)
            raise
        return outputs

    @staticmethod
    def _record(step_outputs, outputs, pending) -> None:
        for out in step_outputs:
            if out.request_id in outputs:
                outputs[out.request_id].append(out)
                if out.finished:
                    pending.discard(out.request_id)

    def generate(self, prompts: str | Seq[str] | Seq[int] | Seq[Seq[int]], *, max_new_tokens: int,
                 temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
                 seed: int = 0, stop: str | Seq[str] | None = None, stop_token_ids: Seq[int] | None = None,
                 ignore_eos: bool = False, logprobs: int | None = None,
                 prompt_logprobs: int | None = None, frequency_penalty: float = 0.0, presence_penalty: float = 0.0,
                 repetition_penalty: float = 1.0, logit_bias: dict[int, float] | None = None,
                 num_speculative_tokens: int | None = None) -> list[Completion]:
        """Complete each prompt (text, or a list of token ids); all prompts run together, continuously batched.

        A prompt may have at most context_limit - 1 tokens, and max_new_tokens may be at most the room
        left (context_limit minus the prompt's tokens): more is a ValueError, never capped silently.
        temperature, top_k, top_p: None takes the checkpoint's generation_config.json default (greedy,
        no top-k, top_p 1 without one).
        ignore_eos: keep generating past the tokenizer's EOS ids (benchmarks); stop strings and
        stop_token_ids still stop.
        logprobs: None, or k <= EngineOptions.max_logprobs: each Completion carries every token's
        log-probability and the k most likely tokens' (before temperature, top-k and top-p).
        prompt_logprobs: None, or k <= EngineOptions.max_logprobs: each Completion carries every prompt token's
        log-probability given the tokens before it (None for the first) and the k most likely there, computed
        in the prefill steps (such a prompt takes nothing from the prefix cache); max_new_tokens may then be 0.
        frequency_penalty, presence_penalty (in [-2, 2], 0 off), repetition_penalty (> 0, 1 off), logit_bias
        ({token id: bias in [-100, 100]}, at most EngineOptions.max_logit_bias entries): vLLM's semantics
        (jaxllm.contract.sampling_params), applied before temperature / top-k / top-p and the greedy argmax;
        log-probabilities stay the model's raw ones.
        num_speculative_tokens: on an engine with speculative decoding (EngineOptions.speculative), the most draft
        tokens a step for these prompts (None: the engine's k; 0: off); the tokens are the same either way.
        """
        temperature, top_k, top_p = self.generation_defaults.resolve(temperature, top_k, top_p)
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not prompts:
            raise ValueError("prompts is empty")
        sampling = dict(max_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                        stop=stop, stop_token_ids=stop_token_ids, ignore_eos=ignore_eos, logprobs=logprobs,
                        prompt_logprobs=prompt_logprobs, frequency_penalty=frequency_penalty,
                        presence_penalty=presence_penalty, repetition_penalty=repetition_penalty,
                        logit_bias=logit_bias, num_speculative_tokens=num_speculative_tokens,
                        max_tokens_name="max_new_tokens")
        outputs = self.run(self._requests(prompts, sampling))
        completions = []
        for outs in outputs.values():
            scored = next((o.prompt_logprobs for o in outs if o.prompt_logprobs is not None), None)
            completions.append(Completion("".join(o.text for o in outs), [t for o in outs for t in o.token_ids],
                                          outs[-1].finish_reason,
                                          None if logprobs is None else [lp for o in outs for lp in o.logprobs],
                                          None if scored is None else list(scored)))
        return completions

    def stream(self, prompt: str | Seq[int], *, max_new_tokens: int, temperature: float | None = None,
               top_k: int | None = None, top_p: float | None = None, seed: int = 0,
               stop: str | Seq[str] | None = None, stop_token_ids: Seq[int] | None = None,
               ignore_eos: bool = False, frequency_penalty: float = 0.0, presence_penalty: float = 0.0,
               repetition_penalty: float = 1.0, logit_bias: dict[int, float] | None = None,
               num_speculative_tokens: int | None = None) -> Iterator[str]:
        """Yield text pieces of one completion as its tokens are produced (arguments as generate's).

        Text that could still grow into a stop string is held back until it cannot.
        """
        temperature, top_k, top_p = self.generation_defaults.resolve(temperature, top_k, top_p)
        sampling = dict(max_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                        stop=stop, stop_token_ids=stop_token_ids, ignore_eos=ignore_eos,
                        frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
                        repetition_penalty=repetition_penalty, logit_bias=logit_bias,
                        num_speculative_tokens=num_speculative_tokens,
                        max_tokens_name="max_new_tokens")
        # Checked now, so a bad argument raises here rather than at the first next(); queued when iterated.
        return self._stream(self._requests([prompt], sampling)[0])

    def _stream(self, request: Request) -> Iterator[str]:
        request_id = self.core.add(request)
        finished = False
        try:
            # Between yields at most one step is in flight: the stream runs at most one step ahead of
            # its reader.
            while not finished:
                for out in self.core.step():
                    if out.request_id == request_id:
                        finished = out.finished
                        if finished:
                            self.core.drain()
                        if out.text:
                            yield out.text
        finally:
            # A caller that stops iterating early (or an error) frees the sequence's rBlocks; a step it
            # left in flight is dropped unrecorded, which is harmless (EngineCore says why).
            if not finished:
                self.core.drop_in_flight()
                self.core.cancel(request_id)

    def logits(self, token_ids: Seq[int]) -> np.ndarray:
        """Teacher-forced logits [len(token_ids), vocab] (float32), prefilled in chunks."""
        return self.core.logits(token_ids)

    def chat(self, messages: Seq[dict], **kwargs) -> Completion:
        """Complete a conversation ([{"role": ..., "content": ...}, ...]) under the checkpoint's chat
        template (Llama-2's [INST] format without one); kwargs as generate's."""
        return self.generate(chat_prompt(self.tokenizer, messages), **kwargs)[0]
