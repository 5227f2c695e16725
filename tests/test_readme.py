"""The README is the front door: every Python block and every command it shows runs as written.

Each Python block runs in a fresh interpreter, in an empty folder, with HOME pointing at an
empty folder (no user cache, prefix cache or page files left by other tests). The command-line
block runs line by line the same way; `serve` is started, asked for its models over HTTP by both
APIs, and stopped. Of the quick start, `make run` runs here and `make test` is what CI runs
(`.ci/run`, checked by reading it). A README edit that breaks a block fails this file.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
COMMAND_SECONDS = 120  # each command is meant to take under a minute; CI's 2 cores are shared


def fenced_blocks(language: str) -> list[str]:
    """Bodies of the README's ```language fenced blocks, in order."""
    pattern = re.compile(rf"^```{language}\n(.*?)^```", re.MULTILINE | re.DOTALL)
    return pattern.findall(README.read_text(encoding="utf-8"))


def commands(block: str) -> list[str]:
    """Command lines of a bash block, trailing `# comments` and comment-only lines dropped."""
    lines = (line.split(" #")[0].strip() for line in block.splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def cli_commands() -> list[str]:
    return [c for block in fenced_blocks("bash") for c in commands(block) if "cfr-atlas" in c]


def make_commands() -> list[str]:
    return [c for block in fenced_blocks("bash") for c in commands(block)
            if c.startswith("make ")]


@pytest.fixture
def fresh(tmp_path) -> tuple[Path, dict]:
    """(an empty working folder, an environment whose HOME is another empty folder)."""
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("XDG_")}
    env["HOME"] = str(home)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return work, env


def test_the_readme_has_what_this_file_runs():
    assert len(fenced_blocks("python")) >= 2
    names = {shlex.split(c.split("|")[-1])[1] for c in cli_commands()}
    assert names == {"generate", "chat", "inspect", "validate", "serve", "fetch"}
    assert make_commands() == ["make run", "make test"]


@pytest.mark.parametrize("index", range(len(fenced_blocks("python"))))
def test_python_block_runs_as_written(index, fresh):
    work, env = fresh
    script = work / f"readme_block_{index}.py"
    script.write_text(fenced_blocks("python")[index], encoding="utf-8")
    done = subprocess.run([sys.executable, str(script)], cwd=work, env=env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.parametrize("line", [c for c in cli_commands() if " serve" not in c])
def test_command_runs_as_written(line, fresh):
    work, env = fresh
    done = subprocess.run(line, shell=True, cwd=work, env=env, capture_output=True, text=True,
                          timeout=COMMAND_SECONDS)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip(), "every command prints its result"
    if "--check-exact" in line:
        assert "yes: bitwise equal" in done.stderr


def _get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read())


def test_serve_command_answers_both_apis(fresh):
    work, env = fresh
    (line,) = [c for c in cli_commands() if " serve" in c]
    port = int(re.search(r"--port (\d+)", line).group(1))
    proc = subprocess.Popen(shlex.split(line), cwd=work, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + COMMAND_SECONDS
        while True:
            try:
                tags = _get_json(f"http://127.0.0.1:{port}/api/tags")
                break
            except OSError:
                assert proc.poll() is None, proc.communicate()[1][-3000:]
                assert time.monotonic() < deadline, "serve did not answer in time"
                time.sleep(0.5)
        assert tags["models"], tags
        assert _get_json(f"http://127.0.0.1:{port}/v1/models")["data"]
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise


def test_make_test_is_what_ci_runs():
    assert "make test" in (ROOT / ".ci" / "run").read_text(encoding="utf-8")


def test_make_run_runs_as_written(fresh):
    if not (ROOT / ".venv" / ".stamp-install").exists():
        pytest.skip("make run would create .venv first (run `make setup`); CI has it")
    _, env = fresh
    done = subprocess.run(["make", "--no-print-directory", "run"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "yes: bitwise equal" in done.stderr
