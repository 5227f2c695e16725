"""A cold numba cache is announced: a header line and one line per kernel compiled, on stderr;
a warm cache (or an already compiled kernel) prints nothing."""

from __future__ import annotations

import io
import os
import subprocess
import sys

import numpy as np
import pytest
from numba import njit
from numba.core import event

from cfr_atlas.jit_progress import HEADER, CompileReporter, report_compiles


def test_a_line_per_outermost_compile_and_none_when_compiled():
    @njit
    def inner(x):
        return x + 1

    @njit
    def outer(x):
        return inner(x) * 2

    out = io.StringIO()
    reporter = CompileReporter(out)
    with event.install_listener("numba:compile", reporter):
        assert outer(np.int64(3)) == 8
        assert outer(np.int64(4)) == 10  # compiled already: silent
    lines = out.getvalue().splitlines()
    assert lines[0] == HEADER and reporter.compiled == 1  # inner is part of outer's line
    assert lines[1].startswith("  [1] ") and "outer" in lines[1] and lines[1].endswith(" s")
    assert len(lines) == 2


def test_report_compiles_installs_once():
    assert report_compiles() is report_compiles()


@pytest.mark.slow
def test_cli_announces_a_cold_cache(tiny_llama, tmp_path):
    """A fresh NUMBA_CACHE_DIR makes every kernel compile: the CLI says so on stderr. (Slow:
    the generate path compiles its kernels from scratch, a minute or more.)"""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba")}
    proc = subprocess.run(
        [sys.executable, "-m", "cfr_atlas.cli", "generate", "Hi", "--model", str(tiny_llama),
         "--max-tokens", "1", "--cache-dir", str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=1800)
    assert proc.returncode == 0, proc.stderr
    assert HEADER in proc.stderr
    assert "  [1] " in proc.stderr and "quant." in proc.stderr
