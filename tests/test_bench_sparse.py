"""benchmarks/bench_sparse.py stays runnable: --quick runs dense, two top_k and two block-sparse
rows on a small latent stream at a 10% budget, prints the table and exits 0 only if every row
is bitwise exact; sparse rows regenerate fewer pages than dense and skip the rest."""

from __future__ import annotations

import json


def test_quick_run_is_exact_and_sparse_rows_read_less(load_benchmark, tmp_path, capsys):
    bench = load_benchmark("bench_sparse")
    out_json = tmp_path / "rows.json"
    assert bench.main(["--quick", "--json", str(out_json)]) == 0
    rows = json.loads(out_json.read_text())
    assert [r["top_k"] for r in rows] == ["dense", "128", "32", "4 blocks of 16", "1 blocks of 16"]
    assert all(r["exact"] for r in rows) and "| NO |" not in capsys.readouterr().out
    dense, *sparse = rows
    assert dense["pages_skipped"] == 0 and dense["pages_regenerated"] > 0
    for r in sparse:
        assert r["pages_regenerated"] <= dense["pages_regenerated"]
        assert r["pages_skipped"] > 0
    assert sparse[-1]["pages_regenerated"] < dense["pages_regenerated"]
