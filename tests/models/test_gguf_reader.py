"""The start-up reader (gguf_io._Reader) gives gguf's GGUFReader's fields and tensors exactly:
every field's types, parts (dtype and values) and data indices, on arrays of each kind."""

import struct

import gguf
import numpy as np
import pytest

from cfr_atlas.errors import ModelFormatError
from cfr_atlas.models.gguf_io import GGUFFile, _Reader


def _same(path) -> None:
    ref, ours = gguf.GGUFReader(path), _Reader(path)
    assert list(ref.fields) == list(ours.fields)
    for key, a in ref.fields.items():
        b = ours.fields[key]
        assert (a.offset, a.types, a.data, len(a.parts)) == (b.offset, b.types, b.data,
                                                             len(b.parts)), key
        for x, y in zip(a.parts, b.parts, strict=True):
            assert x.dtype == y.dtype and np.array_equal(x, y), key
        assert a.contents() == b.contents(), key
        if a.types[0] == gguf.GGUFValueType.ARRAY and a.data:  # one element, a slice of them
            assert a.contents(-1) == b.contents(-1), key
            assert a.contents(slice(1, None)) == b.contents(slice(1, None)), key
    assert ours.data_offset == ref.data_offset
    for s, t in zip(ref.tensors, ours.tensors, strict=True):
        assert (s.name, s.tensor_type, s.data_offset) == (t.name, t.tensor_type, t.data_offset)
        assert np.array_equal(s.data, t.data)


def test_arrays_of_every_kind(tmp_path):
    path = tmp_path / "arrays.gguf"
    w = gguf.GGUFWriter(path, "llama")
    w.add_array("strings", ["a", "", "héllo", "x" * 300])
    w.add_array("empty", [])
    w.add_array("ints", [1, -2, 3])
    w.add_array("floats", [0.5, -1.25])
    w.add_array("bools", [True, False])
    w.add_array("nested", [[1, 2], [3]])
    w.add_string("name", "tiny")
    w.add_uint32("n", 7)
    w.add_tensor("t", np.arange(12, dtype=np.float32).reshape(3, 4))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _same(path)
    gf = GGUFFile(path)
    for key in ("strings", "empty", "ints", "nested", "name", "absent"):  # without decoding
        assert gf.meta_len(key) == len(gf.meta(key, [])), key


def test_tiny_model(tiny_gguf):
    _same(tiny_gguf())


def _hostile_array(path, itype: int, n: int, tail: bytes = b"") -> None:
    """A GGUF whose one metadata array declares n elements the file does not hold."""
    key = b"hostile.array"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key
                     + struct.pack("<IIQ", int(gguf.GGUFValueType.ARRAY), itype, n) + tail)


@pytest.mark.parametrize("itype, n, tail", [
    (int(gguf.GGUFValueType.STRING), 10**6, b""),
    (int(gguf.GGUFValueType.STRING), 1 << 60, b""),
    (int(gguf.GGUFValueType.STRING), 1, struct.pack("<Q", 1 << 40) + b"abc"),  # string too long
    (int(gguf.GGUFValueType.UINT32), 1 << 40, b"\0" * 8),
])
def test_hostile_array_lengths_are_typed_errors(tmp_path, itype, n, tail):
    path = tmp_path / "hostile.gguf"
    _hostile_array(path, itype, n, tail)
    with pytest.raises(ModelFormatError):
        GGUFFile(path)
