"""Servers for the serve tests, each on its own free loopback port with a tiny model.

`server` is shared by the API tests (generous limits, its own page-file folder); `busy_server`
admits one sequence and queues one more, for the 429 and cancellation tests; `reference` is a
second, independent Model of the same file that the server's output is compared with.
"""

from __future__ import annotations

import pytest
from serve_support import start_server

from cfr_atlas.engine import load_model


@pytest.fixture(scope="session")
def reference(tiny_llama):
    return load_model(tiny_llama)


@pytest.fixture(scope="session")
def server(tiny_llama, tmp_path_factory):
    s = start_server(load_model(tiny_llama), tmp_path_factory.mktemp("pages"),
                     max_active=4, max_queue=32)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def busy_server(tiny_llama, tmp_path_factory):
    s = start_server(load_model(tiny_llama), tmp_path_factory.mktemp("busy_pages"),
                     max_active=1, max_queue=1, retry_after=2, max_body_bytes=4096)
    yield s
    s.stop()
