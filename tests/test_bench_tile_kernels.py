"""benchmarks/bench_tile_kernels.py stays runnable and measures what it says: a quick run
prints one row per (format, matrix, tokens) with both kernels timed (having first checked
their outputs bitwise equal), and bad arguments exit 2."""

from __future__ import annotations


def test_quick_run_prints_a_row_per_case(load_benchmark, capsys):
    bench = load_benchmark("bench_tile_kernels")
    assert bench.main(["--formats", "Q4_0,Q6_K", "--shapes", "64x256", "--tokens", "1,5",
                       "--pairs", "2", "--isa", "portable"]) == 0
    out = capsys.readouterr().out
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| Q")]
    assert [(r[0].strip(), r[1].strip(), r[2].strip()) for r in rows] == [
        ("Q4_0", "64x256", "1"), ("Q4_0", "64x256", "5"), ("Q6_K", "64x256", "1"),
        ("Q6_K", "64x256", "5")]
    assert all(float(r[3]) > 0 and float(r[4]) > 0 and float(r[5]) > 0 for r in rows)


def test_bad_arguments_exit_2(load_benchmark, capsys):
    bench = load_benchmark("bench_tile_kernels")
    assert bench.main(["--formats", "Q5_K"]) == 2
    assert bench.main(["--shapes", "64x100"]) == 2
    assert bench.main(["--tokens", "0"]) == 2
    assert "bad argument" in capsys.readouterr().err
