"""One step's work as plain NumPy arrays and ids: what a scheduler hands the executor (no jax here).

The scheduler (jaxllm.engine) builds a `StepPlan`; the executor (jaxllm.executor) pads it to a shape
bucket and runs it; the tuner (jaxllm.tuner) reads its lengths to choose the step's kernels. It sits
below all three so that none of them imports another to speak about a step.
"""

from __future__ import annotations

import dataclasses

import numpy as np

# token_ids of a continuation step (the scheduler's plan_continuation): the real ids are still on the device.
PENDING_TOKEN = -1


def kv_extent_of(kv_lens: np.ndarray) -> tuple[int, int]:
    """(total, longest) of kv_lens as Python ints ((0, 0) for none): two reductions."""
    if len(kv_lens) == 0:
        return 0, 0
    return int(np.add.reduce(kv_lens, dtype=np.int64)), int(np.maximum.reduce(kv_lens))


@dataclasses.dataclass(frozen=True, eq=False)
class StepPlan:
    """One step's work as plain numpy arrays and ids (unpadded; the executor pads them to a bucket).

    seq_ids [S] int64 (the scheduler maps them back to its sequences); token_ids, positions,
    slot_mapping: [T] int32; cu_q_lens [S+1]; kv_lens [S]; block_tables [S, W]; sample [S] bool: the
    chunk ends at the sequence's last token, so its logits sample a new one. temperature, top_p [S]
    float32, top_k, seed [S] int32: each sequence's SamplingParams. logprobs [S] int32: top tokens
    each sequence wants log-probabilities of (SamplingParams.logprobs; -1: none); None: nobody wants any.

    instances [S] int32: each sequence's home instance on an engine of several instances (rows grouped by
    instance, in instance order; block ids are then global: instance * blocks_per_instance + local); None
    on one instance (every row's home is instance 0).
    targets [T] int32: for a token whose sequence wants prompt log-probabilities, the prompt token that follows it
    (whose log-probability its logits give); -1 elsewhere. None: no token of the step wants one.
    block_copies [M, 2] int32: rBlocks (global source id, global destination id) the device copies before
    this step, all reads before any write (DistKV recalls: borrowed rBlocks going home); None: none.
    kv_extent: (total, longest) of kv_lens as Python ints; computed here unless given (the scheduler gives a
    continuation its source's, grown by one token a sequence: the tuner's per-step key reads it, so a steady
    decode step costs no reduction over the batch).
    """

    seq_ids: np.ndarray
    token_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    cu_q_lens: np.ndarray
    kv_lens: np.ndarray
    block_tables: np.ndarray
    sample: np.ndarray
    temperature: np.ndarray
    top_k: np.ndarray
    top_p: np.ndarray
    seed: np.ndarray
    logprobs: np.ndarray | None = None
    instances: np.ndarray | None = None
    targets: np.ndarray | None = None
    block_copies: np.ndarray | None = None
    kv_extent: tuple[int, int] | None = None

    def __post_init__(self):
        s, t = len(self.seq_ids), len(self.token_ids)
        for name, n in (("positions", t), ("slot_mapping", t), ("cu_q_lens", s + 1), ("kv_lens", s),
                        ("block_tables", s), ("sample", s), ("temperature", s), ("top_k", s), ("top_p", s),
                        ("seed", s)):
            if len(getattr(self, name)) != n:
                raise ValueError(f"StepPlan.{name} has {len(getattr(self, name))} rows, want {n} "
                                 f"({s} sequences, {t} tokens)")
        for name in ("logprobs", "instances"):
            value = getattr(self, name)
            if value is not None and len(value) != s:
                raise ValueError(f"StepPlan.{name} has {len(value)} rows, want {s} ({s} sequences)")
        if self.targets is not None and len(self.targets) != t:
            raise ValueError(f"StepPlan.targets has {len(self.targets)} rows, want {t} ({t} tokens)")
        if self.block_copies is not None and (self.block_copies.ndim != 2 or self.block_copies.shape[1] != 2):
            raise ValueError(f"StepPlan.block_copies must be [copies, 2] (source, destination), got "
                             f"{self.block_copies.shape}")
        if self.kv_extent is None:  # a derived field: frozen, so set once here
            object.__setattr__(self, "kv_extent", kv_extent_of(self.kv_lens))

    @property
    def num_seqs(self) -> int:
        return len(self.seq_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def __len__(self) -> int:
        return len(self.seq_ids)

    @property
    def is_decode(self) -> bool:
        return len(self.token_ids) == len(self.seq_ids)

    @property
    def wants_logprobs(self) -> bool:
        """Some sequence samples a token in this step and wants its log-probabilities, or some token of the step
        is a prompt token whose sequence wants the prompt's."""
        sampled = self.logprobs is not None and bool(np.any(self.sample & (self.logprobs >= 0)))
        return sampled or self.targets is not None

    def instance_bounds(self, instances: int) -> np.ndarray:
        """[instances + 1] row offsets: instance i's rows are [bounds[i], bounds[i + 1]) (rows are grouped by
        instance). ValueError when the rows are not grouped in instance order or name an instance past the end."""
        if self.instances is None:
            return np.array([0] + [self.num_seqs] * instances, np.int64)
        homes = self.instances.astype(np.int64)
        if len(homes) and (homes.min() < 0 or homes.max() >= instances):
            raise ValueError(f"plan names instance {int(homes.max())}; the engine has {instances}")
        if np.any(np.diff(homes) < 0):
            raise ValueError("a joined plan's rows must be grouped by instance, in instance order")
        return np.searchsorted(homes, np.arange(instances + 1), side="left").astype(np.int64)

    def rows(self, first: int, last: int, *, kv_extent: tuple[int, int] | None = None) -> StepPlan:
        """The plan of rows [first, last) alone (their tokens packed from 0; views, no copy of the tables);
        no block copies (they belong to the step, not to its rows)."""
        t0, t1 = int(self.cu_q_lens[first]), int(self.cu_q_lens[last])
        pick = lambda x: None if x is None else x[first:last]  # noqa: E731
        return StepPlan(
            seq_ids=self.seq_ids[first:last], token_ids=self.token_ids[t0:t1], positions=self.positions[t0:t1],
            slot_mapping=self.slot_mapping[t0:t1], cu_q_lens=self.cu_q_lens[first:last + 1] - t0,
            kv_lens=self.kv_lens[first:last], block_tables=self.block_tables[first:last], sample=self.sample[first:last],
            temperature=self.temperature[first:last], top_k=self.top_k[first:last], top_p=self.top_p[first:last],
            seed=self.seed[first:last], logprobs=pick(self.logprobs), instances=pick(self.instances),
            targets=None if self.targets is None else self.targets[t0:t1], kv_extent=kv_extent)
