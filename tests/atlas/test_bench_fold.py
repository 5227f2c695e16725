"""benchmarks/bench_fold.py stays runnable: a tiny run prints its table and exits 0, and a row
that is not bitwise equal to the all-hot fold is reported with exit status 1."""

from __future__ import annotations

import numpy as np
import pytest

TINY = ["--context", "100", "--page", "8", "--head-dim", "8", "--repeats", "1"]


@pytest.fixture(scope="module")
def bench(load_benchmark):
    return load_benchmark("bench_fold")


def test_tiny_run_prints_one_table(bench, capsys):
    assert bench.main(TINY + ["--group", "2", "--storage", "float16"]) == 0
    out = capsys.readouterr().out
    assert "fold, budget 0% (0 pages), all regenerated" in out and "GQA group 3" in out
    assert out.count("baseline") == 1 and " NO" not in out


def test_a_row_that_is_not_bitwise_equal_fails(bench):
    args = bench.parse_args(TINY)
    rows = bench.build(args)
    bench.measure(rows, 1)
    rows[2].out = np.nextafter(rows[2].out, np.inf)  # one ulp off
    text, ok = bench.table(rows, args)
    assert not ok and " NO" in text
