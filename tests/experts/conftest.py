"""The model the expert-store tests share: one per test module (each module sets its own
expert budgets on it)."""

from __future__ import annotations

import pytest

from cfr_atlas.engine import load_model


@pytest.fixture(scope="module")
def model(moe_file):
    """qwen2moe, Q8_0 (shared expert too): 2 layers, 8 experts, top-2."""
    return load_model(moe_file("qwen2moe"))
