"""kernel_threads.release_pool frees the calling thread's OpenMP workers, and the next parallel
kernel builds them again with the same results. Run in a child process: its thread count is
then the kernels' alone."""

from __future__ import annotations

import json
import subprocess
import sys

_CHILD = r"""
import json
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
before = proc.num_threads()
freed = release_pool()
after = proc.num_threads()
twice(x, b)
print(json.dumps({"layer": numba.threading_layer(), "threads": numba.get_num_threads(),
                  "freed": freed, "before": before, "after": after,
                  "again": proc.num_threads(), "same": bool(np.array_equal(a, b))}))
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
    workers = r["threads"] - 1  # the calling thread is the team's master
    assert r["after"] == r["before"] - workers
    assert r["again"] == r["before"]


def test_release_pool_without_a_parallel_kernel_is_harmless():
    child = ("from cfr_atlas.kernel_threads import release_pool; "
             "import json; print(json.dumps([release_pool(), release_pool()]))")
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                         timeout=120, check=True)
    assert json.loads(out.stdout.strip()) in ([False, False], [True, True])


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
