"""The tile cache: a later load maps the tiles a first load repacked, bitwise the same, and a
damaged, truncated or stale file is never used (the weights are repacked and the file
rewritten)."""

from __future__ import annotations

import logging
import mmap

import numpy as np
import pytest

from cfr_atlas.engine import load_model
from cfr_atlas.models import tile_cache
from cfr_atlas.models.gguf_io import GGUFFile
from cfr_atlas.models.tile_cache import TileCache

IDS = [5, 17, 3, 42, 8, 99, 23]


@pytest.fixture(scope="module")
def mixed(tiny_gguf):
    """Every supported matrix format (Q8_0, Q4_0, Q4_1, F32, F16, BF16), untied head."""
    return tiny_gguf(qtype="mixed", n_layers=2, tied_embeddings=False)


def _weights(model) -> dict:
    w = model.net.weights
    out = {"embed": w.embed, "output": w.output}
    for i, lay in enumerate(w.layers):
        for j, q in enumerate([lay.wqkv, lay.wo, *lay.ffn.weights()]):
            for k, part in enumerate(q if isinstance(q, list) else [q]):
                out[f"{i}.{j}.{k}"] = part
    return out


def _file_backed(a: np.ndarray) -> bool:
    while isinstance(a, np.ndarray):
        a = a.base
    return isinstance(a, memoryview) and isinstance(a.obj, mmap.mmap)


def _same_tiles(a, b) -> bool:
    return type(a.tiles) is type(b.tiles) and all(
        np.array_equal(x, y) and x.dtype == y.dtype and x.shape == y.shape
        if isinstance(x, np.ndarray) else x == y for x, y in zip(a.tiles, b.tiles, strict=True))


def _check_same(model, ref, *, mapped: bool) -> None:
    ws, refs = _weights(model), _weights(ref)
    assert ws.keys() == refs.keys()
    for name, w in ws.items():
        assert _same_tiles(w, refs[name]), name
        arrays = [a for a in w.tiles if isinstance(a, np.ndarray) and a.size]
        assert all(_file_backed(a) == mapped for a in arrays), name
    assert np.array_equal(model.logits(IDS), ref.logits(IDS))


@pytest.mark.parametrize("matmul", ["float", "int8"])
def test_mapped_tiles_are_the_repacked_ones(mixed, tmp_path, matmul):
    ref = load_model(mixed, tile_cache=False, matmul=matmul)
    first = load_model(mixed, tile_cache=tmp_path, matmul=matmul)  # repacks, writes
    _check_same(first, ref, mapped=False)
    (path,) = tmp_path.glob("*.tiles")
    assert path.name.endswith(f"-{matmul}.tiles")
    second = load_model(mixed, tile_cache=tmp_path, matmul=matmul)  # maps
    _check_same(second, ref, mapped=True)
    assert all(a.flags.writeable for w in _weights(second).values() for a in w.tiles
               if isinstance(a, np.ndarray))  # copy-on-write: the kernels' array types


def test_k_quant_int8_tiles_map_back(tmp_path):
    """The tiny files hold no K-quants (gguf-py cannot quantize them): Q6_K's int8 tiles
    (int8_sub16.IntTiles: int8 weights and scales, float32 d) through the cache by hand."""
    from cfr_atlas.quant import QType, QuantWeight

    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=(40, 2 * 210), dtype=np.uint8)  # 2 Q6_K super-blocks a row
    raw.view(np.float16)[:, 104::105] = np.float16(0.01)  # each block's d, its last 2 bytes
    x = rng.standard_normal((3, 512)).astype(np.float32)
    for second in (False, True):  # the first load repacks and writes, the second maps
        cache = tile_cache.TileCache(tmp_path, "k" * 32, "int8")
        w = QuantWeight.from_raw("w", QType.Q6_K, raw, (40, 512), arithmetic="int8",
                                 repack=cache.repack)
        assert cache.verify() and cache.hits == int(second)
        if not second:
            assert cache.save() is not None
            ref = w
    assert _same_tiles(w, ref) and all(_file_backed(a) for a in w.tiles)
    assert np.array_equal(w.matmul(x), ref.matmul(x))


