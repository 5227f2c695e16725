"""Expert options at the load boundary: parse the expert budget, check host memory, build the
store.

`expert_options` turns the user's expert_budget ("256MiB", 1 << 28, "50%" of all experts,
None = all resident), policy and routing profile into the keyword arguments of an MoE family.
`check_host_memory` refuses a load whose resident weights plus expert pool exceed the memory
psutil reports available, naming the budget to lower, instead of swapping or being killed.
`direct_reads` decides how a bounded store reads uncached experts: through the page cache or
straight off the disk (experts/reader.py). Both measure memory with `available_memory`: psutil's
figure, or less inside a memory cgroup with a limit (a container).
Not here: the store itself (experts/), the models.
"""

from __future__ import annotations

from pathlib import Path

import psutil

from cfr_atlas.errors import ConfigError, HostMemoryError
from cfr_atlas.experts import POLICIES, ExpertStore
from cfr_atlas.models.moe import expert_source
from cfr_atlas.models.session import parse_bytes

# Upper bound of repacked bytes per stored byte (Q4 formats unpack nibbles to bytes: ~2x;
# Q8_0 and floats ~1x), so the estimate of the resident weights errs on the safe side.
REPACK_GROWTH = 2
EXPERT_READS = ("auto", "direct", "cached")
# direct reads stage at most this many layers' top-k experts at once: a step's loads, the next
# layer's predictions, and wrong predictions whose reads are still in flight
STAGED_LAYERS = 3


def parse_expert_budget(value) -> int | float | None:
    """None -> None (all resident); "50%" -> 0.5 (a share of all experts); sizes -> bytes."""
    if value is None:
        return None
    text = str(value).strip()
    if text.endswith("%"):
        try:
            share = float(text[:-1]) / 100
        except ValueError:
            share = -1.0
        if not 0 < share <= 1:
            raise ConfigError("expert_budget", f"{value!r} is not a share in (0%, 100%]")
        return share
    return parse_bytes(value, "expert_budget")


def check_expert_reads(reads: str) -> None:
    if reads not in EXPERT_READS:
        raise ConfigError("expert_reads", f"{reads!r} is not one of {list(EXPERT_READS)}")


def expert_options(gf, budget, policy: str, profile, reads: str = "auto") -> dict:
    """Keyword arguments for load_net: empty for a default load (nothing to pass on), so
    dense families never see them."""
    check_expert_reads(reads)
    if budget is None and policy == "lru" and profile is None and reads == "auto":
        return {}
    return {"expert_budget": parse_expert_budget(budget), "expert_policy": policy,
            "routing_profile": profile, "expert_reads": reads}


CGROUP_ROOT = Path("/sys/fs/cgroup")


def available_memory() -> int:
    """Bytes this process can still take: psutil's available memory, or less when a memory
    cgroup (v1 or v2) it is in, or any of that cgroup's parents, has a limit: the limit less
    the usage, the usage without the page cache the kernel can reclaim (file pages, shared
    memory aside), as psutil counts reclaimable cache as available. A container's limit is
    what the OOM killer enforces, and psutil reports the host's memory. A cgroup path from
    /proc/self/cgroup that is not under the mount (a container without its own cgroup
    namespace sees the host's path) is read at the mount's root, the container's cgroup."""
    left = int(psutil.virtual_memory().available)
    for limit, usage, stat in _cgroup_files():
        try:
            cap = int(limit.read_text().split()[0])
            used = int(usage.read_text().split()[0])
            fields = dict(line.split()[:2] for line in stat.read_text().splitlines()
                          if len(line.split()) >= 2)
        except (OSError, ValueError, IndexError):  # no such file, empty, or "max": no limit
            continue
        v1 = "total_cache" in fields
        cache = int(fields.get("total_cache" if v1 else "file", 0))
        shmem = int(fields.get("total_shmem" if v1 else "shmem", 0))
        left = min(left, max(cap - (used - max(cache - shmem, 0)), 0))
    return left


