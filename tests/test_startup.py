"""Start-up stays lean: the generate path imports no module it does not run (servers, plots,
other model families), and a family left out of the import is still found by its file."""

from __future__ import annotations

import subprocess
import sys

from cfr_atlas.models.families import config_of
from cfr_atlas.models.gguf_io import GGUFFile
from cfr_atlas.testing.tiny_deepseek2 import write_tiny_deepseek2
from cfr_atlas.testing.tiny_gemma3 import write_tiny_gemma3

# Imported by `cfr-atlas generate` on a Llama-family file: none of these may be.
NOT_ON_GENERATE_PATH = (
    "starlette", "uvicorn", "httpx", "redis", "matplotlib", "torch", "transformers",
    "llguidance", "cfr_atlas.serve", "cfr_atlas.text.grammar", "cfr_atlas.models.gemma3",
    "cfr_atlas.models.deepseek2",
)


def test_generate_path_imports_no_heavy_module():
    code = ("import sys, cfr_atlas.cli, cfr_atlas.engine, cfr_atlas.jit_progress; "
            "print('\\n'.join(sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120).stdout.split()
    assert "cfr_atlas.engine" in out  # the probe ran
    loaded = [m for m in out if m.split(".")[0] in NOT_ON_GENERATE_PATH
              or m in NOT_ON_GENERATE_PATH]
    assert loaded == []


def test_families_outside_the_import_are_found_by_architecture(tmp_path):
    gemma = GGUFFile(write_tiny_gemma3(tmp_path / "g.gguf", n_layers=2))
    deepseek = GGUFFile(write_tiny_deepseek2(tmp_path / "d.gguf"))
    assert type(config_of(gemma)).__name__ == "Gemma3Config"
    assert type(config_of(deepseek)).__name__ == "DeepSeek2Config"


def _cli_process(args: list[str], tmp_path) -> subprocess.CompletedProcess:
    """The CLI run as the console script runs it (main() without argv), with an atexit handler
    registered first, which a skipped teardown must still run."""
    code = ("import atexit, sys; from cfr_atlas import cli; "
            "atexit.register(lambda: print('atexit ran', file=sys.stderr)); "
            f"sys.argv = ['cfr-atlas', *{args!r}]; sys.exit(cli.main())")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)


def test_console_exit_runs_atexit_and_keeps_output_and_code(tiny_llama, tmp_path):
    ok = _cli_process(["inspect", str(tiny_llama)], tmp_path)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.startswith("file: ") and "K/V bytes per token" in ok.stdout.splitlines()[-1]
    assert ok.stderr.strip().endswith("atexit ran")
    bad = _cli_process(["inspect", str(tmp_path / "missing.gguf")], tmp_path)
    assert bad.returncode == 2 and "cfr-atlas: error:" in bad.stderr
    assert bad.stderr.strip().endswith("atexit ran")
