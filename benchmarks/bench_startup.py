"""Start-up of a fresh `cfr-atlas generate "Hi" --max-tokens 1` (kernels already cached).

    python benchmarks/bench_startup.py [--src DIR ...] [--runs 3] [--phases]

Runs the CLI's own entry (`python -m cfr_atlas.cli`, what the console script calls) in a new
process per run, with PYTHONPATH set to each `--src` folder (default: this checkout's src/),
the sources taking turns run by run so every folder sees the same minutes of the machine.
Each folder first gets one untimed run (`--warmups`), which compiles kernels a changed source
needs and writes the model's tile cache (models/tile_cache.py) if its code has none yet: the
timed runs measure a start with both in place, as the issue defines start-up.
Prints wall seconds and the child's CPU seconds (user + sys, all its threads) per run and
their medians, with the load average before and after. `--phases` also times the steps of
the generate path in one process per folder (the calls `cli._generate` makes, in order).
A cold numba cache compiles every kernel (minutes) in the warm-up, which is not start-up.
Python bytecode likewise: each folder is byte-compiled first (compileall, what `pip install`
does for an installed package). Without it, an editable checkout run with
PYTHONDONTWRITEBYTECODE=1 (this sandbox sets it) compiles every module from source on every
start, ~0.6 s more (measured in session 27: median 2.50 s against 1.87 s).
"""

from __future__ import annotations

import argparse
import compileall
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMAND = ["-m", "cfr_atlas.cli", "generate", "Hi", "--max-tokens", "1"]

# The generate path step by step (wall and process CPU seconds per step), printed as a table.
PHASES = r"""
import time
marks, t0, c0 = [], time.perf_counter(), time.process_time()
def mark(name):
    marks.append((name, time.perf_counter(), time.process_time()))
import cfr_atlas.cli
from cfr_atlas.jit_progress import report_compiles
report_compiles()
mark("import cfr_atlas.cli")
from cfr_atlas.engine import load_model
mark("import cfr_atlas.engine")
model = load_model()
mark("load_model (GGUF, weights, tokenizer)")
ids = model.chat_ids([{"role": "user", "content": "Hi"}])
text = model.generate(ids, max_tokens=1)
mark(f"first generate ({len(ids)}-token prefill, 1 token)")
text = model.generate(ids, max_tokens=1)
mark("the same generate again (warm)")
prev, cprev = t0, c0
for name, t, c in marks:
    print(f"  {name:44s} {t - prev:7.3f} {c - cprev:7.3f}")
    prev, cprev = t, c
"""


def _loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "n/a"


def _env(src: Path) -> dict:
    return {**os.environ, "PYTHONPATH": str(src)}


def run_once(src: Path) -> tuple[float, float]:
    """(wall seconds, child CPU seconds) of one CLI run with sources from `src`."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, *COMMAND], env=_env(src), check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", type=Path, action="append", help="a src/ folder (repeatable)")
    ap.add_argument("--runs", type=int, default=3, help="runs per folder (default 3)")
    ap.add_argument("--phases", action="store_true", help="also time the steps in-process")
    ap.add_argument("--warmups", type=int, default=1, help="untimed runs per folder first")
    a = ap.parse_args()
    srcs = [s.resolve() for s in a.src or [ROOT / "src"]]
    print(f"load average before: {_loadavg()}")
    results: dict[Path, list[tuple[float, float]]] = {s: [] for s in srcs}
    for src in srcs:
        compileall.compile_dir(src, quiet=1)  # as an install does: no source compile at start
    print("PYTHONDONTWRITEBYTECODE="
          f"{os.environ.get('PYTHONDONTWRITEBYTECODE', '')!r} (bytecode compiled beforehand)")
    for src in srcs * a.warmups:
        run_once(src)
    for _ in range(a.runs):
        for src in srcs:
            results[src].append(run_once(src))
    for src, runs in results.items():
        walls = ", ".join(f"{w:.2f}" for w, _ in runs)
        cpus = ", ".join(f"{c:.2f}" for _, c in runs)
        print(f"{src}\n  wall s: {walls}  median {statistics.median(w for w, _ in runs):.2f}"
              f"\n  cpu s:  {cpus}  median {statistics.median(c for _, c in runs):.2f}")
    if a.phases:
        for src in srcs:
            print(f"{src} (step, wall s, process CPU s)")
            subprocess.run([sys.executable, "-c", PHASES], env=_env(src), check=True)
    print(f"load average after: {_loadavg()}")


if __name__ == "__main__":
    main()