def _damage(path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "truncated":
        data = data[:-100]
    elif how == "data byte":
        data[-1000] ^= 0x01  # inside the tiles: only the checksum can tell
    elif how == "header byte":
        data[60] ^= 0x20  # inside the JSON header
    elif how == "magic":
        data[0:8] = b"NOTTILES"
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["truncated", "data byte", "header byte", "magic"])
def test_damaged_file_is_repacked_and_rewritten(mixed, tmp_path, caplog, how):
    ref = load_model(mixed, tile_cache=False)
    load_model(mixed, tile_cache=tmp_path)
    (path,) = tmp_path.glob("*.tiles")
    good = path.read_bytes()
    _damage(path, how)
    with caplog.at_level(logging.WARNING, logger="cfr_atlas.models.tile_cache"):
        model = load_model(mixed, tile_cache=tmp_path)
    assert any("tile cache" in r.getMessage() and "repacking" in r.getMessage()
               for r in caplog.records), how
    _check_same(model, ref, mapped=False)
    assert path.read_bytes() == good  # rewritten: the same bytes as the first
    _check_same(load_model(mixed, tile_cache=tmp_path), ref, mapped=True)


def test_stale_key_is_a_miss_and_rewritten(mixed, tmp_path, monkeypatch):
    load_model(mixed, tile_cache=tmp_path)
    (path,) = tmp_path.glob("*.tiles")
    monkeypatch.setattr(tile_cache, "code_version", lambda: "other code")
    gf = GGUFFile(mixed)
    stale = TileCache(tmp_path, gf.identity(), "float")
    assert stale.entries == {}  # the old code's file is not used
    model = load_model(mixed, tile_cache=tmp_path)
    assert not any(_file_backed(a) for a in model.net.weights.embed.tiles
                   if isinstance(a, np.ndarray))
    assert TileCache(tmp_path, gf.identity(), "float").entries  # rewritten for this code


def test_size_cap_and_disabled_write_nothing(mixed, tmp_path):
    gf = GGUFFile(mixed)
    cache = TileCache(tmp_path, gf.identity(), "float", max_bytes=1)
    gf.tile_cache = cache
    load_model  # noqa: B018 (the engine does the same steps)
    from cfr_atlas.models.families import load_net

    load_net(gf)
    assert cache.recorded and cache.save() is None
    load_model(mixed, tile_cache=False)
    assert list(tmp_path.iterdir()) == []


def test_folder_keeps_the_newest_files_within_its_budget(tiny_gguf, tmp_path, monkeypatch):
    paths = [tiny_gguf(seed=s, n_layers=1) for s in (11, 12, 13)]
    load_model(paths[0], tile_cache=tmp_path)
    (first,) = tmp_path.glob("*.tiles")
    monkeypatch.setattr(tile_cache, "KEEP_BYTES", 2 * first.stat().st_size)  # two such files
    for p in paths[1:]:
        load_model(p, tile_cache=tmp_path)
    names = {f.name for f in tmp_path.glob("*.tiles")}
    assert len(names) == 2 and first.name not in names  # the least recently used went
    load_model(paths[1], tile_cache=tmp_path)  # maps it: now the most recently used
    load_model(paths[0], tile_cache=tmp_path)  # written again: paths[2]'s file goes
    assert {f.name for f in tmp_path.glob("*.tiles")} == {
        f"{GGUFFile(p).identity()[:32]}-float.tiles" for p in paths[:2]}


def test_default_folder_and_size_cap(mixed, tmp_path, monkeypatch):
    monkeypatch.setattr(tile_cache, "default_dir", lambda: tmp_path / "default")
    monkeypatch.setattr(tile_cache, "DEFAULT_MAX_BYTES", 1)
    load_model(mixed)  # the default: this model's tiles are over the (patched) cap
    assert not (tmp_path / "default").exists()
    load_model(mixed, tile_cache=True)  # the default folder, any size
    assert len(list((tmp_path / "default").glob("*.tiles"))) == 1
    monkeypatch.setattr(tile_cache, "DEFAULT_MAX_BYTES", 2 << 30)
    model = load_model(mixed)  # under the cap: the default maps the file
    assert all(_file_backed(a) for a in model.net.weights.embed.tiles
               if isinstance(a, np.ndarray) and a.size)


def test_the_default_folder_follows_cfr_atlas_tiles(tmp_path, monkeypatch):
    monkeypatch.setenv("CFR_ATLAS_TILES", str(tmp_path / "elsewhere"))
    assert tile_cache.default_dir() == tmp_path / "elsewhere"
    monkeypatch.delenv("CFR_ATLAS_TILES")
    assert tile_cache.default_dir().parts[-2:] == ("cfr-atlas", "tiles")
