"""Expert options at the load boundary: parse the expert budget, check host memory, build the
store.

`expert_options` turns the user's expert_budget ("256MiB", 1 << 28, "50%" of all experts,
None = all resident), policy and routing profile into the keyword arguments of an MoE family.
`check_host_memory` refuses a load whose resident weights plus expert pool exceed the memory
psutil reports available, naming the budget to lower, instead of swapping or being killed.
Not here: the store itself (experts/), the models.
"""

from __future__ import annotations

import psutil

from cfr_atlas.errors import ConfigError, HostMemoryError
from cfr_atlas.experts import POLICIES, ExpertStore
from cfr_atlas.models.moe import expert_source
from cfr_atlas.models.session import parse_bytes

# Upper bound of repacked bytes per stored byte (Q4 formats unpack nibbles to bytes: ~2x;
# Q8_0 and floats ~1x), so the estimate of the resident weights errs on the safe side.
REPACK_GROWTH = 2


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


def expert_options(gf, budget, policy: str, profile) -> dict:
    """Keyword arguments for load_net: empty for a default load (nothing to pass on), so
    dense families never see them."""
    if budget is None and policy == "lru" and profile is None:
        return {}
    return {"expert_budget": parse_expert_budget(budget), "expert_policy": policy,
            "routing_profile": profile}


def resident_estimate(gf) -> int:
    """Bytes the non-expert weights take once repacked (an upper bound: REPACK_GROWTH x file)."""
    return REPACK_GROWTH * sum(int(t.n_bytes) for name, t in gf.tensors.items()
                               if "_exps." not in name)


def check_host_memory(gf, pool_bytes: int, budget) -> None:
    """HostMemoryError when resident weights + the expert pool exceed available memory."""
    resident = resident_estimate(gf)
    available = int(psutil.virtual_memory().available)
    if resident + pool_bytes > available:
        raise HostMemoryError(
            f"{gf.path.name}: loading needs about {resident + pool_bytes:,} bytes (resident "
            f"weights ~{resident:,} + expert pool {pool_bytes:,}) but {available:,} bytes are "
            f"available; lower expert_budget (--expert-budget, now "
            f"{'all experts' if budget is None else budget}) or free memory")


def build_store(gf, cfg, matmul: str, budget, policy: str,
                profile: dict | None) -> ExpertStore | None:
    """The expert store of an MoE model (None for a dense one): every expert resident when
    `budget` is None, else a pool of at most `budget` bytes (or that share of all experts)
    evicting by `policy`. Host memory is checked before the pool is allocated."""
    if not cfg.n_experts:
        if budget is not None:
            raise ConfigError("expert_budget", f"{gf.path.name} is a dense {cfg.arch} model; "
                              "it has no experts to budget")
        return None
    if policy not in POLICIES:
        raise ConfigError("expert_policy", f"{policy!r} is not one of {sorted(POLICIES)}")
    source = expert_source(gf, cfg, matmul)
    store = ExpertStore(source, budget, POLICIES["lru"](),
                        before_alloc=lambda n: check_host_memory(gf, n, budget))
    if policy == "pinned":  # pin all but one layer's top-k worth of slots
        store.policy = POLICIES[policy](profile or {}, max(store.n_slots - cfg.n_experts_used, 0))
    elif policy != "lru":
        store.policy = POLICIES[policy]()
    return store
