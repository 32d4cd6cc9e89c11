"""One step's work as plain NumPy arrays and ids: what a scheduler hands the executor (no jax here).

The scheduler (jaxllm.engine) builds a `StepPlan`; the executor (jaxllm.executor) pads it to a shape
bucket and runs it; the tuner (jaxllm.tuner) reads its lengths to choose the step's kernels. It sits
below all three so that none of them imports another to speak about a step.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxllm.contract.host_copies import HostCopies
from jaxllm.contract.step_kind import StepKind

# token_ids of a continuation step (the scheduler's plan_continuation): the real ids are still on the device.
PENDING_TOKEN = -1


def kv_extent_of(kv_lens: np.ndarray) -> tuple[int, int]:
    """(total, longest) of kv_lens as Python ints ((0, 0) for none): two reductions."""
    if len(kv_lens) == 0:
        return 0, 0
    return int(np.add.reduce(kv_lens, dtype=np.int64)), int(np.maximum.reduce(kv_lens))


@dataclasses.dataclass(frozen=True, eq=False)
class RowPenalties:
    """Each row's penalties in a step where some sequence has them (SamplingParams.penalized), [S] each.

    slot int32: the sequence's row of its instance's penalty state (-1: the row has no penalties, and the other
    fields are inert); start int32: the position its first step after admission starts at (the step whose first
    token sits there clears the slot first); prompt_len int32: its prompt's tokens; recount_end int32: its
    tokens at admission: an input token at a position in [prompt_len, recount_end) is a generated token computed
    again after a preemption, counted as it is read (tokens sampled later are counted as they are sampled);
    frequency, presence, repetition float32: SamplingParams' (0, 0, 1 on a row without penalties).
    """

    slot: np.ndarray
    start: np.ndarray
    prompt_len: np.ndarray
    recount_end: np.ndarray
    frequency: np.ndarray
    presence: np.ndarray
    repetition: np.ndarray

    def rows(self, first: int, last: int) -> RowPenalties:
        return RowPenalties(**{f.name: getattr(self, f.name)[first:last] for f in dataclasses.fields(self)})

    @staticmethod
    def inert(rows: int) -> RowPenalties:
        """Rows without penalties."""
        ints = lambda: np.zeros(rows, np.int32)  # noqa: E731  (a fresh array each: callers fill them in)
        return RowPenalties(slot=np.full(rows, -1, np.int32), start=ints(), prompt_len=ints(), recount_end=ints(),
                            frequency=np.zeros(rows, np.float32), presence=np.zeros(rows, np.float32),
                            repetition=np.ones(rows, np.float32))

    @staticmethod
    def join(parts: list[RowPenalties | None], sizes: list[int]) -> RowPenalties | None:
        """Parts of `sizes` rows each, end to end (None: rows without penalties); None if every part is."""
        if all(p is None for p in parts):
            return None
        parts = [RowPenalties.inert(n) if p is None else p for p, n in zip(parts, sizes)]
        return RowPenalties(**{f.name: np.concatenate([getattr(p, f.name) for p in parts])
                               for f in dataclasses.fields(RowPenalties)})


@dataclasses.dataclass(frozen=True, eq=False)
class LogitBias:
    """Each row's logit_bias in a step where some sequence has one: ids [S, B] int32 (-1: padding), values [S, B]
    float32, B the most entries of any row."""

    ids: np.ndarray
    values: np.ndarray

    @staticmethod
    def join(parts: list[LogitBias | None], sizes: list[int]) -> LogitBias | None:
        """Parts of `sizes` rows each, end to end (None: rows without a bias); None if every part is."""
        if all(p is None for p in parts):
            return None
        width = max(p.ids.shape[1] for p in parts if p is not None)
        ids = np.full((sum(sizes), width), -1, np.int32)
        values = np.zeros((sum(sizes), width), np.float32)
        row = 0
        for p, n in zip(parts, sizes):
            if p is not None:
                ids[row:row + n, :p.ids.shape[1]] = p.ids
                values[row:row + n, :p.ids.shape[1]] = p.values
            row += n
        return LogitBias(ids, values)


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
    targets [T] int32: the token that follows a token where the step checks it against the token's logits: in a
    prefill or decode step, for a token whose sequence wants prompt log-probabilities, the prompt token after it
    (whose log-probability its logits give); in a verify step the draft token after it (accepted or rejected by
    its logits). -1 elsewhere. None: no token of the step has one.
    block_copies [M, 2] int32: rBlocks (global source id, global destination id) the device copies before
    this step, all reads before any write (DistKV recalls: borrowed rBlocks going home); None: none.
    host_copies: HostCopies, rBlocks the device copies to and from the host tier before this step (its out copies
    before block_copies, its in copies after); None: none.
    penalties: RowPenalties, when some row has penalties (None: none has); logit_bias: LogitBias, when some row has
    a logit bias (None: none has).
    kv_extent: (total, longest) of kv_lens as Python ints; computed here unless given (the scheduler gives a
    continuation its source's, grown by one token a sequence: the tuner's per-step key reads it, so a steady
    decode step costs no reduction over the batch).
    kind: the step's StepKind; derived here unless given: DECODE when every sequence has one token (T == S),
    else PREFILL. A DECODE plan must have one token a sequence. A VERIFY plan (speculative decoding; always given)
    has Q >= 2 tokens in every row (the engine's k + 1): its last token, its draft tokens (targets names them, at
    the token before each), then fillers (tokens whose KV is written but never kept); every row samples, and no row
    has penalties.
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
    penalties: RowPenalties | None = None
    logit_bias: LogitBias | None = None
    kv_extent: tuple[int, int] | None = None
    host_copies: HostCopies | None = None
    kind: StepKind | None = None

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
        if self.penalties is not None and any(len(getattr(self.penalties, f.name)) != s
                                              for f in dataclasses.fields(RowPenalties)):
            raise ValueError(f"StepPlan.penalties must have {s} rows ({s} sequences)")
        if self.logit_bias is not None and (self.logit_bias.ids.shape != self.logit_bias.values.shape
                                            or len(self.logit_bias.ids) != s):
            raise ValueError(f"StepPlan.logit_bias ids and values must both be [{s}, entries] ({s} sequences), got "
                             f"{self.logit_bias.ids.shape} and {self.logit_bias.values.shape}")
        if self.targets is not None and len(self.targets) != t:
            raise ValueError(f"StepPlan.targets has {len(self.targets)} rows, want {t} ({t} tokens)")
        if self.block_copies is not None and (self.block_copies.ndim != 2 or self.block_copies.shape[1] != 2):
            raise ValueError(f"StepPlan.block_copies must be [copies, 2] (source, destination), got "
                             f"{self.block_copies.shape}")
        if self.kv_extent is None:  # a derived field: frozen, so set once here
            object.__setattr__(self, "kv_extent", kv_extent_of(self.kv_lens))
        if self.kind is None:
            object.__setattr__(self, "kind", StepKind.DECODE if t == s else StepKind.PREFILL)
        elif self.kind is StepKind.DECODE and t != s:
            raise ValueError(f"a decode StepPlan has one token a sequence; this one has {t} tokens for {s} sequences")
        elif self.kind is StepKind.VERIFY:
            q_lens = np.diff(self.cu_q_lens)
            if s and (q_lens[0] < 2 or np.any(q_lens != q_lens[0])):
                raise ValueError(f"a verify StepPlan has the same k + 1 >= 2 tokens in every row, got {q_lens.tolist()}")
            if not bool(np.all(self.sample)) or self.penalties is not None or self.targets is None:
                raise ValueError("a verify StepPlan's rows all sample, none has penalties, and targets names the "
                                 "drafts")

    @property
    def num_seqs(self) -> int:
        return len(self.seq_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def __len__(self) -> int:
        return len(self.seq_ids)

    @property
    def verify_queries(self) -> int:
        """Q, the tokens every row of a verify step has (the engine's k + 1); 0 for any other step."""
        if self.kind is not StepKind.VERIFY or not self.num_seqs:
            return 0
        return int(self.cu_q_lens[1] - self.cu_q_lens[0])

    @property
    def draft_lens(self) -> np.ndarray:
        """[S] int: each row's draft tokens in a verify step; zeros in any other step."""
        if self.kind is not StepKind.VERIFY:
            return np.zeros(self.num_seqs, np.int64)
        return (self.targets >= 0).reshape(self.num_seqs, -1).sum(axis=1).astype(np.int64)

    @property
    def scores_prompt(self) -> bool:
        """Some token of the step is a prompt token whose sequence wants the prompt's log-probabilities."""
        return self.targets is not None and self.kind is not StepKind.VERIFY

    @property
    def wants_logprobs(self) -> bool:
        """Some sequence samples a token in this step and wants its log-probabilities, or some token of the step
        is a prompt token whose sequence wants the prompt's."""
        sampled = self.logprobs is not None and bool(np.any(self.sample & (self.logprobs >= 0)))
        return sampled or self.scores_prompt

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

    @staticmethod
    def copies_only(*, block_copies: np.ndarray | None = None, host_copies: HostCopies | None = None,
                    instances: bool = False) -> StepPlan:
        """A step of copies alone: no rows (instances: an empty `instances` array, as a joined plan has)."""
        empty = np.zeros(0, np.int32)
        return StepPlan(seq_ids=np.zeros(0, np.int64), token_ids=empty, positions=empty, slot_mapping=empty,
                        cu_q_lens=np.zeros(1, np.int32), kv_lens=empty, block_tables=np.zeros((0, 1), np.int32),
                        sample=np.zeros(0, bool), temperature=np.zeros(0, np.float32), top_k=empty,
                        top_p=np.zeros(0, np.float32), seed=empty, instances=empty if instances else None,
                        block_copies=block_copies, host_copies=host_copies)

    def next_decode(self, block_size: int, block_tables: np.ndarray | None = None, *,
                    host_copies: HostCopies | None = None) -> StepPlan:
        """The decode step after this one, while this one's sampled tokens are still on the devices (the
        scheduler's plan_continuation): the same rows in the same order, one PENDING_TOKEN each at the next
        position, kv_lens one longer, each token's KV slot read from `block_tables` (this plan's unless some row's
        table grew: then the caller passes the new tables, [S, W'] with W' >= W). The per-row values that a decode
        step does not move (sampling, logprobs, instances, penalties, logit bias) are this plan's arrays, shared:
        equal to what assembling the rows anew gives, without a pass over the sequences."""
        if self.kind is not StepKind.DECODE:
            raise ValueError(f"next_decode continues a decode step, not a {self.kind.label} step")
        tables = self.block_tables if block_tables is None else block_tables
        if tables.shape[0] != self.num_seqs or tables.shape[1] < self.block_tables.shape[1]:
            raise ValueError(f"next_decode's block_tables are {tables.shape}; the plan's are "
                             f"{self.block_tables.shape} and only grow")
        positions = self.positions + 1  # one token a row, at kv_len - 1
        slots = tables[np.arange(self.num_seqs), positions // block_size].astype(np.int64) * block_size + \
            positions % block_size
        total, longest = self.kv_extent
        return dataclasses.replace(
            self, token_ids=np.full(self.num_seqs, PENDING_TOKEN, np.int32), positions=positions,
            slot_mapping=slots.astype(np.int32), kv_lens=self.kv_lens + 1, block_tables=tables,
            targets=None if self.targets is None else np.full(self.num_seqs, -1, np.int32), block_copies=None,
            host_copies=host_copies, kv_extent=(total + self.num_seqs, longest + 1 if self.num_seqs else 0))

    def rows(self, first: int, last: int, *, kv_extent: tuple[int, int] | None = None) -> StepPlan:
        """The plan of rows [first, last) alone (their tokens packed from 0; views, no copy of the tables);
        no block or host copies (they belong to the step, not to its rows)."""
        t0, t1 = int(self.cu_q_lens[first]), int(self.cu_q_lens[last])
        pick = lambda x: None if x is None else x[first:last]  # noqa: E731
        return StepPlan(
            seq_ids=self.seq_ids[first:last], token_ids=self.token_ids[t0:t1], positions=self.positions[t0:t1],
            slot_mapping=self.slot_mapping[t0:t1], cu_q_lens=self.cu_q_lens[first:last + 1] - t0,
            kv_lens=self.kv_lens[first:last], block_tables=self.block_tables[first:last],
            sample=self.sample[first:last],
            temperature=self.temperature[first:last], top_k=self.top_k[first:last], top_p=self.top_p[first:last],
            seed=self.seed[first:last], logprobs=pick(self.logprobs), instances=pick(self.instances),
            targets=None if self.targets is None else self.targets[t0:t1],
            penalties=None if self.penalties is None else self.penalties.rows(first, last),
            logit_bias=None if self.logit_bias is None else LogitBias(self.logit_bias.ids[first:last],
                                                                      self.logit_bias.values[first:last]),
            kv_extent=kv_extent, kind=self.kind)
