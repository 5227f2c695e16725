"""benchmarks/profile_decode.py stays runnable and measures what it says: on a generated model,
the table has the three paths per context (the decode step, forward_layers' pieces with the
compiled walk, the general calls), each really ran (the step needs fewer Python calls per token
than the pieces, the pieces fewer than the general calls), and the model is left as loaded.
Checks the output's shape and the call counts, never the speed."""

from __future__ import annotations

import numpy as np

from cfr_atlas.atlas.hot_cache import HotCache
from cfr_atlas.testing import write_tiny_gguf


def test_profile_prints_every_path(load_benchmark, tmp_path, capsys):
    prof = load_benchmark("profile_decode")
    compiled = HotCache.append_fold, HotCache.walk_misses
    model = write_tiny_gguf(tmp_path / "tiny.gguf", qtype="Q4_1")
    assert prof.main(["--model", str(model), "--contexts", "5,40", "--tokens", "2",
                      "--rounds", "1", "--matmul", "int8"]) == 0
    assert (HotCache.append_fold, HotCache.walk_misses) == compiled  # switched back on
    lines = capsys.readouterr().out.splitlines()
    rows = [line.split("|")[1:-1] for line in lines[2:]]
    paths = ("step", "pieces", "general", "pieces / step", "general / step")
    assert [(r[0].strip(), r[1].strip()) for r in rows] == [
        (c, p) for c in ("5", "40") for p in paths]
    for i in (0, 5):  # per context: each path makes fewer Python calls a token than the next
        calls = [float(rows[i + j][7].replace(",", "")) for j in (0, 1, 2)]
        assert 0 < calls[0] < calls[1] < calls[2]
        for j in (0, 1):
            assert all(float(x) > 0 for x in rows[i + j][2:7])  # products, head, attention


def test_the_model_keeps_its_decode_step(load_benchmark, tmp_path):
    prof = load_benchmark("profile_decode", "profile_decode2")
    from cfr_atlas.engine import load_model

    model = load_model(write_tiny_gguf(tmp_path / "tiny.gguf", qtype="Q8_0"))
    step = model.net.decode_step
    ids = np.arange(1, 40, dtype=np.int64)
    from cfr_atlas.models.session import Session
    from cfr_atlas.quant.weight import QuantWeight

    before = (QuantWeight.product, QuantWeight.matmul, Session.decode_attend)
    prof.profile(model, ids, 5, 2, 1)
    assert model.net.decode_step is step and step is not None
    assert (QuantWeight.product, QuantWeight.matmul, Session.decode_attend) == before
