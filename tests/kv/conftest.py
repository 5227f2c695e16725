"""Fixtures for tests/kv: one numba thread (as in tests/atlas: the Atlas folds stay fast on a
busy 2-core machine; results do not depend on the thread count)."""

from __future__ import annotations

import numba
import pytest


@pytest.fixture(autouse=True)
def one_numba_thread():
    numba.set_num_threads(1)
    yield
    numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
