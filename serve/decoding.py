"""Request deserializers that turn a malformed message into an answer, not gRPC's INTERNAL.

gRPC answers INTERNAL "Exception deserializing request!" itself when a request_deserializer raises
or returns None, before any servicer code runs (so nothing could count it or say what was wrong).
`tolerant(Message)` returns a deserializer that gives back a `Malformed` instead, which the servicer
answers with INVALID_ARGUMENT (counted like every other answer). Its reason names the field where it
can: a string field that is not UTF-8 (a lone surrogate's bytes get the same message the HTTP API and
`LLM` give for one: jaxllm.model.tokenizer.check_unicode), or a message cut short.
"""

from __future__ import annotations

import dataclasses

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import DecodeError

from jaxllm.model.tokenizer import check_unicode


@dataclasses.dataclass(frozen=True)
class Malformed:
    """A request that did not parse as its message type; `reason` says why, naming the field if it can."""

    message_type: str
    reason: str

    def details(self) -> str:
        return f"malformed {self.message_type}: {self.reason}"


class _Truncated(Exception):
    pass


def _varint(data: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if i >= len(data) or shift > 63:
            raise _Truncated
        byte = data[i]
        i += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, i
        shift += 7


def _string_problem(text: bytes, name: str) -> str | None:
    """None for UTF-8 text; else why not, naming the field."""
    try:
        text.decode("utf-8")
        return None
    except UnicodeDecodeError as e:
        bad = e.start
    try:  # a surrogate written as UTF-8 bytes: the message a lone surrogate gets everywhere else
        check_unicode(text.decode("utf-8", "surrogatepass"), name)
    except UnicodeDecodeError:
        pass
    except ValueError as e:
        return str(e)
    return f"{name} is not valid text: byte 0x{text[bad]:02x} at position {bad} is not UTF-8"


def _repeated(field) -> bool:
    is_repeated = getattr(field, "is_repeated", None)  # protobuf >= 6; older ones have only `label`
    return is_repeated if is_repeated is not None else field.label == FieldDescriptor.LABEL_REPEATED


def why_malformed(descriptor, data: bytes) -> str:
    """What is wrong with `data` as a `descriptor` message: its first string field that is not UTF-8 (named,
    with the index of a repeated one), or a cut-short or corrupt encoding."""
    seen: dict[int, int] = {}
    i = 0
    try:
        while i < len(data):
            key, i = _varint(data, i)
            number, wire = key >> 3, key & 7
            field = descriptor.fields_by_number.get(number)
            if wire == 0:
                _, i = _varint(data, i)
            elif wire in (1, 5):
                i += 8 if wire == 1 else 4
                if i > len(data):
                    raise _Truncated
            elif wire == 2:
                size, i = _varint(data, i)
                chunk, i = data[i:i + size], i + size
                if i > len(data):
                    raise _Truncated
                if field is not None and field.type == FieldDescriptor.TYPE_STRING:
                    name = field.name
                    if _repeated(field):
                        name += f"[{seen.get(number, 0)}]"
                    problem = _string_problem(chunk, name)
                    if problem is not None:
                        return problem
            else:
                return f"field {number} has wire type {wire}, which no field of this message can have"
            seen[number] = seen.get(number, 0) + 1
    except _Truncated:
        return "the message ends in the middle of a field"
    return "it does not parse as this message type"


def tolerant(message_class):
    """A request_deserializer for `message_class`: the parsed message, or a Malformed saying why not."""
    def deserialize(data: bytes):
        try:
            return message_class.FromString(data)
        except (DecodeError, ValueError, RuntimeError):
            return Malformed(message_class.DESCRIPTOR.name, why_malformed(message_class.DESCRIPTOR, data))

    return deserialize
