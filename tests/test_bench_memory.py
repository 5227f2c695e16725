"""benchmarks/bench_memory.py stays runnable: a tiny run on a generated model prints both tables
and the plot and exits 0; the cold page-cache phase works against a page file that can be
evicted; a row that is not bitwise equal, or above its budget, fails the run."""

from __future__ import annotations

import json
import os

import pytest


@pytest.fixture(scope="module")
def bench(load_benchmark):
    return load_benchmark("bench_memory")  # benchmarks/ on sys.path: page_cache.py importable


def test_tiny_run_prints_tables_json_and_plot(bench, tmp_path, capsys):
    out_json, out_png = tmp_path / "rows.json", tmp_path / "plot.png"
    argv = ["--contexts", "", "--tiny-context", "600", "--budgets", "min,1%",
            "--decode-tokens", "2", "--json", str(out_json), "--plot", str(out_png)]
    assert bench.main(argv) == 0
    out = capsys.readouterr().out
    rows = json.loads(out_json.read_text())
    model = f"| tiny {rows[0]['storage_dtype']} | 600 |"  # the session's default dtype
    assert f"{model} unbounded | warm |" in out and f"{model} min (" in out
    assert "| NO |" not in out
    assert "skipped 600 tokens, budget 1%" in out  # below the smallest accepted budget
    assert [r["budget"] for r in rows] == ["unbounded", "min"]
    least = rows[1]
    assert least["budget_bytes"] == least["min_bytes"] >= least["allocated_kv_peak"] > 0
    assert least["regenerated"] > 0 and least["warm"]["bitwise"]
    assert {"load", "prefill", "decode", "cold"} <= set(least["phases"])
    assert least["phases"]["load"]["RssAnon"] > 0 and "RssFile" in least["phases"]["load"]
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cold_phase_evicts_and_reads_the_page_file(bench, tiny_gguf, tmp_path):
    spec = {"model": str(tiny_gguf(context_length=2048)), "tiny": True, "context": 600,
            "decode_tokens": 2, "cold_phase": True, "storage_dtype": "float16",
            "regenerator": "spill"}
    base = bench.measure(spec | {"budget": "unbounded"})
    row = bench.measure(spec | {"budget": "min"})
    cold = row["cold"]
    assert row["storage_dtype"] == "float16" and cold["bytes_read"] > 0
    assert cold["gb_per_s"] == pytest.approx(cold["bytes_read"] / cold["seconds"] / 1e9)
    assert cold["resident_before"] is not None and cold["resident_before"] < 1
    seq = cold["sequential"]
    assert seq["bytes"] > 0 and seq["gb_per_s"] > 0
    # one sequential read beside each cold token; the row's ratio is the median of the pairs'
    assert len(cold["sequential_gb_per_s"]) == len(cold["read_ratios"]) == 2
    pairs = [b / t / 1e9 / g for b, t, g in zip(cold["token_bytes"], cold["token_seconds"],
                                                 cold["sequential_gb_per_s"], strict=True)]
    assert cold["read_ratios"] == pytest.approx(pairs)
    assert cold["read_ratio"] == pytest.approx(sum(pairs) / 2)
    assert sum(cold["token_bytes"]) == cold["bytes_read"]
    assert cold["read_ratio_aggregate"] == pytest.approx(cold["gb_per_s"] / seq["gb_per_s"])
    rows = [base | spec | {"budget": "unbounded"}, row | spec | {"budget": "min"}]
    assert bench.compare(rows) == [] and rows[1]["cold"]["bitwise"]
    assert "| cold |" in bench.speed_table(rows)
    bench.plot(rows, tmp_path / "cold.png")  # the cold (dashed) lines too
    assert (tmp_path / "cold.png").stat().st_size > 0


def test_resident_fraction_sees_a_read_file_and_its_eviction(bench, tmp_path):
    from page_cache import drop_file_cache, resident_fraction, sequential_read

    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(1 << 20))
    path.read_bytes()
    assert resident_fraction(path) > 0.9
    drop_file_cache(path)
    if resident_fraction(path) > 0.1:
        pytest.skip("this file system keeps the file in memory (tmpfs?): nothing to evict")
    got = sequential_read(path)
    assert got["bytes"] == 1 << 20 and got["resident_before"] <= 0.1
    assert resident_fraction(path) > 0.9  # read back in


def _row(budget, digest="d", allocated=10, budget_bytes=None):
    return {"budget": budget, "context": 8, "tiny": True, "storage_dtype": "float32",
            "budget_bytes": budget_bytes, "prefill_tps": 1.0, "allocated_kv_peak": allocated,
            "warm": {"tps": 1.0, "digest": digest}}


