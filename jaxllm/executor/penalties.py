"""Penalties and logit bias on the device: the penalty state, a step's penalty inputs, and the logits they make.

The semantics are vLLM's (jaxllm.contract.sampling_params says them in full): logit bias first, then the
repetition penalty (every token of the prompt or of the generated tokens), then the frequency and presence
penalties (generated tokens only), then temperature / top-k / top-p as before. Log-probabilities stay the raw
model's.

The state lives on the device beside the KV pool, passed into every step and returned (donated: updated in
place), never stored in a module: per instance, one row ("slot") per sequence that may run at once (max_seqs),

    counts [slots, vocab] int32: how often each token occurs among the slot's sequence's generated tokens;
    prompt [slots, vocab] bool:  whether it occurs in its prompt.

On several instances both are [instances * slots, vocab], split over `instance` like the pool. The scheduler
hands a slot to a sequence with penalties when it admits it and takes it back when it ends or is preempted
(jaxllm.engine.scheduler). A step learns a sequence's tokens as it reads them (`read_tokens`): the first step
after admission clears the slot, prompt tokens go into `prompt`, and generated tokens computed again after a
preemption into `counts`; every token it samples is counted (`count_sampled`). So the state needs no history
from the host, and every value is a per-row array: new penalties compile nothing.

Cost: (4 + 1) bytes x slots x vocab per instance, e.g. 41 MB for a 32K vocabulary and 164 MB for a 128K one at
max_seqs 256 (`state_bytes`). Steps whose rows are all greedy and unpenalized run the greedy variant, which
only passes the state through (no work); a sampling step reads the state's rows of its sequences (one pass
over [sequences, vocab], beside the sampler's sort over the same) whether or not a row is penalized.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.contract import RowPenalties, StepPlan

__all__ = ["PenaltyInputs", "PenaltyState", "apply_logit_bias", "apply_penalties", "count_sampled",
           "inert_penalty_inputs", "init_penalty_state", "penalty_inputs", "process_logits", "read_tokens",
           "state_bytes"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PenaltyState:
    """counts [slots, vocab] int32 (generated tokens), prompt [slots, vocab] bool (prompt tokens); see the module
    docstring."""

    counts: jax.Array
    prompt: jax.Array


def state_bytes(slots: int, vocab: int) -> int:
    """Bytes of one instance's penalty state."""
    return slots * vocab * (4 + 1)


def init_penalty_state(slots: int, vocab: int, sharding) -> PenaltyState:
    """The zeroed state of `slots` rows (every instance's together), created in its shards."""
    make = lambda: PenaltyState(jnp.zeros((slots, vocab), jnp.int32), jnp.zeros((slots, vocab), bool))  # noqa: E731
    return jax.jit(make, out_shardings=PenaltyState(sharding, sharding))()


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PenaltyInputs:
    """A step's penalty inputs, padded to its S sequences (StepInputs.penalties; padding rows inert).

    slot, start, prompt_len, recount_end [S] int32 and frequency, presence, repetition [S] float32: the plan's
    RowPenalties (slot -1: the row has no penalties); sample [S] bool: the row's sampled token is kept (its
    chunk ends at the sequence's last token), so it is counted; bias_ids [S, B] int32 (-1: padding) and bias
    [S, B] float32: each row's logit_bias, B the engine's max_logit_bias.
    """

    slot: np.ndarray | jax.Array
    start: np.ndarray | jax.Array
    prompt_len: np.ndarray | jax.Array
    recount_end: np.ndarray | jax.Array
    sample: np.ndarray | jax.Array
    frequency: np.ndarray | jax.Array
    presence: np.ndarray | jax.Array
    repetition: np.ndarray | jax.Array
    bias_ids: np.ndarray | jax.Array
    bias: np.ndarray | jax.Array


def inert_penalty_inputs(num_seqs: int, bias_width: int) -> PenaltyInputs:
    """Rows without penalties or bias (host arrays)."""
    rows = RowPenalties.inert(num_seqs)
    return PenaltyInputs(slot=rows.slot, start=rows.start, prompt_len=rows.prompt_len, recount_end=rows.recount_end,
                         sample=np.zeros(num_seqs, bool), frequency=rows.frequency, presence=rows.presence,
                         repetition=rows.repetition, bias_ids=np.full((num_seqs, bias_width), -1, np.int32),
                         bias=np.zeros((num_seqs, bias_width), np.float32))


