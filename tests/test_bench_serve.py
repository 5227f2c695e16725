"""benchmarks/bench_serve.py stays runnable: a quick run on a tiny model starts the server in
its own process, drives it with 1 and 2 concurrent streams, prints the table and writes the
JSON rows and the plot."""

from __future__ import annotations

import json


def test_quick_run_prints_table_json_and_plot(load_benchmark, tiny_llama, tmp_path, capsys):
    bench = load_benchmark("bench_serve")
    out_json, out_png = tmp_path / "rows.json", tmp_path / "plot.png"
    argv = ["--model", str(tiny_llama), "--clients", "1,2", "--tokens", "6",
            "--json", str(out_json), "--plot", str(out_png), "--in-process"]
    assert bench.main(argv) == 0
    out = capsys.readouterr().out
    rows = json.loads(out_json.read_text())
    assert [r["clients"] for r in rows] == [1, 2]
    assert all(0 < r["tokens"] <= 6 * r["clients"] and r["tokens_per_s"] > 0 for r in rows)
    assert "| clients | tokens | tokens/s | x one stream |" in out
    assert "| 1 | " in out and "| 2 | " in out and "| 1.00 |" in out
    assert out_png.stat().st_size > 1000
    assert "| sequences | ms per step | tokens/s | x first row |" in out
