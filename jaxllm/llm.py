"""The Python generate API: `LLM(model).generate(...)`, `.stream(...)`, `.logits(...)`."""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterator, Sequence as Seq

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.engine.allocator import BlockAllocator
from jaxllm.engine.kv_cache import init_kv_cache, kv_bytes_per_block, kv_dtype
from jaxllm.engine.runner import InFlight, Runner
from jaxllm.engine.sampling import SamplingParams
from jaxllm.engine.scheduler import Scheduler, Sequence, Status, StepPlan
from jaxllm.model.chat import chat_prompt
from jaxllm.model.generation_config import load_generation_defaults
from jaxllm.model.tokenizer import StreamDecoder, load_tokenizer
from jaxllm.model.checkpoints import load_model
from pallas_kernels.dispatch import BACKENDS

_CPU_KV_BYTES = 1 << 30  # pool cap on a CPU host, where memory is shared with everything else


@dataclasses.dataclass(frozen=True)
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS or a stop string), "length" (max_new_tokens or context limit)


@dataclasses.dataclass(frozen=True)
class EngineOptions:
    """KV pool and batching limits; defaults suit the device found at start-up."""

    kv_dtype: str | None = None  # default: the model's dtype
    block_size: int | None = None  # tokens per rBlock
    num_blocks: int | None = None  # rBlocks per layer; default from kv_memory_fraction
    kv_memory_fraction: float = 0.85  # of the device memory left after weights (GPU)
    max_tokens_per_step: int | None = None
    max_seqs: int = 256
    attention_backend: str = "auto"
    # Queue the next decode step before reading this one's tokens, so host dispatch overlaps device
    # work; the tokens are the same either way. False waits for every step (for A/B timing).
    pipeline: bool = True
    # Reuse the KV of full rBlocks of identical prompt prefixes (shared system prompts, resumed
    # preemptions). Greedy tokens are the same either way up to rounding: cached KV was computed in
    # another step, whose batch shape may round the matmuls differently.
    prefix_caching: bool = True

    def __post_init__(self):
        if not (0.0 < self.kv_memory_fraction <= 1.0):
            raise ValueError(f"kv_memory_fraction must be in (0, 1], got {self.kv_memory_fraction}")
        for name in ("block_size", "num_blocks", "max_tokens_per_step"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.max_seqs <= 0:
            raise ValueError(f"max_seqs must be positive, got {self.max_seqs}")
        if self.attention_backend not in BACKENDS:
            raise ValueError(f"attention_backend {self.attention_backend!r} is not one of {BACKENDS}")


class _TextTracker:
    """Incremental text of one sequence, and stop-string matching on it."""

    def __init__(self, tokenizer, stop: tuple[str, ...]):
        self.decoder = StreamDecoder(tokenizer)
        self.stop = stop
        self.longest_stop = max((len(s) for s in stop), default=0)
        self.text = ""
        self.emitted = 0  # characters already handed to a streaming caller
        self.stopped = False

    def push(self, token_id: int) -> None:
        before = len(self.text)
        self.text += self.decoder.push(token_id)
        if self.stop:
            window_start = max(0, before - self.longest_stop + 1)
            hits = [i for i in (self.text.find(s, window_start) for s in self.stop) if i >= 0]
            if hits:
                self.text = self.text[:min(hits)]
                self.stopped = True

    def finish(self) -> None:
        if not self.stopped:
            self.text += self.decoder.flush()

    def take(self, final: bool) -> str:
        """Text not yet emitted; holds back a tail that might still grow into a stop string."""
        end = len(self.text)
        if not final and self.stop:
            end = max(self.emitted, end - (self.longest_stop - 1))
        piece = self.text[self.emitted:end]
        self.emitted = end
        return piece


class LLM:
    """A Llama-2 family model ready to generate.

    Args:
      model: a preset name ("tiny", "llama2-7b", ...), a HuggingFace directory or an Orbax directory.
      dtype: parameter/activation dtype ("float32", "bfloat16", "float16"); default the checkpoint's.
      max_context: longest sequence (prompt + generated) accepted; default the model's window.
      options: KV pool and batching limits (EngineOptions).
    """

    def __init__(self, model: str, *, dtype=None, max_context: int | None = None,
                 options: EngineOptions | None = None, progress: bool = True):
        self.model, tokenizer_dir = load_model(model, dtype=dtype, progress=progress)
        self.config = self.model.config
        self.tokenizer = load_tokenizer(tokenizer_dir)
        self.generation_defaults = load_generation_defaults(tokenizer_dir)  # used where a request gives none
        if max_context is None:
            max_context = self.config.max_context
        if isinstance(max_context, bool) or not isinstance(max_context, int) or max_context <= 0:
            raise ValueError(f"max_context must be a positive integer, got {max_context!r}")
        self.max_context = max_context
        self.options = options or EngineOptions()
        on_gpu = jax.default_backend() == "gpu"
        block_size = self.options.block_size or (256 if on_gpu else 16)
        pool_dtype = self.options.kv_dtype or jnp.dtype(self.model.embedding[...].dtype).name
        num_blocks = self.options.num_blocks or self._default_num_blocks(block_size, pool_dtype, on_gpu)
        max_step = self.options.max_tokens_per_step or (4096 if on_gpu else 512)
        kv_cache = init_kv_cache(self.config, num_blocks, block_size, kv_dtype(pool_dtype))
        # The table is as wide as the longest sequence the pool and context limit allow.
        longest = min(self.max_context + 1, num_blocks * block_size)
        self.runner = Runner(self.model, kv_cache, max_seqs=self.options.max_seqs, max_tokens_per_step=max_step,
                             table_width=-(-longest // block_size), backend=self.options.attention_backend)
        self.allocator = BlockAllocator(num_blocks)
        self.scheduler = Scheduler(self.allocator, block_size, max_tokens_per_step=max_step,
                                   max_seqs=self.options.max_seqs, prefix_caching=self.options.prefix_caching)
        self._inflight: InFlight | None = None  # dispatched, its tokens not yet recorded
        self._trackers: dict[int, _TextTracker] = {}  # seq_id -> text of every live generate/stream sequence

    def _default_num_blocks(self, block_size: int, pool_dtype: str, on_gpu: bool) -> int:
        per_block = kv_bytes_per_block(self.config, block_size, pool_dtype)
        if on_gpu:
            stats = jax.devices()[0].memory_stats() or {}
            free = stats.get("bytes_limit", 0) - stats.get("bytes_in_use", 0)
            budget = int(free * self.options.kv_memory_fraction)
        else:
            # Enough for a few full-length sequences, within a modest share of host memory.
            budget = min(_CPU_KV_BYTES, 4 * self.max_context * per_block // block_size)
        num_blocks = budget // per_block
        if num_blocks < 1:
            raise MemoryError(f"no room for a KV pool: one rBlock needs {per_block} bytes, {budget} are free")
        return num_blocks

    # ----- limits -----

    def warm_up(self, progress: bool = True) -> None:
        """Compile every step shape up front (servers do this before reporting ready)."""
        self.runner.warm_up(progress=progress)

    @property
    def compile_count(self) -> int:
        """Step functions compiled so far (the metric that must stay flat after warm-up)."""
        return self.runner.compile_count

    @property
    def pool_tokens(self) -> int:
        """Tokens the KV pool holds (all rBlocks)."""
        return self.allocator.num_blocks * self.runner.block_size

    @property
    def context_limit(self) -> int:
        """The most tokens (prompt + generated) one sequence can reach: max_context, or the pool if smaller."""
        return min(self.max_context, self.pool_tokens)

    def _encode(self, prompt, index: int) -> list[int]:
        if not isinstance(prompt, str):
            raise TypeError(f"prompt {index} must be a string, got {type(prompt).__name__}")
        if not prompt:
            raise ValueError(f"prompt {index} is empty")
        ids = self.tokenizer.encode(prompt)
        self._check_length(len(ids), f"prompt {index}")
        return ids

    def _check_length(self, num_tokens: int, what: str) -> None:
        if num_tokens > self.max_context:
            raise ValueError(f"{what} has {num_tokens} tokens, more than max_context {self.max_context}")
        if num_tokens > self.pool_tokens:
            raise ValueError(f"{what} has {num_tokens} tokens, more than the KV pool holds ({self.pool_tokens})")

    def _check_ids(self, ids: list[int], what: str) -> None:
        """Token ids a caller passed: not empty, inside the vocabulary, within the context limits."""
        if not ids:
            raise ValueError(f"{what} is empty")
        bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self.config.vocab_size})")
        self._check_length(len(ids), what)

    def _submit(self, ids: list[int], params: SamplingParams) -> Sequence:
        return self.scheduler.add(ids, params, max_len=self.context_limit)

    # ----- the loop -----

    # At most one step is in flight: dispatched, its tokens not yet recorded by `scheduler.update`.
    # scheduler.plan() runs only when none is (it may preempt, and a preempted sequence must have no
    # step outstanding); while one is, the only step queued behind it is its continuation
    # (Scheduler.plan_continuation), which takes its input tokens from the device. A step dropped
    # unrecorded (an exception, an abandoned stream) is harmless: the scheduler never moved past it.

    def _advance(self, run_ahead: bool = True, idle_ok: bool = False) -> StepPlan | None:
        """Record one step's tokens (dispatching it first if none is in flight); returns its plan.

        With run_ahead (and options.pipeline), the step after it is dispatched before its tokens are read.
        When no step is in flight and the scheduler plans none: None with idle_ok (the server's engine,
        between requests), else RuntimeError. Only this LLM's own generate/stream sequences get their
        stop strings checked here; the engine checks its requests'.
        """
        inflight, self._inflight = self._inflight, None
        if inflight is None:
            plan = self.scheduler.plan()
            if plan is None:
                if idle_ok:
                    return None
                raise RuntimeError("scheduler has waiting work but could plan no step (pool too small?)")
            inflight = self.runner.dispatch(plan)
        following = None
        if run_ahead and self.options.pipeline:
            continuation = self.scheduler.plan_continuation(inflight.plan)
            if continuation is not None:
                following = self.runner.dispatch(continuation, token_source=inflight)
        advanced = self.scheduler.update(inflight.plan, inflight.tokens(), self.tokenizer.eos_ids)
        self._inflight = following
        for seq in advanced:
            tracker = self._trackers.get(seq.seq_id)
            if tracker is None:
                continue
            tracker.push(seq.output_ids[-1])
            if tracker.stopped and seq.status is not Status.FINISHED:
                # A continuation already queued for it is dropped by update (it skips finished sequences).
                self.scheduler.finish(seq, "stop")
        return inflight.plan

    def _drain(self, on_step: Callable[[StepPlan], None] | None = None) -> None:
        """Record the step in flight, if any, and queue nothing after it."""
        if self._inflight is not None:
            plan = self._advance(run_ahead=False)
            if on_step is not None:
                on_step(plan)

    def _run_until(self, done: Callable[[], bool], on_step: Callable[[StepPlan], None] | None = None) -> None:
        """Run steps until done() holds, then drain: returns with no step in flight.

        on_step(plan) is called after each step's tokens are recorded (benchmarks time the gaps).
        """
        while not done():
            plan = self._advance()
            if on_step is not None:
                on_step(plan)
        self._drain(on_step)

    def generate(self, prompts: str | Seq[str], *, max_new_tokens: int, temperature: float | None = None,
                 top_k: int | None = None, top_p: float | None = None, seed: int = 0, stop: str | Seq[str] | None = None,
                 stop_token_ids: Seq[int] | None = None, ignore_eos: bool = False) -> list[Completion]:
        """Complete each prompt; all prompts run together, continuously batched.

        ignore_eos: keep generating past the tokenizer's EOS (benchmarks); stop strings and
        stop_token_ids still stop.
        """
        if isinstance(prompts, str):
            prompts = [prompts]
        if not prompts:
            raise ValueError("prompts is empty")
        temperature, top_k, top_p = self.generation_defaults.resolve(temperature, top_k, top_p)
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                                seed=seed, stop=stop or (), stop_token_ids=stop_token_ids, ignore_eos=ignore_eos)
        encoded = [self._encode(p, i) for i, p in enumerate(prompts)]
        seqs = [self._submit(ids, params) for ids in encoded]
        trackers = {s.seq_id: _TextTracker(self.tokenizer, params.stop) for s in seqs}
        self._trackers.update(trackers)
        try:
            self._run_until(lambda: all(s.status is Status.FINISHED for s in seqs))
        except BaseException:
            self._inflight = None  # dropped unrecorded: harmless (see above)
            for s in seqs:
                self.scheduler.cancel(s)
            raise
        finally:
            for s in seqs:
                self._trackers.pop(s.seq_id, None)
        out = []
        for s in seqs:
            tracker = trackers[s.seq_id]
            tracker.finish()
            out.append(Completion(tracker.text, list(s.output_ids), s.finish_reason))
        return out

    def stream(self, prompt: str, *, max_new_tokens: int, temperature: float | None = None,
               top_k: int | None = None, top_p: float | None = None, seed: int = 0, stop: str | Seq[str] | None = None,
               stop_token_ids: Seq[int] | None = None, ignore_eos: bool = False) -> Iterator[str]:
        """Yield text pieces of one completion as its tokens are produced (arguments as generate's)."""
        temperature, top_k, top_p = self.generation_defaults.resolve(temperature, top_k, top_p)
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                                seed=seed, stop=stop or (), stop_token_ids=stop_token_ids, ignore_eos=ignore_eos)
        seq = self._submit(self._encode(prompt, 0), params)
        tracker = _TextTracker(self.tokenizer, params.stop)
        self._trackers[seq.seq_id] = tracker
        try:
            # Between yields at most one step is in flight: the stream runs at most one step ahead of
            # its reader.
            while seq.status is not Status.FINISHED:
                self._advance()
                piece = tracker.take(final=False)
                if piece:
                    yield piece
            self._drain()
            tracker.finish()
            piece = tracker.take(final=True)
            if piece:
                yield piece
        finally:
            # A caller that stops iterating early (or an error) frees the sequence's rBlocks; a step it
            # left in flight is dropped unrecorded, which is harmless (see above).
            self._inflight = None  # None already unless the loop was left early
            self.scheduler.cancel(seq)
            self._trackers.pop(seq.seq_id, None)

    def logits(self, token_ids: Seq[int]) -> np.ndarray:
        """Teacher-forced logits [len(token_ids), vocab] (float32), prefilled in chunks."""
        ids = [int(t) for t in token_ids]
        self._check_ids(ids, "token_ids")
        if self.scheduler.has_work() or self._inflight is not None:
            raise RuntimeError("logits() cannot run while generation is in progress")
        # One sequence, prefilled chunk by chunk; max_new_tokens=1 so the scheduler never samples past it.
        # Every position's logits are wanted: nothing may come from the prefix cache.
        seq = self.scheduler.add(ids, SamplingParams(max_new_tokens=1), max_len=len(ids) + 1, reuse_prefix=False)
        chunks = []
        try:
            while seq.num_computed < len(ids):
                plan = self.scheduler.plan()
                chunks.append(self.runner.logits(plan))
                seq.num_computed = int(plan.kv_lens[0])
        finally:
            self.scheduler.cancel(seq)
        return np.concatenate(chunks, axis=0)

    def chat(self, messages: Seq[dict], **kwargs) -> Completion:
        """Complete a conversation ([{"role": ..., "content": ...}, ...]) under the checkpoint's chat
        template (Llama-2's [INST] format without one); kwargs as generate's."""
        return self.generate(chat_prompt(self.tokenizer, messages), **kwargs)[0]
