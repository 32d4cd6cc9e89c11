"""What process 0 tells the other processes of a multi-process run before each program it runs.

Every process runs every program (docs/ARCHITECTURE.md, decision 7: one SPMD program over the mesh): process 0 plans, and
as it submits each call it sends a `StepCall` (which program, with which statics) and its host inputs through
`CallChannel`; every other process receives them in `Worker.follow()` and launches the same call on receipt. The
call's fields travel as a few int32 words beside the inputs, raw bytes on the step channel (a host message:
sharding.step_channel, opened by sharding.multihost.initialize); their meaning is written here once.
"""

from __future__ import annotations

import dataclasses
import enum

import jax
import numpy as np

from jaxllm.contract import StepKind
from sharding import multihost

__all__ = ["BlockCopies", "CallChannel", "Op", "StepCall", "TokenSource"]


class Op(enum.IntEnum):
    STEP = 0  # a step of the call's StepKind: its program (decode_step, prefill_step) samples a token a sequence
    LOGITS = 1  # a prefill's teacher-forced logits of every token (logits_step)
    COPY = 2  # rBlocks copied between instances' pools (recalls)


class TokenSource(enum.IntEnum):
    FRESH = 0  # the inputs as sent; their sampling arrays are placed on the devices now
    CONTINUED = 1  # a decode continuation: the previous step's sampled tokens and sampling arrays, on the devices


@dataclasses.dataclass(frozen=True)
class StepCall:
    """One program call: its op, its step's kind, and the statics that pick the compiled variant (every process must
    run the same one). variant: the index of the bucket's tuner variant; borrowed: the DistAttention variant."""

    op: Op
    kind: StepKind = StepKind.PREFILL
    greedy: bool = False
    logprobs: bool = False
    variant: int = 0
    borrowed: bool = False
    source: TokenSource = TokenSource.FRESH

    def to_wire(self) -> np.ndarray:
        return np.array([self.op, self.kind.wire, self.greedy, self.logprobs, self.variant, self.borrowed,
                         self.source], np.int32)

    @classmethod
    def from_wire(cls, words: np.ndarray) -> StepCall:
        op, kind, greedy, logprobs, variant, borrowed, source = (int(w) for w in words)
        return cls(Op(op), StepKind.from_wire(kind), bool(greedy), bool(logprobs), variant, bool(borrowed), TokenSource(source))

    @property
    def program(self) -> str:
        """The name of the program it runs (jaxllm.executor.programs): its kind's for a step, else its op's."""
        return self.kind.label if self.op is Op.STEP else self.op.name.lower()


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BlockCopies:
    """An Op.COPY call's inputs: rBlocks src[m] -> dst[m] (global ids; -1: padding) [M] int32."""

    src: np.ndarray
    dst: np.ndarray


class CallChannel:
    """Process 0's `send(call, inputs)` / `stop()`, paired with every other process's `receive()`, over this
    process's end of the step channel (sharding.multihost.step_channel)."""

    def __init__(self):
        self._channel = multihost.step_channel()
        if self._channel is None:
            raise ValueError(f"this is process {jax.process_index()} of a {jax.process_count()}-process run with no "
                             "step channel: join multi-process runs through sharding.multihost.initialize")

    def send(self, call: StepCall, inputs) -> int:
        """Process 0: hand one call and its inputs to every other process (at once: a host message); returns its
        sequence number, which names the call's outputs on the results channel."""
        try:
            return self._channel.send({"call": call.to_wire(), "inputs": inputs})
        except ConnectionError as e:  # a follower is gone: the watch's message naming it says why, where it has one
            raise ValueError(multihost.peer_lost(2.0) or str(e)) from None

    def receive(self) -> tuple[StepCall, object, int] | None:
        """The next call, its inputs (NumPy leaves, read-only) and its sequence number, or None once process 0
        stopped."""
        message = self._channel.receive()
        if message is None:
            return None
        return StepCall.from_wire(message["call"]), message["inputs"], self._channel.last_seq

    def stop(self) -> None:
        """Process 0: no more calls; returns once every other process has taken every call (or after a minute)."""
        self._channel.stop()
