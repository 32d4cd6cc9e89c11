"""`StepKind`: what a step is, carried by its plan, its call, its program, its bucket and the tuner's key.

A step's kind decides its program (jaxllm.executor.step: `decode_step`, `prefill_step` or `verify_step`), how it
is padded to a bucket (jaxllm.tuner.buckets: a decode or verify step by its sequences, a prefill step by its
tokens) and which schedules the tuner lists for it. Three kinds: DECODE (one query token per sequence, each the
token sampled after the last), PREFILL (chunks of any length, a mixed step of prompt chunks and decodes included)
and VERIFY (speculative decoding: every sequence has the engine's k + 1 tokens, its last token, its draft tokens
and fillers after them, over its cached KV; every position's logits are computed and the drafts accepted or
rejected on the device: jaxllm.executor.acceptance).
"""

from __future__ import annotations

import enum

__all__ = ["StepKind"]


class StepKind(enum.Enum):
    """A step's kind. Not an int (nor a bool): a stray boolean from before the kinds equals no kind, and every kind
    is truthy, so `if kind` can never stand for "is decode"."""

    DECODE = "decode"
    PREFILL = "prefill"
    VERIFY = "verify"

    @property
    def label(self) -> str:
        """Its name in metrics, tables and training rows: "decode", "prefill", "verify"."""
        return self.value

    @property
    def wire(self) -> int:
        """Its number in a multi-process call's words (jaxllm.executor.calls)."""
        return _WIRE.index(self)

    @classmethod
    def from_wire(cls, word: int) -> StepKind:
        return _WIRE[word]

    @property
    def size_unit(self) -> str:
        """What a bucket of this kind counts: a decode or verify step is shaped by its sequences (a verify step has
        k + 1 tokens each), a prefill step by its tokens."""
        return "tokens" if self is StepKind.PREFILL else "sequences"

    @property
    def queries_per_seq(self) -> int | None:
        """Query tokens every sequence has in a step of this kind (the attention kernels' promise,
        pallas_kernels.dispatch.AttentionBatch): 1 for decode; None where they vary (prefill) or are the engine's
        (verify: k + 1)."""
        return 1 if self is StepKind.DECODE else None

    @classmethod
    def from_label(cls, label: str) -> StepKind:
        """The kind of a label ("decode" / "prefill" / "verify"); ValueError naming the label and the kinds
        otherwise."""
        try:
            return cls(label)
        except ValueError:
            raise ValueError(f"unknown step kind {label!r}: one of {[k.label for k in cls]}") from None


_WIRE = tuple(StepKind)  # in declaration order; a new kind is appended, so old numbers keep their meaning
