"""`Buckets`: every static shape the engine compiles, and the rule that pads a step to one.

A jitted step is compiled once per input shape, so serving must meet only shapes warm-up compiled
(docs/ARCHITECTURE.md, decision 4). The shapes are three axes:

- decode steps: S sequences, one token each, S a power of two from 1 to pow2(max_seqs);
- prefill / mixed steps: T tokens, a power of two from pow2(min_tokens) up to the first >=
  max_tokens_per_step; their sequence axis is padded to min(T, pow2(max_seqs)), which holds every
  sequence a step of T tokens can have (each has at least one token);
- verify steps (speculative decoding, only when it is on): S sequences of Q = k + 1 tokens each, S a power of
  two from 1 up to pow2 of the most sequences whose S x Q tokens fit max_tokens_per_step (the scheduler
  verifies no more: `verify_seqs`), T = S x Q;
- the rBlock-table width W: one value, table_width (the longest sequence the pool and the context
  limit allow). The kernels read a sequence's rBlocks only up to its kv_len, so a wide table costs
  a [S, W] int32 copy per step, not KV reads: one width is cheaper than a bucket per width (which
  would multiply every other count).

Padding waste, and why powers of two. A size s in (b/2, b] pads to b: at most b/2 - 1 rows of b are
padding, a worst case under 50% (`waste_bound`); below the smallest prefill bucket a step of one
token fills 1 of pow2(min_tokens) (87.5% at the default 8): such steps are a few tokens, cheap either
way. Intermediate sizes (1.5x steps: 1, 2, 3, 4, 6, 8, 12, ...) would bound it at 33% for twice the
compiles, and are not taken, because the rows a decode bucket pads are nearly free: a padding
sequence has kv_len 0 (it reads no KV), and a decode step at any batch up to a few hundred rows is
bound by reading the weights and the real sequences' KV, which padding rows do not add to; its only
cost is matmul rows on a memory-bound GEMV. Prefill padding is real compute, but the scheduler fills
each step's token budget, so long prompts run at the top bucket (no waste when max_tokens_per_step is
a power of two, as the defaults are); only a prompt's last chunk pays. And the powers of two keep
batch-1 decode at shape 1 and every shape the engine compiled before the tuner, so generated tokens
are unchanged. The counts stay logarithmic: log2(max_seqs) + 1 decode buckets, about
log2(max_tokens_per_step / min_tokens) + 1 prefill buckets.
"""

from __future__ import annotations

import dataclasses
import functools

from jaxllm.contract import StepKind


def pow2_at_least(n: int, minimum: int = 1) -> int:
    """The smallest power of two >= max(n, minimum, 1)."""
    n = max(n, minimum, 1)
    return 1 << (n - 1).bit_length()


def pad_to_bucket(kind: StepKind, size: int, *, min_tokens: int, seq_cap: int, verify_queries: int = 0
                  ) -> tuple[int, int]:
    """(tokens, sequences) a step of `kind` is padded to: `size` is its sequence count (decode, verify) or token
    count (prefill).

    The one bucket rule: a decode step is shaped by its sequence count alone (a power of two), a verify step
    likewise with verify_queries tokens a sequence, a prefill step by its token count alone (a power of two >=
    min_tokens; its sequence axis padded to the same size, capped at seq_cap).
    """
    if kind is StepKind.DECODE:
        s_pad = pow2_at_least(size)
        return s_pad, s_pad
    if kind is StepKind.VERIFY:
        if verify_queries < 2:
            raise ValueError(f"a verify step has k + 1 >= 2 tokens a sequence, got {verify_queries}")
        s_pad = pow2_at_least(size)
        return s_pad * verify_queries, s_pad
    t_pad = pow2_at_least(size, min_tokens)
    return t_pad, min(t_pad, seq_cap)


@dataclasses.dataclass(frozen=True)
class Shape:
    """One compiled step shape: its kind, tokens [T], sequences [S], rBlock-table width [W]; `size` is the
    bucket's key (S for decode and verify, T for prefill)."""

    kind: StepKind
    tokens: int
    seqs: int
    table_width: int

    @property
    def size(self) -> int:
        return self.tokens if self.kind is StepKind.PREFILL else self.seqs


