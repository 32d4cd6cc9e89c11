"""A step's integer inputs in one array, so that one host-to-device copy a device carries them all.

A step's positions, rBlock tables, lengths, query starts, slots and prompt targets are int32 host arrays built
anew every step. Handed to the jitted step one by one, each is a copy of its own to every device, issued one after
another by the launch thread while the devices wait for them (at 13B over 4 H200s: 5 copies a GPU a step, and
the bare step, its inputs already on the devices, ran 0.2-0.8 ms faster than the engine's; issue 32).
`pack` lays them side by side in one [I, L] int32 array (their leading instance axis kept, so a split over
instances still splits it), and the program calls `unpack` at its start: static slices, whose shapes follow from
the bucket (T from the tokens, S from the sampling arrays, the table width from what is left).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from jaxllm.executor.step import StepInputs

__all__ = ["PACKED_FIELDS", "pack", "unpack"]

# The StepInputs fields `pack` carries, in their order in the packed array.
PACKED_FIELDS = ("positions", "block_tables", "kv_lens", "cu_q_lens", "slot_mapping", "targets")


def pack(inputs: StepInputs) -> StepInputs:
    """inputs with PACKED_FIELDS (int32 host arrays [I, ...]) moved into `packed` [I, L] (those fields None)."""
    arrays = [getattr(inputs, name) for name in PACKED_FIELDS]
    for name, array in zip(PACKED_FIELDS, arrays):
        if not isinstance(array, np.ndarray) or array.dtype != np.int32:
            raise ValueError(f"StepInputs.{name} must be an int32 host array to be packed, got "
                             f"{type(array).__name__} {getattr(array, 'dtype', '')}")
    lead = arrays[0].shape[0]
    packed = np.concatenate([a.reshape(lead, -1) for a in arrays], axis=1)
    return dataclasses.replace(inputs, packed=packed, **{name: None for name in PACKED_FIELDS})


def unpack(inputs: StepInputs) -> StepInputs:
    """The inverse of `pack` (numpy or traced arrays); inputs that are not packed come back as they are."""
    packed = inputs.packed
    if packed is None:
        return inputs
    lead, tokens, seqs = packed.shape[0], inputs.tokens.shape[-1], inputs.temperature.shape[-1]
    rest = packed.shape[1] - (3 * tokens + 2 * seqs + 1)
    if rest < 0 or rest % seqs:
        raise ValueError(f"packed step inputs {packed.shape} do not hold {tokens} tokens and {seqs} sequences")
    shapes = {"positions": (tokens,), "block_tables": (seqs, rest // seqs), "kv_lens": (seqs,),
              "cu_q_lens": (seqs + 1,), "slot_mapping": (tokens,), "targets": (tokens,)}
    fields, offset = {}, 0
    for name in PACKED_FIELDS:
        size = math.prod(shapes[name])
        fields[name] = packed[:, offset:offset + size].reshape(lead, *shapes[name])
        offset += size
    return dataclasses.replace(inputs, packed=None, **fields)
