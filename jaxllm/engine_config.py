"""An engine's configuration, validated once: `EngineOptions` (the pool, batching, mesh and request limits) and
`EngineConfig` (which model, at which dtype and context, with which options). The builder (jaxllm.builder) turns an
EngineConfig into the engine's parts; every front end (`LLM`, `python -m jaxllm.serve`, `python -m jaxllm.generate`,
a follower process) builds one and hands it there, so an option is added here and read there, nowhere else."""

from __future__ import annotations

import dataclasses

from jaxllm.model.checkpoints.common import resolve_dtype
from pallas_kernels.dispatch import BACKENDS

TUNERS = ("auto", "fixed")
# The most draft tokens a verify step checks a sequence (k): its k + 1 query rows of a KV head fill one 16-row tile of
# the decode kernel under MHA (pallas_kernels.verify_attention), and acceptance falls off long before.
MAX_SPECULATIVE_TOKENS = 15


@dataclasses.dataclass(frozen=True)
class EngineOptions:
    """KV pool and batching limits; defaults suit the device found at start-up."""

    kv_dtype: str | None = None  # default: the model's dtype
    block_size: int | None = None  # tokens per rBlock
    num_blocks: int | None = None  # rBlocks per layer; default: planned (GPU), see kv_memory_fraction
    # GPU: the pool takes this fraction of the device memory left after the weights. None (the default): planned,
    # the memory left after the weights less what the largest step programs need while they run (XLA's memory
    # analysis of them) and a margin, so admitted steps never run out of memory (LLM.memory_plan says how).
    kv_memory_fraction: float | None = None
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
    # The mesh (docs/ARCHITECTURE.md, decision 7): the model split tensor_parallel ways (KV-head groups,
    # MLP columns), times `instances` (the instance axis: serving instances with a scheduler and an rBlock
    # pool each, num_blocks rBlocks apiece, running their own rows side by side in every step; requests go
    # to the least-loaded). 1 x 1 in one process: one device, no mesh at all.
    tensor_parallel: int = 1
    instances: int = 1
    # Instances lend each other rBlocks (DistKV-LLM): a sequence longer than one instance's pool borrows
    # from the others and its attention runs where its KV lives (DistAttention). False: each instance lives
    # within its own pool (preempting or queueing), for comparison.
    lending: bool = True
    # A long prompt (more than one step's tokens) is prefilled by every instance at once (context parallel:
    # jaxllm.engine.spread; with lending and several instances). False: chunk by chunk on its home instance.
    spread_prompts: bool = True
    # Top tokens a request may ask log-probabilities of (SamplingParams.logprobs); 0: none, and no
    # logprob step variants are compiled.
    max_logprobs: int = 0
    # frequency / presence / repetition penalties and logit_bias (vLLM's semantics: jaxllm.contract.sampling_params).
    # On, each instance keeps max_seqs rows of penalty state on the device, 5 bytes a vocabulary entry (41 MB
    # for a 32K vocabulary at max_seqs 256, 164 MB for 128K: jaxllm.executor.penalties); sampling steps read
    # their rows, greedy steps without penalties do not. False: no state, and requests using any of the four
    # are refused. max_logit_bias: logit_bias entries one request may give (a fixed width of every step's inputs).
    penalties: bool = True
    max_logit_bias: int = 64
    # The host tier (docs/ARCHITECTURE.md, decision 12): bytes of pinned host memory for each instance's rBlocks, so
    # a preempted sequence swaps out and back in instead of recomputing, and the prefix cache spills there instead
    # of forgetting. None or 0: off (the default, for now: on an H200 the multi-turn workload of
    # scripts/bench_host_tier.py took 8.6x longer to its first tokens with the tier on, README "Host memory as a KV
    # tier"). One process (a multi-process run: refused).
    host_kv_bytes: int | None = None
    # Which kernels each step runs: "auto" (the learned tuner if a cost model was trained for this
    # device kind, else "fixed", said once) or "fixed" (the backend's defaults for every bucket).
    tuner: str = "auto"
    # JAX's persistent compilation cache in this directory (created if missing), so a restart compiles
    # nothing; None: $JAXLLM_COMPILE_CACHE if set, else off.
    compile_cache_dir: str | None = None
    # What one request may ask for (jaxllm.engine.requests.RequestLimits, built once from these; every
    # front end reads that one object): max_tokens of a request that sets none (capped at the room its
    # prompt leaves), stop strings per request, characters per stop string.
    default_max_tokens: int = 256
    max_stop_strings: int = 16
    max_stop_length: int = 256
    # Speculative decoding (docs/ARCHITECTURE.md, decision 13): "ngram:K" drafts up to K tokens a step by prompt
    # lookup (the longest match of the last 2..4 tokens in the sequence's own tokens, vLLM's `ngram`); a verify step
    # checks every draft at once and keeps what the target model would have produced (greedy: the same tokens;
    # sampled: the same distribution). num_speculative_tokens: K for a proposer handed to the builder
    # (build_engine(..., proposer=): benchmarks, tests), or the same as "ngram:K" with speculative "ngram". A
    # request may ask for fewer (SamplingParams.num_speculative_tokens; 0: off for it). None: off.
    # speculative_model: a draft model instead (a preset or a checkpoint directory with the target's tokenizer),
    # drafting num_speculative_tokens tokens greedily; it runs in the same process on the first device of the mesh,
    # with its own engine and KV pool (draft_pool_seqs sequences of max_context: more speculating sequences take
    # turns, its prefix cache keeping what fits). One process (a multi-process run: refused).
    speculative: str | None = None
    num_speculative_tokens: int | None = None
    speculative_model: str | None = None
    draft_pool_seqs: int = 4

    def __post_init__(self):
        for name in ("tensor_parallel", "instances", "default_max_tokens", "max_stop_strings", "max_stop_length"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.host_kv_bytes is not None and (isinstance(self.host_kv_bytes, bool)
                                               or not isinstance(self.host_kv_bytes, int) or self.host_kv_bytes < 0):
            raise ValueError(f"host_kv_bytes must be an integer >= 0 (0 turns the host tier off) or None (the "
                             f"default), got {self.host_kv_bytes!r}")
        for name in ("max_logprobs", "max_logit_bias"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if not isinstance(self.penalties, bool):
            raise ValueError(f"penalties must be True or False, got {self.penalties!r}")
        if self.kv_memory_fraction is not None and not (0.0 < self.kv_memory_fraction <= 1.0):
            raise ValueError(f"kv_memory_fraction must be in (0, 1], got {self.kv_memory_fraction}")
        for name in ("block_size", "num_blocks", "max_tokens_per_step"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.max_seqs <= 0:
            raise ValueError(f"max_seqs must be positive, got {self.max_seqs}")
        if self.attention_backend not in BACKENDS:
            raise ValueError(f"attention_backend {self.attention_backend!r} is not one of {BACKENDS}")
        if self.tuner not in TUNERS:
            raise ValueError(f"tuner {self.tuner!r} is not one of {TUNERS}")
        if self.compile_cache_dir is not None and (not isinstance(self.compile_cache_dir, str)
                                                   or not self.compile_cache_dir):
            raise ValueError(f"compile_cache_dir must be a non-empty path or None, got {self.compile_cache_dir!r}")
        self._check_speculative()

    def _check_speculative(self) -> None:
        k = self.num_speculative_tokens
        if k is not None and (isinstance(k, bool) or not isinstance(k, int)
                              or not 1 <= k <= MAX_SPECULATIVE_TOKENS):
            raise ValueError(f"num_speculative_tokens must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
        if isinstance(self.draft_pool_seqs, bool) or not isinstance(self.draft_pool_seqs, int) \
                or self.draft_pool_seqs < 1:
            raise ValueError(f"draft_pool_seqs must be a positive integer, got {self.draft_pool_seqs!r}")
        if self.speculative_model is not None:
            if not isinstance(self.speculative_model, str) or not self.speculative_model:
                raise ValueError(f"speculative_model must be a preset name or a checkpoint directory, got "
                                 f"{self.speculative_model!r}")
            if self.speculative is not None:
                raise ValueError(f"speculative {self.speculative!r} and speculative_model {self.speculative_model!r}"
                                 " are two draft sources: choose one")
            if k is None:
                raise ValueError(f"speculative_model {self.speculative_model!r} needs num_speculative_tokens (the "
                                 f"tokens it drafts a step, 1...{MAX_SPECULATIVE_TOKENS})")
        if self.speculative is None:
            return
        method, _, count = self.speculative.partition(":") if isinstance(self.speculative, str) else ("", "", "")
        if method != "ngram" or (count and not count.isdigit()) or (not count and k is None):
            raise ValueError(f"speculative {self.speculative!r} is not 'ngram:K' (K draft tokens a step, 1..."
                             f"{MAX_SPECULATIVE_TOKENS}), nor 'ngram' with num_speculative_tokens")
        if count and not 1 <= int(count) <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative {self.speculative!r}: K must be in [1, {MAX_SPECULATIVE_TOKENS}]")
        if count and k is not None and int(count) != k:
            raise ValueError(f"speculative {self.speculative!r} and num_speculative_tokens {k} disagree")

    @property
    def speculative_tokens(self) -> int:
        """k, the most draft tokens a sequence takes a step (0: no speculative decoding)."""
        if self.num_speculative_tokens is not None:
            return self.num_speculative_tokens
        if self.speculative is not None:
            return int(self.speculative.partition(":")[2])
        return 0


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """What to build: the model and how to run it.

    model: a preset name ("tiny", "llama2-7b", ...), a HuggingFace directory or an Orbax directory.
    dtype: parameter/activation dtype ("float32", "bfloat16", "float16", or a dtype); None: the checkpoint's.
    max_context: longest sequence (prompt + generated) accepted; None: the model's window (`config.max_context`:
      max_position_embeddings, or what its RoPE scaling extends it to). More than the window is a ValueError at
      build time (the window is the checkpoint's), unless allow_long_context.
    allow_long_context: accept a max_context past the model's window (positions it was never trained on: for
      random-weight benchmarks of long contexts, not for a checkpoint's quality).
    options: the pool, batching, mesh and request limits (EngineOptions).
    """

    model: str
    dtype: object = None  # a name or a dtype
    max_context: int | None = None
    allow_long_context: bool = False
    options: EngineOptions = dataclasses.field(default_factory=lambda: EngineOptions())

    def __post_init__(self):
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be a preset name or a checkpoint directory, got {self.model!r}")
        resolve_dtype(self.dtype)  # ValueError naming the dtype and the supported ones
        if self.max_context is not None and (isinstance(self.max_context, bool) or not isinstance(self.max_context, int)
                                             or self.max_context <= 0):
            raise ValueError(f"max_context must be a positive integer, got {self.max_context!r}")
        if not isinstance(self.allow_long_context, bool):
            raise ValueError(f"allow_long_context must be True or False, got {self.allow_long_context!r}")
        if not isinstance(self.options, EngineOptions):
            raise TypeError(f"options must be EngineOptions, got {type(self.options).__name__}")
