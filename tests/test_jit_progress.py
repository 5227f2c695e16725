"""A cold numba cache is announced: a header line and one line per kernel compiled, on stderr;
a warm cache (or an already compiled kernel) prints nothing."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from numba import njit
from numba.core import event
from numba.core.caching import UserProvidedCacheLocator

import cfr_atlas
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


def _cache_dir_missing(tmp_path: Path, package: str, module: str) -> Path:
    """A NUMBA_CACHE_DIR holding the kernels the source tree's own caches hold (numba's in-tree
    `__pycache__` files, laid out as numba's user-provided locator looks for them), except
    those of `package/module.py`: a cache that is cold for that module only."""
    root = Path(cfr_atlas.__file__).parent
    target = tmp_path / "numba"
    for cache in root.rglob("__pycache__"):
        src_dir = cache.parent
        sub = UserProvidedCacheLocator.get_suitable_cache_subpath(str(src_dir / "any.py"))
        for f in [*cache.glob("*.nbi"), *cache.glob("*.nbc")]:
            if not (src_dir.name == package and f.name.startswith(module + ".")):
                (target / sub).mkdir(parents=True, exist_ok=True)
                shutil.copy2(f, target / sub / f.name)
    return target


@pytest.mark.slow
def test_cli_announces_a_cold_cache(tiny_llama, tmp_path):
    """A cache without some kernel makes the CLI say so on stderr, a line per kernel compiled;
    with that kernel cached, it says nothing. (The cache is the source tree's, warmed by the
    first run, minus the activation kernels: compiling every kernel of the generate path took
    ~50 s of the suite's 2 cores, and one announced kernel tests the same wiring.)"""
    cmd = [sys.executable, "-m", "cfr_atlas.cli", "generate", "Hi", "--model", str(tiny_llama),
           "--max-tokens", "1", "--cache-dir", str(tmp_path)]
    in_tree = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    subprocess.run(cmd, capture_output=True, text=True, env=in_tree, timeout=1800, check=True)
    env = {**in_tree, "NUMBA_CACHE_DIR": str(_cache_dir_missing(tmp_path, "ops", "activations"))}
    cold = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    assert cold.returncode == 0, cold.stderr
    assert HEADER in cold.stderr
    lines = [ln for ln in cold.stderr.splitlines() if ln.startswith("  [")]
    assert lines and all("activations." in ln for ln in lines), cold.stderr
    warm = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    assert warm.returncode == 0 and HEADER not in warm.stderr, warm.stderr
