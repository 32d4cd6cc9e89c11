"""One engine step as plain values: `StepInputs` (one pytree of arrays) and the step as free functions, one per
StepKind (`decode_step`, `prefill_step`, `verify_step`) beside the teacher-forced `logits_step`.

A step is `(graphdef, state, kv_pool, inputs, penalty_state, *, kernels)`: `inputs` is what a mesh shards
(in_specs) and what process 0 sends each step on a multi-host run (the step channel); `kernels` (pallas_kernels.dispatch.Kernels)
is the static description of each op's implementation and schedule that a tuner supplies. The executor
jits these functions with the KV pool and the penalty state donated (jaxllm.executor.programs, per instance on a
mesh of several); a plan becomes StepInputs in jaxllm.executor.inputs. Nothing here reads a live Sequence or
queries a device.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxllm.contract import StepKind
from jaxllm.executor import penalties
from jaxllm.executor.acceptance import accept_drafts
from jaxllm.executor.penalties import PenaltyInputs, PenaltyState
from jaxllm.executor.sampler import greedy_tokens, sample_tokens, token_logprobs
from jaxllm.model.kv_cache import KVCache
from pallas_kernels.dispatch import AttentionBatch, Kernels


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepInputs:
    """A step's inputs padded to its bucket (T tokens, S sequences, W rBlock-table columns).

    tokens, positions, slot_mapping [T] int32 (padding tokens: slot -1, written nowhere);
    block_tables [S, W], kv_lens [S], cu_q_lens [S+1] int32 (padding sequences: kv_len 0, no query
    tokens; on a decode step cu_q_lens == arange(S + 1), each padding sequence owning one padding
    token); temperature, top_p [S] float32, top_k, seed [S] int32 (padding rows greedy); targets [T] int32: the
    prompt token each token precedes where its sequence scores its prompt, in a verify step the draft after it, -1
    elsewhere (StepPlan.targets).
    penalties: each row's penalties and logit bias (jaxllm.executor.penalties.PenaltyInputs) on an engine with
    penalties on (inert rows where none), None on one with them off. Leaves are numpy arrays on the host or jax
    arrays on the device. packed: None, or on the way into a program the integer fields in one array
    (jaxllm.executor.packed_inputs; those fields None).
    """

    tokens: np.ndarray | jax.Array
    positions: np.ndarray | jax.Array
    block_tables: np.ndarray | jax.Array
    kv_lens: np.ndarray | jax.Array
    cu_q_lens: np.ndarray | jax.Array
    slot_mapping: np.ndarray | jax.Array
    temperature: np.ndarray | jax.Array
    top_k: np.ndarray | jax.Array
    top_p: np.ndarray | jax.Array
    seed: np.ndarray | jax.Array
    targets: np.ndarray | jax.Array
    parts: Any = None  # on several instances, a step with borrowed rBlocks: sharding.dist_attention.DistParts
    penalties: PenaltyInputs | None = None
    packed: np.ndarray | jax.Array | None = None

    @property
    def num_tokens(self) -> int:
        return self.tokens.shape[-1]  # [T], or [I, T] stacked per instance

    @property
    def num_seqs(self) -> int:
        return self.temperature.shape[-1]


def inert_step_inputs(kind: StepKind, num_tokens: int, num_seqs: int, table_width: int,
                      bias_width: int | None = None) -> StepInputs:
    """Real shapes, inert values (warm-up, and the canvas jaxllm.executor.inputs fills in): every token's slot is
    -1 (nothing written), every kv_len 0, every row greedy and without penalties; a decode step's cu_q_lens ==
    arange (each padding sequence one padding token), a prefill step's zeros (padding sequences own no token).
    bias_width: the engine's max_logit_bias, None with penalties off."""
    return StepInputs(
        tokens=np.zeros(num_tokens, np.int32), positions=np.zeros(num_tokens, np.int32),
        block_tables=np.zeros((num_seqs, table_width), np.int32), kv_lens=np.zeros(num_seqs, np.int32),
        cu_q_lens=(np.arange(num_seqs + 1, dtype=np.int32) if kind is StepKind.DECODE
                   else np.zeros(num_seqs + 1, np.int32)),
        slot_mapping=np.full(num_tokens, -1, np.int32),
        temperature=np.zeros(num_seqs, np.float32), top_k=np.zeros(num_seqs, np.int32),
        top_p=np.ones(num_seqs, np.float32), seed=np.zeros(num_seqs, np.int32),
        targets=np.full(num_tokens, -1, np.int32),
        penalties=None if bias_width is None else penalties.inert_penalty_inputs(num_seqs, bias_width))


