"""The kernels' worker threads: releasing the OpenMP pool a thread no longer uses.

numba's `omp` threading layer (GNU OpenMP, libgomp) gives every thread that starts a parallel
kernel its own team of workers, kept until that thread exits. While the process manages more
OpenMP threads than it has CPUs, libgomp's workers stop spinning between parallel regions (its
throttled spin count) and sleep at every barrier, so each of the ~120 parallel kernels of a
decode token pays a futex wake-up. Measured with the bundled model (int8, 2 CPUs, 128 greedy
tokens): 1.1-1.4 s from the thread that ran the first kernels or from a fresh thread, 3.6-3.7 s
from a second thread while the first one's pool lives (2.5 s with OMP_WAIT_POLICY=ACTIVE,
whose idle pool spins on a core).

A program whose model work moves to another thread calls `release_pool()` on the first one
once it is done there: the server loads and warms up the model on the main thread, then steps
it on its scheduler thread. A background thread that runs kernels beside the compute thread
(the expert prefetcher) calls `run_kernels_alone()` first: its kernels then run on itself, and
no second team of workers exists to throttle the compute thread's. `spare_core()` says whether
such a thread would have a core of its own (the expert prefetcher is on by default only then).

Nothing here changes a result (every parallel kernel's bits are independent of its thread
count): only which threads run the same kernels. This module holds no kernels.
"""

from __future__ import annotations

import ctypes
import os

import numba

# OpenMP 5.0's omp_pause_soft. GNU libgomp ignores the kind (either frees the calling thread's
# pool); LLVM's libomp, which some installs link as libgomp.so.1, shuts its whole runtime
# down on a hard pause, so the gentler kind is asked for.
_OMP_PAUSE_SOFT = 1


def release_pool() -> bool:
    """Free the calling thread's OpenMP worker pool (libgomp's `omp_pause_resource_all`).

    True when a loaded libgomp freed it. False when none is loaded (numba's `tbb` or
    `workqueue` layer and nothing else loaded one, or no parallel kernel has run yet), when
    it predates OpenMP 5.0 (GCC < 9: no such call) or when it refused (called inside a
    parallel region). Never loads libgomp itself. The next parallel kernel this thread runs
    builds a new pool."""
    try:
        gomp = ctypes.CDLL("libgomp.so.1", mode=os.RTLD_NOLOAD)
    except OSError:
        return False
    pause = getattr(gomp, "omp_pause_resource_all", None)
    if pause is None:
        return False
    pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
    return pause(_OMP_PAUSE_SOFT) == 0


def run_kernels_alone() -> None:
    """Run the calling thread's parallel kernels on itself alone (numba's thread count is
    per thread): for a background thread beside the compute thread, which keeps both cores."""
    numba.set_num_threads(1)


def spare_core() -> bool:
    """Whether this process may run on more CPUs than numba's kernels use (numba's thread
    count, NUMBA_NUM_THREADS): a background thread then has a core of its own."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return cpus > numba.get_num_threads()
