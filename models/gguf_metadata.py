"""A GGUF file's key-value metadata read straight from its bytes into Python values.

    values, end = read_values(buf, offset, count, order="<")   # buf: the file's bytes (a memoryview)

The `gguf` package's reader makes two numpy views per string (a 49k-token vocabulary and its merges:
~200k arrays, +48 MB, 0.6 s) and `ReaderField.contents()` then copies them into str; once freed,
they left ~10 MB of Python's small-object memory fragmented for the rest of the process. Here each
value is decoded once, as `contents()` decodes it (strings as UTF-8, numbers as Python int / float /
bool, nested arrays flattened), with struct: +10 MB and 0.06 s for SmolLM2's metadata. A top-level
array of COMPACT_MIN or more strings (a vocabulary, its merges) is a `StringArray`, not a list: a
read-only Sequence (len, indexing, slices as lists, iteration, `in`, pickling, == a list of its
items), but not a list (no `+`, not JSON-serializable as it is: `list(a)` where one is needed).
The layout (llama.cpp's gguf.md): per pair a string key, a u32 value type, the value; a string is a
u64 length and its bytes; an array a u32 item type, a u64 count and the items.
"""
from __future__ import annotations

import struct
from array import array
from collections.abc import Sequence

# GGUFValueType -> struct format (gguf.constants: UINT8 0 ... FLOAT64 12; STRING 8 and ARRAY 9 apart)
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
STRING, ARRAY = 8, 9


COMPACT_MIN = 1024   # an array of at least this many strings is read as a StringArray


class StringArray(Sequence):
    """A GGUF array of strings held as its bytes (one `bytes` object and an array of offsets), each item
    decoded when read: a 49k-token vocabulary and its merges as ~100k small str objects took ~10 MB of
    Python's small-object memory, and once freed those left its arenas pinned by whatever else was
    made meanwhile (~3 MB for the rest of the process). Compares equal to the list of its items."""

    def __init__(self, blob: bytes, bounds: array):
        self._blob, self._bounds = blob, bounds   # item i: blob[bounds[2i]:bounds[2i + 1]], UTF-8

    def __len__(self) -> int:
        return len(self._bounds) // 2

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = len(self)
        if not -n <= i < n:
            raise IndexError("StringArray index out of range")
        i %= n
        return str(self._blob[self._bounds[2 * i]:self._bounds[2 * i + 1]], "utf-8")

    def __iter__(self):
        blob, b = memoryview(self._blob), self._bounds
        for i in range(0, len(b), 2):
            yield str(blob[b[i]:b[i + 1]], "utf-8")

    def __eq__(self, other) -> bool:
        if isinstance(other, (StringArray, list, tuple)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None

    def __repr__(self) -> str:
        return f"StringArray({len(self)} strings)"


class _Undecodable(Exception):
    """A string value that is not UTF-8: the key is kept with the value None (as models.gguf.field_value)."""


def read_values(buf, offset: int, count: int, order: str = "<", kinds: dict | None = None) -> tuple[dict, int]:
    """`count` key-value pairs from buf[offset:] -> ({key: value or None}, the offset after them).
    order: struct's byte order of the file ("<" little-endian, as llama.cpp writes); kinds: filled
    with each key's value type (GGUFValueType's number)."""
    u32, u64 = struct.Struct(order + "I"), struct.Struct(order + "Q")

    def raw_string(at: int) -> tuple[memoryview, int]:
        n = u64.unpack_from(buf, at)[0]
        end = at + 8 + n
        if end > len(buf):
            raise ValueError(f"a string of {n} bytes runs past the end of the file")
        return buf[at + 8:end], end

    def string(at: int) -> tuple[str, int]:
        b, end = raw_string(at)
        try:
            return str(b, "utf-8"), end
        except UnicodeDecodeError:
            raise _Undecodable(end) from None

    def string_array(at: int, n: int) -> tuple[StringArray, int]:
        """n strings from `at` as a StringArray (each checked to be UTF-8)."""
        start, bounds = at, array("Q")
        for _ in range(n):
            b, end = raw_string(at)
            try:
                str(b, "utf-8")
            except UnicodeDecodeError:
                raise _Undecodable(end) from None
            bounds.append(at + 8 - start)
            bounds.append(end - start)
            at = end
        return StringArray(bytes(buf[start:at]), bounds), at

    def value(kind: int, at: int, out: list | None, top: bool = True) -> int:
        """Appends the value at `at` (an array's items, flattened) to `out`; returns the offset after it."""
        if kind == STRING:
            s, at = string(at)
            out.append(s)
            return at
        if kind in SCALARS:
            fmt = struct.Struct(order + SCALARS[kind])
            out.append(fmt.unpack_from(buf, at)[0])
            return at + fmt.size
        if kind == ARRAY:
            item, n = u32.unpack_from(buf, at)[0], u64.unpack_from(buf, at + 4)[0]
            at += 12
            if item in SCALARS:   # one unpack for the whole array
                fmt = struct.Struct(f"{order}{n}{SCALARS[item]}")
                out.extend(fmt.unpack_from(buf, at))
                return at + fmt.size
            if item == STRING and n >= COMPACT_MIN and top:   # (nested arrays flatten, as contents())
                strings, at = string_array(at, n)
                out.append(strings)
                return at
            for _ in range(n):
                at = value(item, at, out, top=False)
            return at
        raise ValueError(f"unknown GGUF value type {kind}")

    def skip(kind: int, at: int) -> int:
        """The offset after a value, without decoding it (a value holding a non-UTF-8 string)."""
        if kind == STRING:
            return raw_string(at)[1]
        if kind in SCALARS:
            return at + struct.calcsize(SCALARS[kind])
        if kind == ARRAY:
            item, n = u32.unpack_from(buf, at)[0], u64.unpack_from(buf, at + 4)[0]
            at += 12
            if item in SCALARS:
                return at + n * struct.calcsize(SCALARS[item])
            for _ in range(n):
                at = skip(item, at)
            return at
        raise ValueError(f"unknown GGUF value type {kind}")

    values = {}
    for _ in range(count):
        try:
            key, offset = string(offset)
        except _Undecodable:
            raise ValueError(f"a metadata key at byte {offset} is not UTF-8") from None
        kind = u32.unpack_from(buf, offset)[0]
        offset += 4
        if kinds is not None:
            kinds[key] = kind
        got: list = []
        try:
            end = value(kind, offset, got)
            values[key] = (got[0] if len(got) == 1 and isinstance(got[0], StringArray) else got) \
                if kind == ARRAY else got[0]
        except _Undecodable:
            end = skip(kind, offset)
            values[key] = None
        offset = end
    return values, offset
