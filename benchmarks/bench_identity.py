"""Cost of the model identity (SHA-256 of the whole GGUF): cold, page-cache warm, memoized.

    python benchmarks/bench_identity.py [--model PATH] [--repeats 3] [--no-evict]

Prints one table. "page cache evicted" asks the kernel to drop this file's cached pages first
(posix_fadvise DONTNEED: only this file, nothing else), so the hash reads from disk;
"warm" hashes a file already in the page cache; "memo file" is a new process's first call
(the in-process memo cleared, the persistent memo read); "in-process" a repeated call. The
memo is a temporary file, so the user's cache is untouched. Also compares hashlib algorithms
over the same memory map. Timings are medians.
"""

from __future__ import annotations

import argparse
import hashlib
import mmap
import os
import statistics
import tempfile
import time
from pathlib import Path


def _evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _median_seconds(fn, repeats: int, before=None) -> float:
    times = []
    for _ in range(repeats):
        if before:
            before()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _algorithms(path: Path, repeats: int) -> list[tuple[str, float]]:
    rows = []
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        view = memoryview(m)
        for name in ("sha256", "blake2b", "sha512", "sha1"):
            def run(name=name):
                h = hashlib.new(name)
                for a in range(0, len(view), 16 << 20):
                    h.update(view[a:a + (16 << 20)])
            rows.append((name, _median_seconds(run, repeats)))
        view.release()
    return rows


def main() -> None:
    from cfr_atlas.models import file_identity
    from cfr_atlas.models.gguf_io import bundled_model_path

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-evict", action="store_true", help="skip the page-cache-evicted row")
    a = ap.parse_args()
    path = Path(a.model) if a.model else bundled_model_path()
    size = path.stat().st_size
    memo = Path(tempfile.mkdtemp()) / "identity.json"
    file_identity.memo_path = lambda: memo

    def fresh():
        file_identity.forget_in_process()
        memo.unlink(missing_ok=True)

    rows = []
    if not a.no_evict:
        rows.append(("cold: page cache evicted", _median_seconds(
            lambda: file_identity.file_digest(path), a.repeats,
            before=lambda: (fresh(), _evict(path)))))
    rows.append(("cold: page cache warm", _median_seconds(
        lambda: file_identity.file_digest(path), a.repeats, before=fresh)))
    file_identity.file_digest(path)
    rows.append(("memo file (new process)", _median_seconds(
        lambda: file_identity.file_digest(path), a.repeats,
        before=file_identity.forget_in_process)))
    rows.append(("in-process memo", _median_seconds(
        lambda: file_identity.file_digest(path), a.repeats)))
    print(f"{path.name}: {size / 1e6:.1f} MB, {a.repeats} repeats, medians")
    print(f"{'identity()':32s} {'seconds':>10s} {'MB/s':>10s}")
    for name, sec in rows:
        print(f"{name:32s} {sec:10.4f} {size / sec / 1e6:10.0f}")
    print(f"{'algorithm (warm, 16 MiB chunks)':32s} {'seconds':>10s} {'MB/s':>10s}")
    for name, sec in _algorithms(path, a.repeats):
        print(f"{name:32s} {sec:10.4f} {size / sec / 1e6:10.0f}")


if __name__ == "__main__":
    main()