def _forward(graphdef, state, kv_pool: KVCache, inputs: StepInputs, kind: StepKind, kernels: Kernels):
    model = nnx.merge(graphdef, state)
    verify = inputs.num_tokens // inputs.num_seqs if kind is StepKind.VERIFY else 0  # Q tokens every sequence
    batch = AttentionBatch(inputs.block_tables, inputs.kv_lens, inputs.cu_q_lens, inputs.slot_mapping, inputs.parts,
                           single_query=kind.queries_per_seq == 1, verify_queries=verify)
    hidden, kv_pool = model(inputs.tokens, inputs.positions, kv_pool, batch, kernels=kernels)
    return model, hidden, kv_pool


def _read_tokens(penalty_state: PenaltyState | None, inputs: StepInputs) -> PenaltyState | None:
    """The penalty state after the step's input tokens (penalties.read_tokens); as it was with penalties off."""
    if penalty_state is None:
        return None
    return penalties.read_tokens(penalty_state, inputs.penalties, inputs.tokens, inputs.positions, inputs.cu_q_lens)


def _sample(logits, inputs: StepInputs, greedy: bool, penalty_state: PenaltyState | None):
    """(tokens [S] int32, the penalty state with them counted). The greedy variant runs only when no row samples,
    has a penalty or a logit bias, so it leaves the state alone."""
    if greedy:  # every row has temperature 0: sample_tokens would return this argmax too
        return greedy_tokens(logits), penalty_state
    if penalty_state is not None:
        logits = penalties.process_logits(logits, penalty_state, inputs.penalties)
    tokens = sample_tokens(logits, inputs.temperature, inputs.top_k, inputs.top_p, inputs.seed, inputs.kv_lens)
    if penalty_state is not None:
        penalty_state = penalties.count_sampled(penalty_state, inputs.penalties, tokens)
    return tokens, penalty_state


def _last_tokens(inputs: StepInputs) -> jax.Array:
    return jnp.maximum(inputs.cu_q_lens[1:] - 1, 0)  # each sequence's last query token


def decode_step(graphdef, state, kv_pool: KVCache, inputs: StepInputs, penalty_state: PenaltyState | None = None, *,
                kernels: Kernels, greedy: bool = False, logprobs: int | None = None):
    """One query token per sequence -> (next tokens [S] int32, KV pool, penalty state). greedy (static): every row
    has temperature 0 and no penalty or bias, so the argmax replaces the sampler's full-vocabulary sort.
    logprobs (static): None, or k: the variant that returns ((tokens, sampled, prompt), KV pool, penalty state)
    with sampled = (token logprob [S], top ids [S, k], top logprobs [S, k]) (sampler.token_logprobs, of the raw
    logits) and prompt the same for each token's target (StepInputs.targets; a one-token chunk of a prompt can be
    a decode-shaped step); the plain variants compute no log-probabilities. penalty_state: None with penalties
    off (jaxllm.executor.penalties)."""
    model, hidden, kv_pool = _forward(graphdef, state, kv_pool, inputs, StepKind.DECODE, kernels)
    logits = model.logits(hidden[_last_tokens(inputs)])  # [S, vocab]; S == T on a decode step
    if not greedy:
        penalty_state = _read_tokens(penalty_state, inputs)
    tokens, penalty_state = _sample(logits, inputs, greedy, penalty_state)
    if logprobs is None:
        return tokens, kv_pool, penalty_state
    prompt = token_logprobs(logits, jnp.maximum(inputs.targets, 0), logprobs)
    return (tokens, token_logprobs(logits, tokens, logprobs), prompt), kv_pool, penalty_state


