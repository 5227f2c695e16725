"""Fixtures for tests/atlas: run numba's parallel kernels on one thread by default.

On a shared 2-core machine a `prange` launch costs milliseconds when the other core is busy
(measured: 7 ms per tiny fold call with 2 threads, 0.07 ms with 1), which would make these tests
time-bound by scheduling. Results do not depend on the thread count; test_exactness.py checks
that with every thread numba has, and tests that want it ask for the `all_threads` fixture.
"""

from __future__ import annotations

import numba
import pytest


@pytest.fixture(autouse=True)
def one_numba_thread():
    numba.set_num_threads(1)
    yield
    numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)


@pytest.fixture
def all_threads(one_numba_thread):
    """Every thread numba has, for the tests that compare thread counts or go long."""
    numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    return numba.config.NUMBA_NUM_THREADS