def _cgroup_files():
    """(limit, usage, stat) files of each memory cgroup this process is in, and of their
    parents, from /proc/self/cgroup."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":  # v2's unified hierarchy
            root, names = CGROUP_ROOT, ("memory.max", "memory.current", "memory.stat")
        elif "memory" in controllers.split(","):
            root = CGROUP_ROOT / "memory"
            names = ("memory.limit_in_bytes", "memory.usage_in_bytes", "memory.stat")
        else:
            continue
        d = root / path.strip("/")
        if not d.is_dir():  # the host's path seen from a container: the mount's root is ours
            d = root
        while True:
            yield tuple(d / n for n in names)
            if d == root:
                break
            d = d.parent


def _file_bytes(gf, experts: bool) -> int:
    """File bytes of the routed-expert tensors (experts) or of all the others."""
    return sum(int(t.n_bytes) for name, t in gf.tensors.items() if ("_exps." in name) == experts)


def resident_estimate(gf) -> int:
    """Bytes the non-expert weights take once repacked (an upper bound: REPACK_GROWTH x file)."""
    return REPACK_GROWTH * _file_bytes(gf, experts=False)


def check_host_memory(gf, pool_bytes: int, budget) -> None:
    """HostMemoryError when resident weights + the expert pool exceed available memory."""
    resident = resident_estimate(gf)
    available = available_memory()
    if resident + pool_bytes > available:
        raise HostMemoryError(
            f"{gf.path.name}: loading needs about {resident + pool_bytes:,} bytes (resident "
            f"weights ~{resident:,} + expert pool {pool_bytes:,}) but {available:,} bytes are "
            f"available; lower expert_budget (--expert-budget, now "
            f"{'all experts' if budget is None else budget}) or free memory")


def direct_reads(gf, store: ExpertStore, reads: str, later: int = 0) -> bool:
    """Whether `store` reads uncached experts off the disk, bypassing the page cache. "auto":
    when the pool is bounded and the experts' file bytes exceed the memory left once the pool
    is full (`available_memory` less the pool, and less `later`: bytes about to be allocated,
    the resident weights at load): then the page cache cannot keep them,
    each expert read through it would be evicted again unused, and the kernel's page-cache
    work is all cost. Otherwise the page cache is a second tier of experts at memory speed,
    and "auto" keeps it. `reads` is one of EXPERT_READS (build_store checks it)."""
    if reads != "auto":
        return reads == "direct"
    on_disk = _file_bytes(gf, experts=True)
    left = available_memory() - store.pool.nbytes - later
    return store.bounded and on_disk > left


def build_store(gf, cfg, matmul: str, budget, policy: str, profile: dict | None,
                reads: str = "auto", later: int = 0) -> ExpertStore | None:
    """The expert store of an MoE model (None for a dense one): every expert resident when
    `budget` is None, else a pool of at most `budget` bytes (or that share of all experts)
    evicting by `policy`, reading uncached experts as `reads` says (`direct_reads`; direct
    reads stage up to STAGED_LAYERS layers' top-k experts at once). Host memory is checked
    before the pool is allocated."""
    if not cfg.n_experts:
        if budget is not None:
            raise ConfigError("expert_budget", f"{gf.path.name} is a dense {cfg.arch} model; "
                              "it has no experts to budget")
        return None
    if policy not in POLICIES:
        raise ConfigError("expert_policy", f"{policy!r} is not one of {sorted(POLICIES)}")
    check_expert_reads(reads)
    source = expert_source(gf, cfg, matmul)
    store = ExpertStore(source, budget, POLICIES["lru"](),
                        before_alloc=lambda n: check_host_memory(gf, n, budget))
    if direct_reads(gf, store, reads, later):
        store.read_direct(STAGED_LAYERS * max(cfg.n_experts_used, 1))
    if policy == "pinned":  # pin all but one layer's top-k worth of slots
        store.policy = POLICIES[policy](profile or {}, max(store.n_slots - cfg.n_experts_used, 0))
    elif policy != "lru":
        store.policy = POLICIES[policy]()
    return store
