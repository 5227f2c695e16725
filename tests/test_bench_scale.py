"""benchmarks/bench_scale.py stays runnable: a --quick run on a tiny model starts two pairs of
real replicas (own prefix caches, then one shared Redis), drives them through its round-robin
proxy, prints both tables and writes the JSON and the plot; the replica that never saw a
prefix maps it from Redis."""

from __future__ import annotations

import json


def test_quick_run_prints_tables_json_and_plot(load_benchmark, tiny_llama, redis_db, tmp_path,
                                               capsys):
    bench = load_benchmark("bench_scale")
    out_json, out_png = tmp_path / "scale.json", tmp_path / "scale.png"
    argv = ["--quick", "--model", str(tiny_llama), "--redis", redis_db.url,
            "--json", str(out_json), "--plot", str(out_png)]
    assert bench.main(argv) == 0
    out = capsys.readouterr().out
    result = json.loads(out_json.read_text())
    assert list(result["replay"]) == ["1 replica", "2 replicas", "2 + Redis"]
    assert all(r["requests"] == 2 and r["tokens_per_s"] > 0 for r in result["replay"].values())
    (cold,) = result["never_saw_it"]["2 replicas"]
    (warm,) = result["never_saw_it"]["2 + Redis"]
    assert cold["other_cached"] == 0 and warm["other_cached"] >= 256  # B mapped A's blocks
    shared = result["replay"]["2 + Redis"]
    assert shared["written"] > 0 and shared["redis_used"] > 0
    assert "| family | prompt tokens | A first (cold) |" in out and "| 2 + Redis | 2 |" in out
    assert out_png.stat().st_size > 1000
