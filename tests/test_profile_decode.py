"""benchmarks/profile_decode.py stays runnable and measures what it says: on a generated model,
the table has both paths per context, the compiled decode path really ran (and needs fewer
Python calls per token than the general path), and the path is switched back on afterwards.
Checks the output's shape and the call counts, never the speed."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from cfr_atlas.atlas.hot_cache import HotCache
from cfr_atlas.testing import write_tiny_gguf

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def test_profile_prints_both_paths(tmp_path, capsys):
    sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location("profile_decode",
                                                  BENCHMARKS / "profile_decode.py")
    prof = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(prof)
    compiled = HotCache.append_walk
    model = write_tiny_gguf(tmp_path / "tiny.gguf", qtype="Q4_1")
    assert prof.main(["--model", str(model), "--contexts", "5,40", "--tokens", "2",
                      "--rounds", "1", "--matmul", "int8"]) == 0
    assert HotCache.append_walk is compiled  # switched back on
    lines = capsys.readouterr().out.splitlines()
    rows = [line.split("|")[1:-1] for line in lines[2:]]
    assert [(r[0].strip(), r[1].strip()) for r in rows] == [
        (c, p) for c in ("5", "40") for p in ("compiled", "general", "general / compiled")]
    for i in (0, 3):  # per context: the compiled path makes fewer Python calls a token
        calls = [float(rows[i + j][7].replace(",", "")) for j in (0, 1)]
        assert 0 < calls[0] < calls[1]
        assert all(float(x) > 0 for x in rows[i][2:7])  # the head was timed too