def penalty_inputs(plan: StepPlan, num_seqs: int, bias_width: int) -> PenaltyInputs:
    """The plan's penalties and bias padded to num_seqs rows (host arrays); ValueError when a row has more bias
    entries than bias_width."""
    out = inert_penalty_inputs(num_seqs, bias_width)
    n = plan.num_seqs
    if plan.penalties is not None:
        for f in dataclasses.fields(RowPenalties):
            getattr(out, f.name)[:n] = getattr(plan.penalties, f.name)
    out.sample[:n] = plan.sample
    if plan.logit_bias is not None:
        width = plan.logit_bias.ids.shape[1]
        if width > bias_width:
            raise ValueError(f"a row of the plan has {width} logit_bias entries; the engine's limit is {bias_width}")
        out.bias_ids[:n, :width] = plan.logit_bias.ids
        out.bias[:n, :width] = plan.logit_bias.values
    return out


# ----- on the device (per instance: one instance's rows and state) -----

def read_tokens(state: PenaltyState, inputs: PenaltyInputs, tokens: jax.Array, positions: jax.Array,
                cu_q_lens: jax.Array) -> PenaltyState:
    """The state after a step reads its input tokens: each penalized row at its first step after admission (its
    first token at its `start`) clears its slot first; prompt tokens set `prompt`, generated tokens computed again
    after a preemption (positions in [prompt_len, recount_end)) are counted.

    tokens, positions [T] int32; cu_q_lens [S+1] int32 (a padding row holds no token, or one at kv_len 0)."""
    slots = state.counts.shape[0]
    num_seqs, num_tokens = inputs.slot.shape[0], tokens.shape[0]
    row = jnp.searchsorted(cu_q_lens[1:], jnp.arange(num_tokens), side="right")  # [T]; padding tokens: S
    real = row < num_seqs
    row = jnp.minimum(row, num_seqs - 1)
    slot = jnp.where(real, inputs.slot[row], -1)  # [T]
    first = inputs.slot >= 0
    first &= positions[jnp.minimum(cu_q_lens[:-1], num_tokens - 1)] == inputs.start  # [S]
    cleared = jnp.where(first, inputs.slot, slots)  # out of range: dropped (a negative index would wrap)
    counts = state.counts.at[cleared].set(0, mode="drop")
    prompt = state.prompt.at[cleared].set(False, mode="drop")
    in_prompt = (slot >= 0) & (positions < inputs.prompt_len[row])
    recounted = (slot >= 0) & ~in_prompt & (positions < inputs.recount_end[row])
    prompt = prompt.at[jnp.where(in_prompt, slot, slots), tokens].set(True, mode="drop")
    counts = counts.at[jnp.where(recounted, slot, slots), tokens].add(1, mode="drop")
    return PenaltyState(counts, prompt)


def process_logits(logits: jax.Array, state: PenaltyState, inputs: PenaltyInputs) -> jax.Array:
    """[S, vocab] float32 logits -> the same with each row's logit bias and penalties (rows without: unchanged)."""
    biased = apply_logit_bias(logits, inputs.bias_ids, inputs.bias)
    slot = jnp.maximum(inputs.slot, 0)
    penalized = apply_penalties(biased, state.counts[slot], state.prompt[slot], inputs.frequency, inputs.presence,
                                inputs.repetition)
    return jnp.where((inputs.slot >= 0)[:, None], penalized, biased)


def count_sampled(state: PenaltyState, inputs: PenaltyInputs, tokens: jax.Array) -> PenaltyState:
    """The state with each penalized row's sampled token [S] counted, where the row keeps it (`sample`)."""
    kept = jnp.where((inputs.slot >= 0) & inputs.sample, inputs.slot, state.counts.shape[0])
    return PenaltyState(state.counts.at[kept, tokens].add(1, mode="drop"), state.prompt)


def apply_logit_bias(logits: jax.Array, ids: jax.Array, bias: jax.Array) -> jax.Array:
    """logits [S, vocab] + each row's bias at its ids ([S, B]; id -1: padding)."""
    if ids.shape[-1] == 0:
        return logits
    ids = jnp.where(ids >= 0, ids, logits.shape[-1])  # out of range: dropped
    return logits.at[jnp.arange(logits.shape[0])[:, None], ids].add(bias, mode="drop")


def apply_penalties(logits: jax.Array, counts: jax.Array, prompt: jax.Array, frequency: jax.Array,
                    presence: jax.Array, repetition: jax.Array) -> jax.Array:
    """vLLM's penalties on rows of logits.

    Args:
      logits: [S, vocab] float32; counts: [S, vocab] int32, each token's occurrences among the generated tokens;
      prompt: [S, vocab] bool, the prompt's tokens; frequency, presence, repetition: [S] float32.
    Returns:
      [S, vocab] float32: a token of the prompt or generated divided by repetition where its logit is positive,
      multiplied by it elsewhere; then minus frequency * count and presence * (count > 0). Penalties (0, 0, 1)
      leave a row exactly as it was.
    """
    generated = counts > 0
    r = repetition[:, None]
    logits = jnp.where(prompt | generated, jnp.where(logits > 0, logits / r, logits * r), logits)
    return logits - frequency[:, None] * counts - presence[:, None] * generated
