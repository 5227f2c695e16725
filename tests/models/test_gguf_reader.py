"""The start-up reader (gguf_io._Reader) gives gguf's GGUFReader's fields and tensors exactly:
every field's types, parts (dtype and values) and data indices, on arrays of each kind."""

import gguf
import numpy as np

from cfr_atlas.models.gguf_io import _Reader


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


def test_tiny_model(tiny_gguf):
    _same(tiny_gguf())
