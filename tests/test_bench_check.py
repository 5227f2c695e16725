"""benchmarks/bench_check.py stays runnable: a tiny run prints its table, finds the checked and
unchecked folds bitwise equal, and refuses bad arguments."""

from __future__ import annotations

import json

import pytest


@pytest.fixture(scope="module")
def bench(load_benchmark):
    return load_benchmark("bench_check")


@pytest.mark.parametrize("storage", ["float16", "bfloat16", "float32"])
def test_tiny_run_prints_the_table_and_is_bitwise(bench, tmp_path, capsys, storage):
    out_json = tmp_path / "rows.json"
    argv = ["--contexts", "100,130", "--layers", "2", "--rounds", "3", "--storage", storage,
            "--page", "64", "--json", str(out_json)]
    assert bench.main(argv) == 0
    out = capsys.readouterr().out
    rows = json.loads(out_json.read_text())
    assert [r["context"] for r in rows] == [100, 130]
    assert all(r["bitwise"] and r["pages"] == 2 * 3 * -(-r["context"] // 64) for r in rows)
    assert "| 100 |" in out and "check cost at most 10% of the fold:" in out


def test_a_corrupted_page_stops_the_run(bench):
    """The benchmark's checked folds really check: a page changed after its checksum was
    taken is reported, not timed."""
    a = bench.parse_args(["--contexts", "64", "--layers", "1", "--rounds", "1"])
    import numpy as np

    k, v, sums = bench.pages(a, 64, np.random.default_rng(0))
    k[0, 0, 0] ^= 1
    walk = bench.walks(a, 64, sums, True)[0]
    q = np.zeros((1, a.kv_heads, a.group, a.head_dim), dtype=np.float32)
    out = np.empty_like(q)
    with pytest.raises(SystemExit, match="failed its checksum"):
        bench.layer_fold(a, 64, k, v, walk, q, out, True)
    walk = bench.walks(a, 64, sums, False)[0]
    bench.layer_fold(a, 64, k, v, walk, q, out, False)  # unchecked: nothing looks


@pytest.mark.parametrize("argv", [["--contexts", "0"], ["--contexts", "x"], ["--contexts", ""],
                                  ["--rounds", "0"], ["--layers", "-1"]])
def test_bad_arguments_are_refused(bench, argv):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
