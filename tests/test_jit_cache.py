"""jit_cache.py: processes take turns at numba's kernel cache files. A save or load waits while
another holds the lock of that cache index, and goes on once it is released; a lock held too
long is given up, not waited on forever; kernels still compile, save and load."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from numba.core import caching

from cfr_atlas import jit_cache

fcntl = pytest.importorskip("fcntl")


def test_importing_the_package_wraps_save_and_load_once():
    import cfr_atlas  # noqa: F401

    assert jit_cache.install() and jit_cache.install()
    for name in ("save", "load"):
        method = getattr(caching.IndexDataCacheFile, name)
        assert method.cfr_atlas_locked
        assert not getattr(method.__wrapped__, "cfr_atlas_locked", False)  # wrapped once


def _hold(path):
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def test_a_save_waits_for_the_lock_of_its_index(tmp_path):
    cache = caching.IndexDataCacheFile(str(tmp_path), "kernel", ("stamp", 1))
    fd = _hold(cache._index_path + ".lock")  # another process's, as flock sees another open
    done = threading.Event()
    saver = threading.Thread(target=lambda: (cache.save("key", b"machine code"), done.set()))
    saver.start()
    try:
        assert not done.wait(1.0)  # blocked on the lock
    finally:
        os.close(fd)
    assert done.wait(30)
    saver.join()
    assert cache.load("key") == b"machine code"


def test_a_lock_held_too_long_is_given_up(tmp_path, capsys):
    path = str(tmp_path / "x.lock")
    fd = _hold(path)
    try:
        t0 = time.monotonic()
        assert jit_cache.lock_fd(path, wait_s=0.3) == -1
        assert time.monotonic() - t0 >= 0.3
        assert "using numba's cache without it" in capsys.readouterr().err
    finally:
        os.close(fd)
    got = jit_cache.lock_fd(path, wait_s=0.3)
    assert got >= 0
    os.close(got)


def test_two_processes_compiling_one_function_both_get_their_kernels(tmp_path):
    """Two processes compile different signatures of one cached function at once, then a
    third loads both from the cache: each signature gives its own result."""
    (tmp_path / "tiny_kernel.py").write_text(textwrap.dedent("""
        from numba import njit

        @njit(cache=True)
        def twice(x):
            return x + x
    """))
    child = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(tmp_path)!r})
        import cfr_atlas, tiny_kernel
        arg = {{"int": 21, "float": 21.5, "complex": 1j}}[sys.argv[1]]
        print(tiny_kernel.twice(arg), flush=True)
    """)
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba"))
    procs = [subprocess.Popen([sys.executable, "-c", child, kind], stdout=subprocess.PIPE,
                              text=True, env=env) for kind in ("int", "float", "complex")]
    outs = [p.communicate(timeout=300)[0].strip() for p in procs]
    assert outs == ["42", "43.0", "2j"]
    again = [subprocess.run([sys.executable, "-c", child, kind], capture_output=True, text=True,
                            env=env, timeout=300).stdout.strip()
             for kind in ("int", "float", "complex")]
    assert again == outs


def test_a_package_kernel_is_stamped_with_the_package_sources_and_others_are_not(tmp_path):
    import inspect

    from cfr_atlas.atlas import fold

    func = fold.balanced_runs.py_func
    ours = caching.InTreeCacheLocator.from_function(func, inspect.getfile(func))
    stamp = ours.get_source_stamp()
    assert isinstance(stamp, tuple) and stamp[1] == jit_cache.package_digest()
    (tmp_path / "elsewhere.py").write_text("def f(x):\n    return x\n")
    other = caching.UserWideCacheLocator(lambda x: x, str(tmp_path / "elsewhere.py"))
    assert isinstance(other.get_source_stamp(), bytes)  # numba's own stamp, untouched


def test_a_cached_kernel_is_compiled_again_when_any_package_source_changed(tmp_path):
    """A cached kernel whose own file did not change is loaded while the package's sources
    are the same, and compiled anew once they differ (here: a patched digest, as after an
    update that changed another module whose code the kernel carries)."""
    child = textwrap.dedent("""
        import sys
        import numpy as np
        from cfr_atlas import jit_cache
        from cfr_atlas.atlas import fold
        if sys.argv[1] == "changed":  # the stamp is taken when the cache is made: made again
            jit_cache.package_digest = lambda: "0123456789abcdef"
            fold.balanced_runs.enable_caching()
        fold.balanced_runs(np.ones(5, dtype=np.int64), 2)
        s = fold.balanced_runs.stats
        print(sum(s.cache_hits.values()), sum(s.cache_misses.values()), flush=True)
    """)
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba"))

    def run(kind):
        out = subprocess.run([sys.executable, "-c", child, kind], capture_output=True,
                             text=True, env=env, timeout=300)
        assert out.returncode == 0, out.stderr
        return out.stdout.split()

    assert run("same") == ["0", "1"]  # compiled, saved
    assert run("same") == ["1", "0"]  # loaded from the cache
    assert run("changed") == ["0", "1"]  # another package: compiled again