def test_a_row_not_bitwise_equal_or_over_budget_fails(bench):
    rows = [_row("unbounded"), _row("50%", digest="e", budget_bytes=100),
            _row("min", allocated=101, budget_bytes=100)]
    failures = bench.compare(rows)
    assert len(failures) == 2
    assert "logits differ" in failures[0] and "101 bytes exceeds the budget 100" in failures[1]
    table = bench.speed_table(rows)
    assert table.count("| NO |") == 1 and table.count("| yes |") == 2


@pytest.mark.parametrize("spec", ["0%", "101%", "x%", "12 parsecs", "-5MiB"])
def test_bad_budget_specs_are_refused(bench, spec):
    with pytest.raises(SystemExit):
        bench.parse_args(["--budgets", spec])


def test_budget_bytes_fraction_and_minimum(bench, tiny_gguf):
    from cfr_atlas.engine import load_model
    from cfr_atlas.models.session import fixed_kv_bytes

    model = load_model(tiny_gguf(context_length=2048))
    full = 1000 * model.config.kv_bytes_per_token(2)
    got = bench.budget_bytes("10%", model, 1000, "float16", 2, 256, "recompute")
    least = sum(fixed_kv_bytes(model.config, regenerator="recompute", storage_dtype="float16",
                               context_limit=1000).values())
    assert got == {"budget_bytes": full // 10, "full_kv_bytes": full, "min_bytes": least}
    assert bench.budget_bytes("min", model, 1000, "float16", 2, 256, "recompute")[
        "budget_bytes"] == least
    assert bench.budget_bytes("2KiB", model, 1000, "float16", 2, 256, "spill")[
        "budget_bytes"] == 2048


def test_a_turn_waits_for_the_token_and_hands_it_back(bench):
    go_r, go_w = os.pipe()
    done_r, done_w = os.pipe()
    turns = bench.Turns(f"{go_r},{done_w}")
    os.write(go_w, b".")
    with turns:
        os.set_blocking(done_r, False)
        with pytest.raises(BlockingIOError):  # not handed back while the turn runs
            os.read(done_r, 1)
    assert os.read(done_r, 1) == b"."
    os.close(go_w)  # the driver went away: the next turn ends the worker
    with pytest.raises(SystemExit):
        with turns:
            pass
    for fd in (go_r, done_r, done_w):
        os.close(fd)
    with bench.Turns():  # alone: free
        pass


def test_the_driver_prepares_tiles_and_kernels_before_the_workers(bench, tiny_gguf, tmp_path,
                                                                  monkeypatch):
    """prepare runs each model's budgets once, short, each in a process of its own: the tile
    file the workers will map exists afterwards."""
    monkeypatch.setenv("CFR_ATLAS_TILES", str(tmp_path / "tiles"))
    model = str(tiny_gguf(arch="llama", qtype="Q8_0", n_layers=2))
    spec = {"model": model, "tiny": True, "context": 2048, "decode_tokens": 8,
            "cold_phase": False, "storage_dtype": None, "regenerator": "spill"}
    bench.prepare([spec | {"budget": "unbounded"}, spec | {"budget": "min"}])
    assert [p.suffix for p in (tmp_path / "tiles").iterdir()] == [".tiles"]


def test_prepare_runs_each_budget_once_short_and_never_skips_one(bench, monkeypatch):
    """One short run per (model, budget) whatever the contexts; a size runs as 50%; a fraction
    the short run refuses runs as min; a run that is still refused stops the benchmark."""
    calls = []

    def fake_worker(spec):
        calls.append(spec)
        return {"skipped": "too small"} if spec["budget"] in refused else {}

    monkeypatch.setattr(bench, "run_worker", fake_worker)
    base = {"model": None, "tiny": False, "decode_tokens": 24, "cold_phase": True,
            "storage_dtype": None, "regenerator": "spill"}
    specs = [base | {"context": c, "budget": b} for c in (4096, 8192)
             for b in ("unbounded", "1%", "64MiB", "min")]
    specs.append(base | {"context": 300, "budget": "min", "model": "other.gguf"})
    refused = {"1%"}
    bench.prepare(specs)
    assert [(s["model"], s["budget"], s["context"], s["decode_tokens"]) for s in calls] == [
        (None, "unbounded", 600, 2), (None, "1%", 600, 2), (None, "min", 600, 2),
        (None, "50%", 600, 2), (None, "min", 600, 2), ("other.gguf", "min", 300, 2)]
    calls.clear()
    refused = {"1%", "min"}
    with pytest.raises(SystemExit, match="preparing 1% failed: too small"):
        bench.prepare(specs[:2])
