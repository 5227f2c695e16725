"""Time to first token with the persistent prefix cache: cold, warm in RAM, warm from disk.

    python benchmarks/bench_prefix.py [--tokens 2048] [--model PATH] [--repeats 3]

Cold: a fresh cache folder, so every token is computed. Warm (RAM): the same prompt again in
the same process. Warm (disk): a fresh process with the same cache folder (the RAM tier starts
empty, blocks come from disk). Every warm result is checked bitwise against the cold logits.
Prints times (medians), ratios to cold, disk bytes per token and hit counts.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def _ids(model, n):
    from cfr_atlas.validate import validation_text

    return model.tokenize(validation_text())[:n]


def worker(a) -> None:
    """One fresh process: time next_logits once with the given cache folder."""
    from cfr_atlas.engine import load_model

    model = load_model(a.model, prefix_cache=a.folder)
    ids = _ids(model, a.tokens)
    model.next_logits(ids[:16])  # warm-up (compile / cache load); a 16-token prompt maps nothing
    t0 = time.perf_counter()
    logits = model.next_logits(ids)
    dt = time.perf_counter() - t0
    np.save(a.out, logits)
    stats = model.prefix.disk.stats()
    model.prefix.close()
    print(json.dumps({"seconds": dt, "cached": model.last_telemetry["prompt_cached_tokens"],
                      "disk_hits": stats.hits, "disk_bytes": stats.bytes,
                      "disk_blocks": stats.blocks}))


def _fresh(a, folder, out) -> dict:
    cmd = [sys.executable, __file__, "--worker", "--folder", str(folder), "--out", str(out),
           "--tokens", str(a.tokens)] + (["--model", a.model] if a.model else [])
    res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if res.returncode:
        raise SystemExit(res.stderr[-2000:])
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2048, help="prompt length (default 2048)")
    ap.add_argument("--repeats", type=int, default=3, help="runs per row (median)")
    ap.add_argument("--model", default=None)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--folder", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return worker(a)
    from cfr_atlas.engine import load_model

    rows = {"cold": [], "warm (RAM)": [], "warm (disk, fresh process)": []}
    with tempfile.TemporaryDirectory() as tmp:
        base = load_model(a.model)
        ids = _ids(base, a.tokens)
        base.next_logits(ids[:16])
        t0 = time.perf_counter()
        ref = base.next_logits(ids)
        rows["cold"].append(time.perf_counter() - t0)
        for r in range(a.repeats):
            folder = Path(tmp) / f"prefix{r}"
            m = load_model(a.model, prefix_cache=folder)
            m.next_logits(ids[:16])
            t0 = time.perf_counter()
            cold = m.next_logits(ids)  # fills the cache
            rows["cold"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            warm = m.next_logits(ids)
            rows["warm (RAM)"].append(time.perf_counter() - t0)
            m.prefix.close()
            disk = _fresh(a, folder, Path(tmp) / "out.npy")
            rows["warm (disk, fresh process)"].append(disk["seconds"])
            for name, got in (("cold+insert", cold), ("RAM", warm),
                              ("disk", np.load(Path(tmp) / "out.npy"))):
                if not np.array_equal(got, ref):
                    raise SystemExit(f"{name} logits differ from the cold run: not exact")
    cold_s = statistics.median(rows["cold"])
    print(f"prompt {a.tokens} tokens, {disk['cached']} served from cache "
          f"({disk['disk_hits']} disk hits), logits bitwise equal to cold: yes")
    print(f"{'run':<28}{'TTFT s':>9}{'x faster':>10}")
    for name, ts in rows.items():
        med = statistics.median(ts)
        print(f"{name:<28}{med:>9.3f}{cold_s / med:>10.1f}")
    print(f"disk: {disk['disk_blocks']} blocks, {disk['disk_bytes']:,} bytes, "
          f"{disk['disk_bytes'] / max(disk['cached'], 1):,.0f} bytes per cached token")


if __name__ == "__main__":
    main()
