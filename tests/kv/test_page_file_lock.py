"""Page files: created 0600 in a 0700 folder, and never deleted by another process's clean-up
while their sequence lives, whatever the pid in their name says (containers sharing a cache
folder each have their own pid namespace)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest

from cfr_atlas.atlas.storage import StorageDtype
from cfr_atlas.kv import SpillKv, clean_stale
from cfr_atlas.kv import file_lock as file_lock_module

HOLD_PAGE_FILE = """
import os, sys
from cfr_atlas.atlas.storage import StorageDtype
from cfr_atlas.kv import SpillKv
spill = SpillKv(sys.argv[1], 4, 8, StorageDtype.FLOAT32, "ab" * 32, n_layers=1, n_kv_heads=1,
                context_tokens=8)
print(spill.path, flush=True)
sys.stdin.readline()
os._exit(0)  # dies without closing: the file is left behind, its lock released by the kernel
"""


def _dead_pid() -> int:
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    return int(proc.stdout)


def test_page_file_0600_in_a_0700_folder_whatever_the_umask(tmp_path):
    old = os.umask(0)
    try:
        spill = SpillKv(tmp_path / "pages", 4, 8, StorageDtype.FLOAT32, "ab" * 32, n_layers=1,
                        n_kv_heads=1, context_tokens=8)
    finally:
        os.umask(old)
    assert stat.S_IMODE(spill.path.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE(spill.path.stat().st_mode) == 0o600
    spill.close()
    assert not spill.path.exists()


@pytest.mark.skipif(sys.platform == "win32", reason="flock")
def test_live_page_file_of_another_process_survives_clean_up(tmp_path):
    folder = tmp_path / "pages"
    proc = subprocess.Popen([sys.executable, "-c", HOLD_PAGE_FILE, str(folder)], text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        path = folder / os.path.basename(proc.stdout.readline().strip())
        assert path.exists()
        # as another container would see it: a pid that is not running here
        renamed = path.with_name(f"seq-{_dead_pid()}-{path.name.split('-', 2)[2]}")
        path.rename(renamed)
        assert clean_stale(folder) == 0 and renamed.exists()
        mine = SpillKv(folder, 4, 8, StorageDtype.FLOAT32, "cd" * 32, n_layers=1, n_kv_heads=1,
                       context_tokens=8)  # cleans up on open
        assert renamed.exists() and clean_stale(folder) == 0   # and spares our own live file
        assert mine.path.exists()
    finally:
        proc.communicate("exit\n", timeout=60)
    assert proc.returncode == 0 and renamed.exists()
    assert clean_stale(folder) == 1 and not renamed.exists()
    assert mine.path.exists()
    mine.close()


def test_without_flock_clean_up_falls_back_to_pid_exists(tmp_path, monkeypatch):
    monkeypatch.setattr(file_lock_module, "fcntl", None)
    asked = []
    real = file_lock_module.psutil.pid_exists
    monkeypatch.setattr(file_lock_module.psutil, "pid_exists",
                        lambda pid: asked.append(pid) or real(pid))
    folder = tmp_path / "pages"
    folder.mkdir()
    dead = folder / f"seq-{_dead_pid()}-00.kvp"
    alive = folder / f"seq-{os.getppid()}-01.kvp"
    mine = folder / f"seq-{os.getpid()}-02.kvp"
    for path in (dead, alive, mine):
        path.write_bytes(b"x")
    assert clean_stale(folder) == 1
    assert [p.exists() for p in (dead, alive, mine)] == [False, True, True]
    # psutil.pid_exists (safe on Windows, unlike os.kill(pid, 0)); our own pid is never asked
    assert sorted(asked) == sorted([int(dead.name.split("-")[1]), os.getppid()])
