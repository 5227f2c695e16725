"""benchmarks/bench_batch_walk.py stays runnable and measures what it says: a quick run on a
tiny model prints one row per N, both arms really ran (the batched walks' call only in the
"on" blocks), the decode step is left as loaded, and bad arguments exit 2."""

from __future__ import annotations

from cfr_atlas.atlas import batch_walk
from cfr_atlas.engine import load_model
from cfr_atlas.models.decode import DecodeStep


def test_quick_run_prints_both_arms(load_benchmark, tiny_llama, capsys, monkeypatch):
    bench = load_benchmark("bench_batch_walk")
    runs = []
    real = batch_walk.HotWalks.run
    monkeypatch.setattr(batch_walk.HotWalks, "run",
                        lambda self, *a, **k: runs.append(1) or real(self, *a, **k))
    walks = DecodeStep.__dict__["_walks"]
    assert bench.main(["--model", str(tiny_llama), "--sequences", "2,3", "--rounds", "2",
                       "--steps", "2", "--context", "20"]) == 0
    assert DecodeStep.__dict__["_walks"] is walks  # left as loaded
    out = capsys.readouterr().out
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| 2 ")
            or line.startswith("| 3 ")]
    assert [r[0].strip() for r in rows] == ["2", "3"]
    assert all(float(r[1]) > 0 and float(r[2]) > 0 and float(r[3]) > 0 for r in rows)
    # one batched call per layer of each "on" step, none in "off" steps: per N, the warm-up's
    # 2 + 2 steps on and 2 rounds x 2 steps on
    n_layers = load_model(tiny_llama).config.n_layers
    assert len(runs) == 2 * (2 + 2 + 2 * 2) * n_layers


def test_bad_arguments_exit_2(load_benchmark, capsys):
    bench = load_benchmark("bench_batch_walk")
    assert bench.main(["--sequences", "1"]) == 2
    assert bench.main(["--sequences", "x"]) == 2
    assert "--sequences needs integers >= 2" in capsys.readouterr().err