def prefill_step(graphdef, state, kv_pool: KVCache, inputs: StepInputs, penalty_state: PenaltyState | None = None, *,
                 kernels: Kernels, logprobs: int | None = None):
    """Packed chunks of any lengths -> (a token sampled after each sequence's last one [S] int32, KV pool, penalty
    state); logprobs (static) as decode_step's, the prompt part over every token of the step [T] (the whole
    chunk's logits are computed only in this variant)."""
    model, hidden, kv_pool = _forward(graphdef, state, kv_pool, inputs, StepKind.PREFILL, kernels)
    penalty_state = _read_tokens(penalty_state, inputs)
    if logprobs is None:
        logits = model.logits(hidden[_last_tokens(inputs)])  # [S, vocab]
        tokens, penalty_state = _sample(logits, inputs, False, penalty_state)
        return tokens, kv_pool, penalty_state
    every = model.logits(hidden)  # [T, vocab]
    logits = every[_last_tokens(inputs)]
    tokens, penalty_state = _sample(logits, inputs, False, penalty_state)
    prompt = token_logprobs(every, jnp.maximum(inputs.targets, 0), logprobs)
    return (tokens, token_logprobs(logits, tokens, logprobs), prompt), kv_pool, penalty_state


def verify_step(graphdef, state, kv_pool: KVCache, inputs: StepInputs, penalty_state: PenaltyState | None = None, *,
                kernels: Kernels, greedy: bool = False, logprobs: int | None = None):
    """Q = k + 1 tokens a sequence (its last token, its drafts, fillers; T == S x Q) -> (the tokens each keeps [S, Q]
    int32, -1 after them: jaxllm.executor.acceptance, KV pool, penalty state unchanged: no row of a verify step has
    penalties). inputs.targets holds the drafts (the one after each token, -1 past them); each row's logit bias
    applies at every position. greedy (static): every row has temperature 0. logprobs (static): None, or k: ((tokens,
    sampled, None), KV pool, penalty state) with sampled the raw logits' (token logprob [S, Q], top ids [S, Q, k],
    top logprobs [S, Q, k]) of each kept token (meaningless past them)."""
    model, hidden, kv_pool = _forward(graphdef, state, kv_pool, inputs, StepKind.VERIFY, kernels)
    num_seqs = inputs.num_seqs
    queries = inputs.num_tokens // num_seqs
    raw = model.logits(hidden)  # [T, vocab]: a verify step is a few tokens a sequence
    logits = raw
    if inputs.penalties is not None:  # a logit bias, per row, at every position (no row has penalties)
        row = jnp.arange(raw.shape[0]) // queries
        logits = penalties.apply_logit_bias(raw, inputs.penalties.bias_ids[row], inputs.penalties.bias[row])
    shaped = lambda x: x.reshape((num_seqs, queries) + x.shape[1:])  # noqa: E731  [T, ...] -> [S, Q, ...]
    tokens = accept_drafts(shaped(logits), shaped(inputs.targets), inputs.kv_lens, inputs.temperature, inputs.top_k,
                           inputs.top_p, inputs.seed, greedy=greedy)
    if logprobs is None:
        return tokens, kv_pool, penalty_state
    sampled = token_logprobs(raw, jnp.maximum(tokens, 0).reshape(-1), logprobs)
    return (tokens, tuple(shaped(x) for x in sampled), None), kv_pool, penalty_state


def logits_step(graphdef, state, kv_pool: KVCache, inputs: StepInputs, penalty_state: PenaltyState | None = None, *,
                kernels: Kernels) -> tuple[jax.Array, KVCache, PenaltyState | None]:
    """A prefill step's teacher-forced logits of every token -> ([T, vocab] float32, KV pool, the penalty state
    as it was: no sequence of a teacher-forced step has penalties)."""
    model, hidden, kv_pool = _forward(graphdef, state, kv_pool, inputs, StepKind.PREFILL, kernels)
    return model.logits(hidden), kv_pool, penalty_state
