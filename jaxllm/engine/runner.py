"""The one engine module that touches jax: pads step plans to shape buckets and runs jitted steps.

Shapes come from a small set of buckets, so a long-running server compiles a bounded number of
step functions, all of them at warm-up: a decode step is shaped by its sequence count alone (a
power of two), a prefill/mixed step by its token count alone (a power of two; its sequence axis
padded to the same size, capped at max_seqs), and the rBlock-table width is fixed by the context
limit. A decode step whose sequences are all greedy has its own variant that takes the argmax and
skips sampling's full-vocabulary sort (on an H200 the sampler's kernels take 70 / 133 / 476 us a
step at 1 / 8 / 64 rows, the argmax 5 / 6 / 9: scripts/bench_sampling.py,
benchmarks/results/nvidia-h200-2026-11-24-1114-sampling.json); prefill steps always carry the sampler, so warm-up compiles one more
function per decode bucket only. Every trace of a step function (a cache miss, hence a compile) is
counted in `compile_count`.

`dispatch` queues a step and returns without waiting; `InFlight.tokens()` waits. A decode step can
take its input tokens straight from the previous step's device output, so the host can queue step
N+1 while step N runs instead of leaving the device idle during every dispatch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxllm.engine.kv_cache import AttentionBatch, KVCache
from jaxllm.model.llama import Llama
from jaxllm.engine.sampling import greedy_tokens, sample_tokens
from jaxllm.engine.scheduler import StepPlan
from pallas_kernels import compat


def bucket(n: int, minimum: int) -> int:
    """The smallest power of two >= max(n, minimum)."""
    n = max(n, minimum, 1)
    return 1 << (n - 1).bit_length()


class InFlight:
    """A dispatched step: its plan and its sampled tokens, still on the device until `tokens()`."""

    def __init__(self, plan: StepPlan, device_tokens: jax.Array, sampling: tuple, greedy: bool = False):
        self.plan = plan
        self.greedy = greedy  # ran the greedy-only step variant (every sequence at temperature 0)
        self.device_tokens = device_tokens  # [padded sequences] int32
        self.sampling = sampling  # (temperature, top_k, top_p, seeds), each [padded sequences], on the device
        self._host: np.ndarray | None = None

    def tokens(self) -> np.ndarray:
        """The sampled token of every sequence in the plan ([S] int32); waits for the device."""
        if self._host is None:
            self._host = np.asarray(self.device_tokens)[:len(self.plan.seqs)]
        return self._host


class Runner:
    """Holds the model's state and the KV pool; runs one step at a time."""

    def __init__(self, model: Llama, kv_cache: KVCache, *, max_seqs: int, max_tokens_per_step: int,
                 table_width: int, backend: str = "auto", min_tokens: int = 8):
        self.graphdef, self.state = nnx.split(model)
        self.config = model.config
        self.kv_cache = kv_cache
        self.backend = backend
        self.min_tokens = min_tokens
        self.max_seqs = max_seqs
        self.max_tokens_per_step = max_tokens_per_step
        self.seq_cap = bucket(max_seqs, 1)
        self.table_width = table_width
        self.compile_count = 0
        if compat.on_gpu():
            compat.silence_triton_deprecation()  # jax 0.11 warns on every Triton-lowered kernel it traces
        self._step = jax.jit(self._step_impl, donate_argnums=(1,), static_argnames=("decode", "greedy"))
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
                   sample_params, *, decode: bool, greedy: bool = False):
        self.compile_count += 1
        batch = AttentionBatch(block_tables, kv_lens, cu_q_lens, slot_mapping, decode=decode)
        model, hidden, kv_cache = self._forward(state, kv_cache, tokens, positions, batch)
        last = jnp.maximum(cu_q_lens[1:] - 1, 0)  # each sequence's last query token
        logits = model.logits(hidden[last])  # [S, vocab]
        if greedy:  # every row has temperature 0: sample_tokens would return this argmax too
            return greedy_tokens(logits), kv_cache
        temperature, top_k, top_p, seeds = sample_params
        next_tokens = sample_tokens(logits, temperature, top_k, top_p, seeds, kv_lens)
        return next_tokens, kv_cache

    def _logits_impl(self, state, kv_cache, tokens, positions, block_tables, kv_lens, cu_q_lens, slot_mapping):
        self.compile_count += 1
        batch = AttentionBatch(block_tables, kv_lens, cu_q_lens, slot_mapping, decode=False)
        model, hidden, kv_cache = self._forward(state, kv_cache, tokens, positions, batch)
        return model.logits(hidden), kv_cache

    # ----- padding to buckets -----

    def _padded_sizes(self, decode: bool, size: int) -> tuple[int, int]:
        """(tokens, sequences) a step is padded to: `size` is its sequence count (decode) or token count.

        The one bucket rule: _pad follows it, and bucket_shapes (which warm-up compiles) lists the sizes
        it rounds to, so warm-up compiles exactly the shapes serving meets.
        """
        if decode:
            s_pad = bucket(size, 1)
            return s_pad, s_pad
        t_pad = bucket(size, self.min_tokens)
        return t_pad, min(t_pad, self.seq_cap)

    @staticmethod
    def _default_sampling(s_pad: int):
        """Greedy parameters for s_pad rows (padding rows keep them)."""
        return (np.zeros(s_pad, np.float32), np.zeros(s_pad, np.int32), np.ones(s_pad, np.float32),
                np.zeros(s_pad, np.int32))

    def _pad(self, plan: StepPlan):
        num_seqs, num_tokens = len(plan.seqs), plan.num_tokens
        decode = plan.is_decode
        t_pad, s_pad = self._padded_sizes(decode, num_seqs if decode else num_tokens)
        w_pad = self.table_width
        if plan.block_tables.shape[1] > w_pad or num_seqs > s_pad:
            raise ValueError(f"step plan of {num_seqs} sequences x {plan.block_tables.shape[1]} rBlocks exceeds the "
                             f"runner's limits ({s_pad} x {w_pad})")
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

    def dispatch(self, plan: StepPlan, *, token_source: InFlight | None = None) -> InFlight:
        """Start one step on the device and return at once, without waiting for its tokens.

        token_source: the in-flight (or finished) step this one continues (Scheduler.plan_continuation):
        a decode step of the same sequences in the same order. Its sampled-token array, still on the
        device, becomes this step's input tokens, so step N+1 is queued before step N's tokens reach the
        host. Both are decode steps of the same sequence count, hence the same padded size.
        """
        decode, tokens, positions, tables, kv_lens, cu, slots = self._pad(plan)
        s_pad = len(kv_lens)
        if token_source is not None:
            src = token_source.plan
            if not (decode and src.is_decode and len(src.seqs) == len(plan.seqs)
                    and all(a is b for a, b in zip(src.seqs, plan.seqs))):
                raise ValueError("token_source must be a decode step of the same sequences, in the same order, "
                                 f"as the step it feeds ({len(src.seqs)} vs {len(plan.seqs)} sequences)")
            tokens = token_source.device_tokens
            sampling = token_source.sampling  # same sequences, same order: same parameters
            greedy = token_source.greedy
        else:
            if np.any(plan.token_ids < 0):
                raise ValueError("the plan's token ids are placeholders (a continuation step): pass token_source")
            sampling, all_greedy = self._sampling(plan, s_pad)
            greedy = decode and all_greedy
        next_tokens, self.kv_cache = self._step(self.state, self.kv_cache, tokens, positions, tables, kv_lens, cu,
                                                slots, sampling, decode=decode, greedy=greedy)
        return InFlight(plan, next_tokens, sampling, greedy)

    def step(self, plan: StepPlan) -> np.ndarray:
        """Run one step and wait for it; returns the sampled token of every sequence in the plan ([S] int32)."""
        return self.dispatch(plan).tokens()

    @classmethod
    def _sampling(cls, plan: StepPlan, s_pad: int):
        temperature, top_k, top_p, seeds = cls._default_sampling(s_pad)
        for i, seq in enumerate(plan.seqs):
            p = seq.params
            temperature[i], top_k[i], top_p[i], seeds[i] = p.temperature, p.top_k, p.top_p, p.seed
        # On the device once, so the continuation steps that reuse them transfer nothing. Padding rows
        # are greedy, so "no row samples" is "every sequence is greedy".
        return jax.device_put((temperature, top_k, top_p, seeds)), not np.any(temperature > 0)

    def logits(self, plan: StepPlan) -> np.ndarray:
        """Teacher-forced logits [T, vocab] (float32) of every token in a prefill plan."""
        _, tokens, positions, tables, kv_lens, cu, slots = self._pad(plan)
        out, self.kv_cache = self._logits(self.state, self.kv_cache, tokens, positions, tables, kv_lens, cu, slots)
        return np.asarray(out)[:plan.num_tokens]

    def bucket_shapes(self) -> list[tuple[bool, int, bool]]:
        """Every (decode, size, greedy) a step can take: sequences for decode, tokens for prefill; decode
        steps in both variants (greedy only, or with the sampler)."""
        shapes = [(True, 1 << i, greedy) for i in range(self.seq_cap.bit_length()) for greedy in (False, True)]
        t = bucket(self.min_tokens, 1)
        while True:
            shapes.append((False, t, False))
            if t >= self.max_tokens_per_step:
                break
            t *= 2
        return shapes

    def warm_up(self, progress: bool = True) -> None:
        """Compile every step shape now, so serving compiles nothing new."""
        from jaxllm.progress import Progress

        shapes = self.bucket_shapes()
        with Progress(len(shapes), "warm-up compiles", enabled=progress) as bar:
            for decode, size, greedy in shapes:
                tokens, self.kv_cache = self._step(self.state, self.kv_cache, *self._warm_up_args(decode, size),
                                                   decode=decode, greedy=greedy)
                tokens.block_until_ready()
                bar.update(1, detail=f"{'decode' if decode else 'prefill'} {size}{' greedy' if greedy else ''}")

    def _warm_up_args(self, decode: bool, size: int):
        # Real shapes, inert values: every token's slot is -1 (nothing written) and every kv_len 0.
        t_pad, s_pad = self._padded_sizes(decode, size)  # size is a bucket already: t_pad == size
        tokens = np.zeros(t_pad, np.int32)
        slots = np.full(t_pad, -1, np.int32)
        tables = np.zeros((s_pad, self.table_width), np.int32)
        kv_lens = np.zeros(s_pad, np.int32)
        cu = np.arange(s_pad + 1, dtype=np.int32) if decode else np.zeros(s_pad + 1, np.int32)
        return tokens, tokens.copy(), tables, kv_lens, cu, slots, self._default_sampling(s_pad)
