"""kernel_threads.release_pool frees the calling thread's OpenMP workers, and the next parallel
kernel builds them again with the same results. Run in a child process: its thread count is
then the kernels' alone."""

from __future__ import annotations

import json
import subprocess
import sys

_CHILD = r"""
import json
import time
import numpy as np, numba, psutil
from numba import njit, prange
from cfr_atlas.kernel_threads import release_pool

@njit(parallel=True)
def twice(x, out):
    for i in prange(x.shape[0]):
        out[i] = 2.0 * x[i]

x = np.arange(100_000, dtype=np.float64)
a, b = np.empty_like(x), np.empty_like(x)
twice(x, a)
proc = psutil.Process()


def settled(want):
    # the thread count once it equals want, or after 2 s (an exiting thread may be counted
    # for a moment after it is joined)
    end = time.monotonic() + 2.0
    while proc.num_threads() != want and time.monotonic() < end:
        time.sleep(0.01)
    return proc.num_threads()


before = proc.num_threads()
workers = numba.get_num_threads() - 1  # the calling thread is its team's master
freed = release_pool()
after = settled(before - workers)
twice(x, b)
again = settled(before)
print(json.dumps({"layer": numba.threading_layer(), "workers": workers, "freed": freed,
                  "before": before, "after": after, "again": again,
                  "same": bool(np.array_equal(a, b))}))
"""


def test_release_pool_frees_the_workers_and_the_next_kernel_rebuilds_them():
    out = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True,
                         timeout=300, check=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["same"]
    if r["layer"] != "omp":
        assert not r["freed"] or r["before"] == r["after"]
        return
    assert r["freed"]
    assert r["after"] == r["before"] - r["workers"]
    assert r["again"] == r["before"]


def test_release_pool_never_loads_libgomp_itself():
    """Before any parallel kernel numba has not loaded libgomp: release_pool finds none
    (RTLD_NOLOAD) and answers False, twice, without loading it."""
    child = ("import json; from cfr_atlas.kernel_threads import release_pool; "
             "print(json.dumps([release_pool(), release_pool(), "
             "'libgomp' in open('/proc/self/maps').read()]))")
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                         timeout=120, check=True)
    assert json.loads(out.stdout.strip()) == [False, False, False]


def test_run_kernels_alone_sets_the_calling_thread_only():
    import threading

    import numba

    from cfr_atlas.kernel_threads import run_kernels_alone

    before, seen = numba.get_num_threads(), []

    def background():
        run_kernels_alone()
        seen.append(numba.get_num_threads())

    t = threading.Thread(target=background)
    t.start()
    t.join()
    assert seen == [1] and numba.get_num_threads() == before