@dataclasses.dataclass(frozen=True)
class Buckets:
    """Every bucket of an engine with these limits (see the module docstring for the rule and its waste).

    max_seqs: sequences a step may hold; max_tokens_per_step: tokens a step may hold; min_tokens: the
    smallest prefill bucket (rounded up to a power of two); table_width: rBlocks in a sequence's table;
    verify_queries: tokens a sequence has in a verify step, Q = k + 1 (0: no speculative decoding, no verify
    buckets).
    """

    max_seqs: int
    max_tokens_per_step: int
    table_width: int
    min_tokens: int = 8
    verify_queries: int = 0

    def __post_init__(self):
        for name in ("max_seqs", "max_tokens_per_step", "table_width", "min_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"Buckets.{name} must be a positive integer, got {value!r}")
        q = self.verify_queries
        if isinstance(q, bool) or not isinstance(q, int) or q < 0 or q == 1:
            raise ValueError(f"Buckets.verify_queries must be 0 (off) or k + 1 >= 2, got {q!r}")
        if q > self.max_tokens_per_step:
            raise ValueError(f"a verify step's {q} tokens a sequence exceed max_tokens_per_step "
                             f"{self.max_tokens_per_step}")

    @property
    def seq_cap(self) -> int:
        """The largest decode bucket, and the cap on a prefill step's sequence axis."""
        return pow2_at_least(self.max_seqs)

    @functools.cached_property
    def decode_sizes(self) -> tuple[int, ...]:
        """Decode buckets (sequences), ascending: 1, 2, 4, ..., seq_cap."""
        return tuple(1 << i for i in range(self.seq_cap.bit_length()))

    @functools.cached_property
    def prefill_sizes(self) -> tuple[int, ...]:
        """Prefill buckets (tokens), ascending: pow2(min_tokens), ..., the first >= max_tokens_per_step."""
        sizes = [pow2_at_least(self.min_tokens)]
        while sizes[-1] < self.max_tokens_per_step:
            sizes.append(sizes[-1] * 2)
        return tuple(sizes)

    @property
    def verify_seqs(self) -> int:
        """The most sequences a verify step holds: max_seqs, or fewer where their k + 1 tokens each would exceed
        max_tokens_per_step (the scheduler counts a verify step's tokens in the step's budget); 0 without
        speculative decoding."""
        if not self.verify_queries:
            return 0
        return min(self.max_seqs, self.max_tokens_per_step // self.verify_queries)

    @functools.cached_property
    def verify_sizes(self) -> tuple[int, ...]:
        """Verify buckets (sequences), ascending: 1, 2, 4, ..., pow2(verify_seqs); () without speculative
        decoding."""
        if not self.verify_queries:
            return ()
        return tuple(1 << i for i in range(pow2_at_least(self.verify_seqs).bit_length()))

    def sizes(self, kind: StepKind) -> tuple[int, ...]:
        """The buckets of a kind, ascending (decode_sizes, prefill_sizes or verify_sizes)."""
        if kind is StepKind.DECODE:
            return self.decode_sizes
        return self.verify_sizes if kind is StepKind.VERIFY else self.prefill_sizes

    def padded(self, kind: StepKind, size: int) -> tuple[int, int]:
        """(tokens, sequences) a step of `size` (sequences for decode and verify, tokens for prefill) is padded to.
        Raises ValueError past the largest bucket: that shape was never compiled; TypeError for a kind that is no
        StepKind (a boolean from before the kinds would pad by the wrong rule)."""
        if not isinstance(kind, StepKind):
            raise TypeError(f"a step's kind is a StepKind, got {kind!r}")
        if not self.sizes(kind):
            raise ValueError(f"this engine has no {kind.label} buckets (speculative decoding is off)")
        limit = self.sizes(kind)[-1]
        if not 0 < size <= limit:
            raise ValueError(f"a {kind.label} step of {size} {kind.size_unit} is outside the buckets (1..{limit})")
        return pad_to_bucket(kind, size, min_tokens=self.min_tokens, seq_cap=self.seq_cap,
                             verify_queries=self.verify_queries)

    def shape(self, kind: StepKind, size: int) -> Shape:
        """The compiled shape a step of `size` runs at."""
        tokens, seqs = self.padded(kind, size)
        return Shape(kind, tokens, seqs, self.table_width)

    def shapes(self) -> tuple[Shape, ...]:
        """Every shape warm-up compiles: decode buckets ascending, then prefill buckets, then verify buckets."""
        return tuple(self.shape(kind, size) for kind in StepKind for size in self.sizes(kind))

    def waste_bound(self, kind: StepKind, bucket: int) -> float:
        """The worst-case fraction of a bucket's rows (decode) or tokens (prefill) that are padding: the
        smallest size that pads to it is one more than the bucket below (1 for the smallest)."""
        sizes = self.sizes(kind)
        if bucket not in sizes:
            raise ValueError(f"{bucket} is not a {kind.label} bucket {sizes}")
        i = sizes.index(bucket)
        smallest = sizes[i - 1] + 1 if i else 1
        return (bucket - smallest) / bucket

    def max_waste(self, kind: StepKind, *, above_smallest: bool = True) -> float:
        """The largest waste_bound over the buckets (0.0 if none); above_smallest leaves out the smallest
        prefill bucket (whose floor min_tokens is a choice, not the rounding)."""
        sizes = self.sizes(kind)
        if above_smallest and kind is StepKind.PREFILL:
            sizes = sizes[1:]
        return max((self.waste_bound(kind, b) for b in sizes), default=0.0)
