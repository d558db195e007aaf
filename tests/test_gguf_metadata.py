"""A GGUF file's metadata read straight from its bytes (models.gguf_metadata) equals what the gguf
package's own reader decodes, value for value, for every value type; the engine's reader keeps no
per-string views (two numpy arrays per vocabulary entry: +48 MB and ~10 MB of fragmented memory
for SmolLM2's 49k tokens)."""
from __future__ import annotations

import struct

import pytest

gguf = pytest.importorskip("gguf", reason="the gguf package is not installed")

from gguf import GGUFValueType as V  # noqa: E402

from models.gguf import metadata, open_reader  # noqa: E402
from models.gguf_metadata import COMPACT_MIN, StringArray, read_values  # noqa: E402


def write(path, extra=None):
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_custom_alignment(64)
    w.add_string("general.name", "métadonnées ✓")
    w.add_token_list(["<s>", "a", "ĠTheir", "日本", ""])
    w.add_token_merges(["a b", "Ġ t"])
    w.add_token_types([3, 1, 1, 1, 4])
    w.add_token_scores([0.0, -1.5, 2.25, -3.0e-5, 1e30])
    w.add_bool("tokenizer.ggml.add_bos_token", True)
    for name, kind, value in [("u8", V.UINT8, 255), ("i8", V.INT8, -128), ("u16", V.UINT16, 65535),
                              ("i16", V.INT16, -32768), ("i32", V.INT32, -7), ("f32", V.FLOAT32, 1e-5),
                              ("u64", V.UINT64, 2 ** 63 + 5), ("i64", V.INT64, -(2 ** 62)), ("f64", V.FLOAT64, 0.1)]:
        w.add_key_value(f"test.{name}", value, kind)
    w.add_array("test.ints", [1, -2, 3])
    for k, v in (extra or {}).items():
        w.add_string(k, v)
    w.add_tensor("t", __import__("numpy").zeros((2, 64), dtype="float32"))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_every_value_as_the_gguf_reader_decodes_it(tmp_path):
    path = tmp_path / "m.gguf"
    write(path)
    theirs = gguf.GGUFReader(str(path))
    want = {k: f.contents() for k, f in theirs.fields.items()}
    ours = metadata(open_reader(path))
    assert ours == want
    assert ours["tokenizer.ggml.tokens"][3] == "日本" and ours["test.u64"] == 2 ** 63 + 5
    assert type(ours["tokenizer.ggml.add_bos_token"]) is bool


def test_the_reader_keeps_no_per_string_views(tmp_path):
    """The engine's reader parses the values once (`values`); of the fields only general.alignment
    (the base class reads it) and the header counts are left."""
    path = tmp_path / "m.gguf"
    write(path)
    reader = open_reader(path)
    assert "tokenizer.ggml.tokens" in reader.values
    assert set(reader.fields) <= {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count", "general.alignment"}
    assert reader.alignment == 64 and reader.tensors[0].data_offset % 64 == 0


def test_a_string_that_is_not_utf8_keeps_its_key_as_none():
    """As models.gguf.field_value does for a value it cannot decode: the key is kept, the value None,
    and the values after it are read."""
    def s(b: bytes) -> bytes:
        return struct.pack("<Q", len(b)) + b
    buf = (s(b"bad") + struct.pack("<I", 8) + s(b"\xff\xfe")
           + s(b"list") + struct.pack("<IIQ", 9, 8, 2) + s(b"ok") + s(b"\xc3")
           + s(b"empty") + struct.pack("<IIQ", 9, 4, 0)
           + s(b"after") + struct.pack("<Ii", 5, -3))
    values, end = read_values(memoryview(buf), 0, 4)
    assert values == {"bad": None, "list": None, "empty": [], "after": -3} and end == len(buf)
    with pytest.raises((ValueError, struct.error)):
        read_values(memoryview(buf[:-10]), 0, 4)   # a cut file: an error, not a wrong value


def test_a_long_string_array_is_held_as_its_bytes(tmp_path):
    """A vocabulary-sized array of strings is one StringArray (its bytes and offsets, no str per item):
    equal to the gguf reader's list, item for item, sliced, from the end, iterated; a non-UTF-8 item
    anywhere in it keeps the key with the value None, as for a short array."""
    n = COMPACT_MIN + 3
    tokens = [f"tok{i}" for i in range(n - 2)] + ["日本", ""]
    path = tmp_path / "big.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_token_list(tokens)
    w.add_token_merges(["a b"] * 3)   # short: a plain list
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    theirs = gguf.GGUFReader(str(path)).fields["tokenizer.ggml.tokens"].contents()
    ours = metadata(open_reader(path))
    got = ours["tokenizer.ggml.tokens"]
    assert type(got) is StringArray and type(ours["tokenizer.ggml.merges"]) is list
    assert got == theirs == tokens and len(got) == n and list(got) == tokens
    assert got[n - 2] == "日本" and got[-1] == "" and got[-3] == f"tok{n - 3}" and got[5:8] == tokens[5:8]
    with pytest.raises(IndexError):
        got[n]

    def s(b: bytes) -> bytes:
        return struct.pack("<Q", len(b)) + b
    items = [s(b"ok")] * COMPACT_MIN + [s(b"\xc3")]
    buf = s(b"list") + struct.pack("<IIQ", 9, 8, len(items)) + b"".join(items) + s(b"after") + struct.pack("<Ii", 5, 7)
    values, end = read_values(memoryview(buf), 0, 2)
    assert values == {"list": None, "after": 7} and end == len(buf)
    inner = struct.pack("<IQ", 8, COMPACT_MIN) + b"".join([s(b"ok")] * COMPACT_MIN)   # an array of arrays
    buf = s(b"nested") + struct.pack("<IIQ", 9, 9, 2) + inner + inner
    values, end = read_values(memoryview(buf), 0, 1)
    assert type(values["nested"]) is list and values["nested"] == ["ok"] * (2 * COMPACT_MIN)   # flattened


def test_a_gguf_whose_private_parse_differs_keeps_its_own(tmp_path, monkeypatch):
    """The fast parse overrides a private method of the installed gguf only where that method is the
    one it was written against; under another signature the reader's own parse runs (same values)."""
    path = tmp_path / "m.gguf"
    write(path)
    want = {k: f.contents() for k, f in gguf.GGUFReader(str(path)).fields.items()}
    original = gguf.GGUFReader._build_fields

    def other(self, offs, count, strict=False):   # what a later gguf might change it to
        return original(self, offs, count)

    monkeypatch.setattr(gguf.GGUFReader, "_build_fields", other)
    reader = open_reader(path)
    assert not hasattr(reader, "values") or not reader.values
    assert metadata(reader) == want
