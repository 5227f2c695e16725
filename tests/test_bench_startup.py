"""benchmarks/bench_startup.py stays runnable: one run of the CLI and the in-process steps."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_startup.py"


@pytest.mark.slow
def test_one_run_prints_wall_cpu_and_the_steps():
    out = subprocess.run([sys.executable, str(BENCH), "--runs", "1", "--phases"],
                         capture_output=True, text=True, timeout=600, check=True).stdout
    assert out.startswith("load average before:") and "load average after:" in out
    wall = next(line for line in out.splitlines() if "wall s:" in line)
    seconds = float(wall.split("median")[1])
    assert 0 < seconds < 600
    for step in ("import cfr_atlas.cli", "load_model (GGUF, weights, tokenizer)",
                 "first generate", "the same generate again (warm)"):
        assert step in out, step
