"""shared/model_files/gguf_header.py reads what gguf.GGUFReader reads, without its
metadata arrays: the same scalar and string fields, every array's element type and
length, and each tensor's name, dims, type, absolute data offset and byte count, on
tiny files of every family and tensor type, on the default model's GGUF and on a
file with a custom alignment and nested arrays; a file it cannot read is refused (and
gguf_header falls back to GGUFReader)."""

from __future__ import annotations

import numpy as np
import pytest

import gguf
from gguf import GGMLQuantizationType as T
from shared.model_files.gguf_header import HeaderError, read_header
from shared.model_files.gguf_model import gguf_header
from tests.gguf_input.test_gguf_models import _gguf


def _reader_view(path):
    reader = gguf.GGUFReader(str(path))
    fields = {}
    for name, f in reader.fields.items():
        if name.startswith("GGUF."):  # the reader's own pseudo-fields (version, counts)
            continue
        if f.types[0] == gguf.GGUFValueType.ARRAY:
            # an array of arrays: GGUFReader lists its leaves; the header, the outer count
            fields[name] = ((int(f.types[1]), len(f.data)) if len(f.types) == 2 else
                            (int(gguf.GGUFValueType.ARRAY), None))
        else:
            fields[name] = f.contents()
    tensors = [(t.name, tuple(int(d) for d in t.shape), int(t.tensor_type),
                int(t.data_offset), int(t.n_bytes)) for t in reader.tensors]
    return fields, tensors


def _assert_same(path):
    header = read_header(path)
    fields, tensors = _reader_view(path)
    assert header.fields.keys() == fields.keys()
    for name, want in fields.items():
        got = header.fields[name]
        if isinstance(want, tuple) and want[1] is None:  # nested: the element type
            assert got[0] == want[0], name
            continue
        assert got == pytest.approx(want) if isinstance(want, float) else got == want, name
    assert [(t.name, t.dims, t.ggml_type, t.data_offset, t.n_bytes)
            for t in header.tensors] == tensors


@pytest.mark.parametrize("arch,kind", [("llama", T.Q4_K), ("gemma3", T.Q8_0),
                                       ("qwen3moe", T.Q5_1), ("phi3", T.BF16),
                                       ("qwen2", T.Q6_K), ("llama", T.Q2_K)],
                         ids=lambda v: getattr(v, "name", v))
def test_the_header_is_what_ggufreader_reads(tmp_path, arch, kind):
    _assert_same(_gguf(tmp_path, arch, kind))


def test_the_default_models_gguf():
    from shared.model_files.default_model import resolve_model
    from shared.model_files.gguf_model import gguf_source
    _assert_same(gguf_source(resolve_model(None)))


def test_alignment_nested_arrays_and_every_scalar_type(tmp_path):
    path = tmp_path / "odd.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_custom_alignment(64)
    w.add_uint8("t.u8", 7)
    w.add_int16("t.i16", -3)
    w.add_uint64("t.u64", 2**40)
    w.add_float64("t.f64", 0.1)
    w.add_bool("t.b", True)
    w.add_array("t.strings", ["a", "bc", "é"])
    w.add_array("t.nested", [[1, 2], [3]])
    w.add_tensor("x", np.arange(12, dtype=np.float32).reshape(3, 4))
    w.add_tensor("y", np.ones((2, 32), dtype=np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _assert_same(path)
    header = read_header(path)
    assert header.fields["general.alignment"] == 64
    assert header.fields["t.nested"] == (int(gguf.GGUFValueType.ARRAY), 2)
    assert all(t.data_offset % 64 == 0 for t in header.tensors)


def test_a_file_it_cannot_read_is_refused_and_ggufreader_takes_over(tmp_path, monkeypatch):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"NOPE" + bytes(20))
    with pytest.raises(HeaderError, match="not a GGUF"):
        read_header(bad)
    path = _gguf(tmp_path, "llama", T.Q8_0)
    import shared.model_files.gguf_model as gm

    def refuse(p):
        raise HeaderError("as if big-endian")
    monkeypatch.setattr(gm, "read_header", refuse)
    fallback = gguf_header(path)
    monkeypatch.undo()
    lean = read_header(path)
    assert fallback.tensors == lean.tensors
    assert fallback.fields["general.architecture"] == lean.fields["general.architecture"]
