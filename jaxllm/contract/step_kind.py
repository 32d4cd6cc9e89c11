"""`StepKind`: what a step is, carried by its plan, its call, its program, its bucket and the tuner's key.

A step's kind decides its program (jaxllm.executor.step: `decode_step` or `prefill_step`), how it is padded to
a bucket (jaxllm.tuner.buckets: a decode step by its sequences, a prefill step by its tokens) and which
schedules the tuner lists for it. Today there are two: DECODE (one query token per sequence, each the token
sampled after the last) and PREFILL (chunks of any length, a mixed step of prompt chunks and decodes included).
A multi-token verify step (speculative decoding: k + 1 query tokens a sequence over its cached KV) is a third
kind with a program, a bucket rule and tuner variants of its own, added beside these.
"""

from __future__ import annotations

import enum

__all__ = ["StepKind"]


class StepKind(enum.Enum):
    """A step's kind. Not an int (nor a bool): a stray boolean from before the kinds equals no kind, and every kind
    is truthy, so `if kind` can never stand for "is decode"."""

    DECODE = "decode"
    PREFILL = "prefill"

    @property
    def label(self) -> str:
        """Its name in metrics, tables and training rows: "decode", "prefill"."""
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
        """What a bucket of this kind counts: a decode step is shaped by its sequences, a prefill step by its
        tokens."""
        return "sequences" if self is StepKind.DECODE else "tokens"

    @property
    def queries_per_seq(self) -> int | None:
        """Query tokens every sequence has in a step of this kind (the attention kernels' promise,
        pallas_kernels.dispatch.AttentionBatch), None where they vary."""
        return 1 if self is StepKind.DECODE else None

    @classmethod
    def from_label(cls, label: str) -> StepKind:
        """The kind of a label ("decode" / "prefill"); ValueError naming the label and the kinds otherwise."""
        try:
            return cls(label)
        except ValueError:
            raise ValueError(f"unknown step kind {label!r}: one of {[k.label for k in cls]}") from None


_WIRE = tuple(StepKind)  # in declaration order; a new kind is appended, so old numbers keep their meaning
