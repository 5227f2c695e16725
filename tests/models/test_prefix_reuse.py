"""Prefix reuse end to end: repeated prompts map cached blocks and stay bitwise exact."""

import subprocess
import sys

import numpy as np
import pytest

from cfr_atlas.engine import load_model
from cfr_atlas.errors import ConfigError
from cfr_atlas.models.session import fixed_kv_bytes

PAGE = 4
IDS = [5, 77, 300, 12, 9, 256, 257, 1, 42, 99, 150, 3, 7, 8, 31, 200, 18, 64, 65, 66, 10, 11]


@pytest.fixture()
def cached(tiny_llama, tmp_path):
    m = load_model(tiny_llama, prefix_cache=tmp_path / "prefix")
    yield m
    m.prefix.close()


def test_repeated_prompt_reuses_blocks_bitwise(cached, tiny_llama):
    cold = load_model(tiny_llama).next_logits(IDS, page_tokens=PAGE)
    first = cached.next_logits(IDS, page_tokens=PAGE)
    assert cached.last_telemetry["prompt_cached_tokens"] == 0
    second = cached.next_logits(IDS, page_tokens=PAGE, chunk_tokens=3)
    assert cached.last_telemetry["prompt_cached_tokens"] == (len(IDS) - 1) // PAGE * PAGE
    assert np.array_equal(first, cold) and np.array_equal(second, cold)
    # a longer prompt sharing the prefix reuses it too, and matches its own cold run
    longer = IDS + [100, 101, 102, 103, 104]
    assert np.array_equal(cached.next_logits(longer, page_tokens=PAGE),
                          load_model(tiny_llama).next_logits(longer, page_tokens=PAGE))
    assert cached.last_telemetry["prompt_cached_tokens"] == len(IDS) // PAGE * PAGE


@pytest.mark.parametrize("regen", ["spill", "recompute"])
def test_mapped_blocks_serve_a_budgeted_session(cached, tiny_llama, tmp_path, regen):
    cold = load_model(tiny_llama).next_logits(IDS, page_tokens=PAGE)
    cached.next_logits(IDS, page_tokens=PAGE)
    # recompute also pays for its kept layer inputs; the 3 KiB left hold a mapped block (which
    # recompute keeps: it has no inputs for it) and a hot page
    extra = 0 if regen == "spill" else sum(fixed_kv_bytes(
        cached.config, regenerator=regen, page_tokens=PAGE, context_limit=len(IDS)).values())
    got = cached.next_logits(IDS, page_tokens=PAGE, kv_budget=extra + 3 * 1024,
                             regenerator=regen, cache_dir=tmp_path)
    assert np.array_equal(got, cold)
    assert cached.last_telemetry["prompt_cached_tokens"] > 0
    assert cached.last_telemetry["pages_regenerated"] > 0


def test_greedy_generation_with_prefix_cache_is_unchanged(cached, tiny_llama):
    plain = load_model(tiny_llama).generate(IDS, max_tokens=10, page_tokens=PAGE)
    assert cached.generate(IDS, max_tokens=10, page_tokens=PAGE) == plain
    assert cached.generate(IDS, max_tokens=10, page_tokens=PAGE) == plain
    assert cached.last_telemetry["prompt_cached_tokens"] > 0


def test_other_model_dtype_or_block_size_never_hits(cached, tiny_gguf, tmp_path):
    cached.next_logits(IDS, page_tokens=PAGE)
    cached.next_logits(IDS, page_tokens=PAGE * 2)
    assert cached.last_telemetry["prompt_cached_tokens"] == 0
    cached.next_logits(IDS, page_tokens=PAGE, storage_dtype="float32")  # not the default
    assert cached.last_telemetry["prompt_cached_tokens"] == 0
    other = load_model(tiny_gguf(arch="llama", qtype="Q8_0", n_layers=2, seed=1),
                       prefix_cache=tmp_path / "prefix")
    other.next_logits(IDS, page_tokens=PAGE)
    assert other.last_telemetry["prompt_cached_tokens"] == 0
    other.prefix.close()


def test_disk_tier_serves_blocks_after_restart(tiny_llama, tmp_path):
    folder = tmp_path / "prefix"
    m = load_model(tiny_llama, prefix_cache=folder)
    want = m.next_logits(IDS, page_tokens=PAGE)
    m.prefix.close()  # flushes the background writer
    code = (
        "import sys, numpy as np\n"
        "from cfr_atlas.engine import load_model\n"
        f"m = load_model({str(tiny_llama)!r}, prefix_cache={str(folder)!r})\n"
        f"got = m.next_logits({IDS!r}, page_tokens={PAGE})\n"
        "np.save(sys.argv[1], got)\n"
        "print(m.last_telemetry['prompt_cached_tokens'], m.prefix.disk.stats().hits)\n"
    )
    out = tmp_path / "got.npy"
    res = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True,
                         check=True)
    cached_tokens, disk_hits = map(int, res.stdout.split())
    assert cached_tokens == (len(IDS) - 1) // PAGE * PAGE and disk_hits >= cached_tokens // PAGE
    assert np.array_equal(np.load(out), want)


def test_prefix_cache_bytes_bounds_the_folder(tiny_llama, tmp_path, caplog):
    from cfr_atlas.kv import encoded_size

    probe = load_model(tiny_llama, prefix_cache=tmp_path / "probe")
    size = encoded_size(probe.prefix.cache(PAGE, "float16").signature)  # the default storage
    probe.prefix.close()
    folder = tmp_path / "prefix"
    m = load_model(tiny_llama, prefix_cache=folder, prefix_cache_bytes=2 * size)
    with caplog.at_level("INFO", logger="cfr_atlas.kv.disk_store"):
        m.next_logits(IDS, page_tokens=PAGE)
        m.prefix.disk.flush()
    s = m.prefix.disk.stats()
    files = list(folder.rglob("*.kvb"))
    assert len(IDS) // PAGE == 5 and s.evictions == 3 and s.evicted_bytes == 3 * size
    assert len(files) == 2 and sum(f.stat().st_size for f in files) <= 2 * size
    assert any("evicted" in r.getMessage() for r in caplog.records)
    m.prefix.close()
    with pytest.raises(ConfigError, match="prefix_cache_bytes"):
        load_model(tiny_llama, prefix_cache=folder, prefix_cache_bytes="lots")


def test_cli_prefix_cache_bytes(tiny_llama, tmp_path, capsys):
    from cfr_atlas import cli

    folder = tmp_path / "prefix"
    argv = ["generate", "--model", str(tiny_llama), "--raw", "--max-tokens", "1",
            "--prefix-cache", str(folder), "hello world " * 200]  # > 256 tokens: whole blocks

    def run(*extra):
        proc = subprocess.run([sys.executable, "-m", "cfr_atlas.cli", *argv, *extra],
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        return list(folder.rglob("*.kvb"))

    assert run("--prefix-cache-bytes", "1KiB") == []    # a block is larger than 1 KiB
    assert len(run()) >= 1                              # the default budget (8 GiB) keeps them
    assert cli.main([*argv, "--prefix-cache-bytes", "lots"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "prefix_cache_bytes" in err and "lots" in err
