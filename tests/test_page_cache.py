"""benchmarks/page_cache.py: the reads the memory and MoE benchmarks compare against read the
bytes they say they read."""

from __future__ import annotations

import os


def test_reads_count_the_bytes_they_read(load_benchmark, tmp_path):
    pc = load_benchmark("page_cache")
    path = tmp_path / "f.bin"
    data = os.urandom(3 * (1 << 20) + 5)
    path.write_bytes(data)
    assert pc.sequential_read(path)["bytes"] == len(data)
    assert pc.sequential_read(path, 1 << 20)["bytes"] == 1 << 20
    assert pc.sequential_read(path, 10 * len(data), drop=False)["bytes"] == len(data)
    ranges = [(7, 4096), (1 << 20, 100), (len(data) - 9, 9)]
    got = pc.scattered_read(path, ranges)
    assert got["bytes"] == 4096 + 100 + 9 and got["gb_per_s"] > 0
    disk = pc.disk_read_bytes(path)
    assert disk is None or (isinstance(disk, int) and disk >= 0)
