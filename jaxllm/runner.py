"""The one engine module that touches jax: pads step plans to shape buckets and runs jitted steps.

Shapes come from a small set of buckets (powers of two in tokens, sequences and rBlock-table
width), so a long-running server compiles a bounded number of step functions. Every trace of a
step function (a cache miss, hence a compile) is counted in `compile_count`.
"""

from __future__ import annotations

from typing import Iterable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxllm.kv_cache import AttentionBatch, KVCache
from jaxllm.model import Llama
from jaxllm.sampling import sample_tokens
from jaxllm.scheduler import StepPlan


def bucket(n: int, minimum: int) -> int:
    """The smallest power of two >= max(n, minimum)."""
    n = max(n, minimum, 1)
    return 1 << (n - 1).bit_length()


class Runner:
    """Holds the model's state and the KV pool; runs one step at a time."""

    def __init__(self, model: Llama, kv_cache: KVCache, *, backend: str = "auto", min_tokens: int = 8,
                 min_table_width: int = 4):
        self.graphdef, self.state = nnx.split(model)
        self.config = model.config
        self.kv_cache = kv_cache
        self.backend = backend
        self.min_tokens = min_tokens
        self.min_table_width = min_table_width
        self.compile_count = 0
        self._step = jax.jit(self._step_impl, donate_argnums=(1,), static_argnames=("decode",))
        self._logits = jax.jit(self._logits_impl, donate_argnums=(1,))

    @property
    def block_size(self) -> int:
        return self.kv_cache.block_size

    # ----- traced bodies (a Python side effect here runs once per compile) -----

    def _forward(self, state, kv_cache, tokens, positions, batch):
        model = nnx.merge(self.graphdef, state)
        hidden, kv_cache = model(tokens, positions, kv_cache, batch, backend=self.backend)
        return model, hidden, kv_cache

    def _step_impl(self, state, kv_cache, tokens, positions, block_tables, kv_lens, cu_q_lens, slot_mapping,
                   sample_params, *, decode: bool):
        self.compile_count += 1
        batch = AttentionBatch(block_tables, kv_lens, cu_q_lens, slot_mapping, decode=decode)
        model, hidden, kv_cache = self._forward(state, kv_cache, tokens, positions, batch)
        last = jnp.maximum(cu_q_lens[1:] - 1, 0)  # each sequence's last query token
        logits = model.logits(hidden[last])  # [S, vocab]
        temperature, top_k, top_p, seeds = sample_params
        next_tokens = sample_tokens(logits, temperature, top_k, top_p, seeds, kv_lens)
        return next_tokens, kv_cache

    def _logits_impl(self, state, kv_cache, tokens, positions, block_tables, kv_lens, cu_q_lens, slot_mapping):
        self.compile_count += 1
        batch = AttentionBatch(block_tables, kv_lens, cu_q_lens, slot_mapping, decode=False)
        model, hidden, kv_cache = self._forward(state, kv_cache, tokens, positions, batch)
        return model.logits(hidden), kv_cache

    # ----- padding to buckets -----

    def _pad(self, plan: StepPlan):
        num_seqs, num_tokens = len(plan.seqs), plan.num_tokens
        decode = plan.is_decode
        s_pad = bucket(num_seqs, 1)
        t_pad = s_pad if decode else bucket(num_tokens, self.min_tokens)
        w_pad = bucket(plan.block_tables.shape[1], self.min_table_width)
        tokens = np.zeros(t_pad, np.int32)
        tokens[:num_tokens] = plan.token_ids
        positions = np.zeros(t_pad, np.int32)
        positions[:num_tokens] = plan.positions
        slots = np.full(t_pad, -1, np.int32)  # padding tokens write nowhere
        slots[:num_tokens] = plan.slot_mapping
        tables = np.zeros((s_pad, w_pad), np.int32)
        tables[:num_seqs, :plan.block_tables.shape[1]] = plan.block_tables
        kv_lens = np.zeros(s_pad, np.int32)
        kv_lens[:num_seqs] = plan.kv_lens
        cu = np.full(s_pad + 1, num_tokens, np.int32)  # padding sequences have no query tokens
        cu[:num_seqs + 1] = plan.cu_q_lens
        if decode:
            # Keep cu == arange for the decode kernel's contract: padded sequences get one padding token
            # each, with kv_len 0, so they attend to nothing.
            cu = np.arange(s_pad + 1, dtype=np.int32)
        return decode, tokens, positions, tables, kv_lens, cu, slots

    # ----- public -----

    def step(self, plan: StepPlan) -> np.ndarray:
        """Run one step; returns the sampled token of every sequence in the plan ([S] int32)."""
        decode, tokens, positions, tables, kv_lens, cu, slots = self._pad(plan)
        s_pad = len(kv_lens)
        temperature = np.zeros(s_pad, np.float32)
        top_k = np.zeros(s_pad, np.int32)
        top_p = np.ones(s_pad, np.float32)
        seeds = np.zeros(s_pad, np.int32)
        for i, seq in enumerate(plan.seqs):
            p = seq.params
            temperature[i], top_k[i], top_p[i], seeds[i] = p.temperature, p.top_k, p.top_p, p.seed
        next_tokens, self.kv_cache = self._step(self.state, self.kv_cache, tokens, positions, tables, kv_lens, cu,
                                                slots, (temperature, top_k, top_p, seeds), decode=decode)
        return np.asarray(next_tokens)[:len(plan.seqs)]

    def logits(self, plan: StepPlan) -> np.ndarray:
        """Teacher-forced logits [T, vocab] (float32) of every token in a prefill plan."""
        _, tokens, positions, tables, kv_lens, cu, slots = self._pad(plan)
        out, self.kv_cache = self._logits(self.state, self.kv_cache, tokens, positions, tables, kv_lens, cu, slots)
        return np.asarray(out)[:plan.num_tokens]

    def warm_up(self, plans: Iterable[StepPlan]) -> None:
        for plan in plans:
            self.step(plan)
