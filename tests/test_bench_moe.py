"""benchmarks/bench_moe.py stays runnable: --quick writes a tiny skewed MoE file, runs every
budget warm and cold with the prefetcher off and on, the cold decode token by token at the
smallest budget (reads through the page cache and direct), the decode under memory pressure
(or says why it was skipped), and the warm A/B of 50% against all resident; prints the tables
and exits 0 only if every row is bitwise exact."""

from __future__ import annotations

import json


def test_quick_run_prints_table_and_every_row_is_exact(load_benchmark, tmp_path, capsys):
    bench = load_benchmark("bench_moe")
    out_json = tmp_path / "rows.json"
    folder = tmp_path / "not" / "yet"  # --dir is made when it does not exist
    assert bench.main(["--quick", "--json", str(out_json), "--dir", str(folder)]) == 0
    assert folder.is_dir() and not any(folder.iterdir())  # the model file's temp folder went
    out = capsys.readouterr().out
    rows = json.loads(out_json.read_text())
    assert [(r["budget"], r["cache"], r["prefetch"]) for r in rows][:5] == [
        ("100%", "warm", False), ("100%", "warm", True), ("100%", "cold", False),
        ("100%", "cold", True), ("50%", "warm", False)]  # prefetcher off/on back to back
    assert all(r["exact"] for r in rows) and "| NO |" not in out
    full = rows[0]["pool_bytes"]
    assert all(r["pool_bytes"] <= full // 2 for r in rows[4:])
    assert rows[-1]["decode_read_per_token"] > 0  # the smallest pool reads while decoding
    cold = out[out.index("Cold decode, token by token"):out.index("Decode under memory")]
    assert "| min (2 slots) | cached | 4 |" in cold and "| NO |" not in cold  # token by token
    assert "| min (2 slots) | direct" in cold and "read cost rate / sequential" in cold
    pressed = out[out.index("Decode under memory"):out.index("Expert loads alone")]
    assert "(skipped: " in pressed or (
        "| cached | " in pressed and "| direct | " in pressed and "| NO |" not in pressed)
    ab = out[out.index("interleaved A/B"):]
    assert "| 100% |" in ab and "| 50% |" in ab and "| NO |" not in ab


def test_a_cold_budget_that_reads_nothing_is_a_row_not_a_crash(load_benchmark, capsys):
    """All resident, a token reads nothing: the cold table says so instead of dividing 0 by 0."""
    bench = load_benchmark("bench_moe")
    assert bench.main(["--quick", "--budgets", "100%", "--ab-rounds", "0",
                       "--cold-budgets", "100%", "--pressure-budgets", ""]) == 0
    out = capsys.readouterr().out
    assert "| 100% | cached | 0 (every token's experts resident: nothing read) |" in out


def test_the_read_cost_rate_is_bytes_over_the_time_reads_added(load_benchmark):
    """A token of 20 ms whose all-resident twin takes 10 ms read 10 MB in the 10 ms its reads
    added: 1 GB/s, 0.5 of a 2 GB/s disk; reads that added no time are an infinite rate, not a
    division by zero."""
    bench = load_benchmark("bench_moe")
    assert bench._reads_share(10.0, 20.0, 10.0, 2.0) == 0.5
    assert bench._reads_share(10.0, 9.0, 10.0, 2.0) == float("inf")
