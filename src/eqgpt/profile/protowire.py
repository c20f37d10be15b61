"""The protobuf wire format, decoded by hand: enough to read a serialized message's fields
by number (varints, length-delimited bytes, fixed 32/64-bit), with no `protobuf` dependency.

`fields(b)` is one message as `{field number: [values]}`; nested messages are `bytes`
values to decode again with `fields`.
"""

from __future__ import annotations

from typing import Any


def varint(b: bytes, i: int) -> tuple[int, int]:
    """The varint starting at `b[i]`, and the index just past it."""
    r = shift = 0
    while True:
        x = b[i]
        i += 1
        r |= (x & 0x7F) << shift
        shift += 7
        if x < 0x80:
            return r, i


def fields(b: bytes) -> dict[int, list[Any]]:
    """One protobuf message: field number -> values (ints for varints, bytes otherwise)."""
    out: dict[int, list[Any]] = {}
    i, n = 0, len(b)
    while i < n:
        key, i = varint(b, i)
        num, wire = key >> 3, key & 7
        if wire == 0:
            v, i = varint(b, i)
        elif wire == 2:
            length, i = varint(b, i)
            v, i = b[i: i + length], i + length
        elif wire == 1:
            v, i = int.from_bytes(b[i: i + 8], "little"), i + 8
        elif wire == 5:
            v, i = int.from_bytes(b[i: i + 4], "little"), i + 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire} (field {num})")
        out.setdefault(num, []).append(v)
    return out


def ints(values: list[Any]) -> list[int]:
    """A repeated integer field, packed or not (int64 two's complement)."""
    out = []
    for v in values:
        if isinstance(v, bytes | bytearray):
            i = 0
            while i < len(v):
                x, i = varint(v, i)
                out.append(x)
        else:
            out.append(v)
    return [x - (1 << 64) if x >= 1 << 63 else x for x in out]


def one(msg: dict[int, list[Any]], num: int, default: Any = None) -> Any:
    """Field `num` of `msg` (its last value, as protobuf reads a repeated singular field), or `default`."""
    vals = msg.get(num)
    return vals[-1] if vals else default


def text(msg: dict[int, list[Any]], num: int) -> str:
    """String field `num` of `msg` (`""` when absent)."""
    return bytes(one(msg, num, b"")).decode("utf-8", "replace")


__all__ = ["varint", "fields", "ints", "one", "text"]
