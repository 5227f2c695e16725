"""jit_cache.py: processes take turns at numba's kernel cache. A compile in another process
waits while this one holds the lock; a lock held too long is given up, not waited on forever."""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from cfr_atlas import jit_cache

fcntl = pytest.importorskip("fcntl")


def test_importing_the_package_installs_one_lock():
    import cfr_atlas  # noqa: F401

    lock = jit_cache.install()
    assert lock is jit_cache.install() is jit_cache._installed[0]
    assert lock.path == jit_cache.lock_path() and lock.path.parent.is_dir()


def test_a_lock_held_elsewhere_is_waited_for_then_given_up(tmp_path, capsys):
    path = tmp_path / "cache.lock"
    first, second = jit_cache.CacheLock(path), jit_cache.CacheLock(path, wait_s=0.3)
    first.on_start(None)
    first.on_start(None)  # nested (a callee's compile): still one flock
    assert first.acquired == 1
    t0 = time.monotonic()
    second.on_start(None)  # another open of the file: flock conflicts, as another process's
    assert time.monotonic() - t0 >= 0.3 and second.acquired == 0
    assert "compiling without it" in capsys.readouterr().err
    second.on_end(None)
    first.on_end(None)
    first.on_end(None)  # depth 0: released
    second.on_start(None)
    assert second.acquired == 1
    second.on_end(None)


def test_another_process_compiles_only_when_the_lock_is_free(tmp_path):
    """A child compiling a fresh cached kernel blocks while this process holds the lock file,
    and finishes once it is released."""
    (tmp_path / "tiny_kernel.py").write_text(textwrap.dedent("""
        from numba import njit

        @njit(cache=True)
        def plus_one(x):
            return x + 1
    """))
    child = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(tmp_path)!r})
        import cfr_atlas
        print("ready", flush=True)
        sys.stdin.readline()
        import tiny_kernel
        print("done", tiny_kernel.plus_one(41), flush=True)
    """)
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba"))
    proc = subprocess.Popen([sys.executable, "-c", child], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x.strip()) for x in proc.stdout],
                     daemon=True).start()
    try:
        assert lines.get(timeout=120) == "ready"
        fd = os.open(jit_cache.lock_path(), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            proc.stdin.write("go\n")
            proc.stdin.flush()
            with pytest.raises(queue.Empty):
                lines.get(timeout=4)  # a tiny compile takes well under a second here
        finally:
            os.close(fd)  # releases the lock
        assert lines.get(timeout=120) == "done 42"
    finally:
        proc.kill()
        proc.wait()
