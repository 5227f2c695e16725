"""MoE decode and prefill speed against the expert budget, warm and cold page cache, with the
slot prefetcher off and on.

    PYTHONPATH=src python benchmarks/bench_moe.py [--layers 16 --experts 32 --dim 512
        --ff 1408 --top-k 4 --qtype Q4_0 --skew 1 --residual-scale 0.01] [--matmul int8]
        [--quick] [--json rows.json] [--plot moe.png]

Writes a qwen3moe GGUF of a realistic shape into a temporary folder (expert matrices drawn
directly as random Q4_0/Q8_0 blocks; attention, router and embedding from tiny_moe). How the
routing is made realistic (the table prints the measured skew per layer: the share of picks
taken by the most-chosen quarter of the experts; 0.25 is uniform):
  * `--skew` leans the routers (tiny_moe: every embedding row shares one direction v and router
    rows lean towards or away from it, so low expert ids win more tokens);
  * `--residual-scale` shrinks what each layer writes into the residual stream. In a plain
    random model (1.0) the hidden states of all positions converge with depth (random attention
    averages its values), so from the fourth layer on every token goes to the same few experts
    (shares 0.95-1.00 whatever the skew). At 0.01 each token keeps its own hidden state and
    `--skew 1` gives shares of ~0.4-0.6 over the 16 layers: concentrated, not collapsed.

Per budget (100% = every expert resident, 50%, 25%, min = one layer's top-k), a prompt is
prefilled and tokens decoded greedily; the decode's logits must equal the all-resident run's
bitwise (column "exact"). warm: the same run a second time (pool and page cache warm); cold: a
fresh pool and the file dropped from the page cache (madvise + posix_fadvise DONTNEED). Each
(budget, cache) runs with the prefetcher off, then on, back to back in this process (an
interleaved A/B: compare those two rows, not across runs). Bytes read per decoded token are the
store's counter over the decode steps; "load MB/s" is the bytes read over the seconds spent
writing experts into slots (read + repack, both threads: the bench's clock around
`ExpertStore.write`), "vs seq" that over a plain sequential read of the same file in the same
run; "wait s" the part of it the compute thread spent (what the prefetcher is meant to hide).
The load average (1 min) is printed beside each row: the machine is shared.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from cfr_atlas.engine import load_model  # noqa: E402
from cfr_atlas.generate import prefill  # noqa: E402
from cfr_atlas.testing.tiny_moe import write_tiny_moe  # noqa: E402
from moe_pressure import pressure_rows, pressure_table  # noqa: E402
from moe_pressure import read_cost_share as _reads_share  # noqa: E402
from page_cache import (  # noqa: E402
    disk_read_bytes,
    drop_file_cache,
    resident_fraction,
    scattered_read,
    sequential_read,
)

TEXT = ("The capital of France is Paris, and the capital of Italy is Rome. Once upon a time a "
        "small model routed every token to a few of its experts, and the experts answered. ")


def _args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--ff", type=int, default=1408)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--qtype", default="Q4_0", choices=["Q4_0", "Q8_0"])
    p.add_argument("--skew", type=float, default=1.0,
                   help="router lean towards low expert ids (tiny_moe; default 1)")
    p.add_argument("--residual-scale", type=float, default=0.01,
                   help="scale of the matrices writing into the residual stream (tiny_moe): "
                        "small keeps each token's hidden state its own through the layers, so "
                        "routing stays diverse with depth (default 0.01; 1 = the plain random "
                        "model, whose deep layers send every token to the same experts)")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--decode-tokens", type=int, default=8)
    p.add_argument("--budgets", default="100%,50%,25%,min")
    p.add_argument("--policy", default="lru", choices=["lru", "frequency", "pinned"],
                   help="eviction policy; pinned: the most-routed experts of a profile measured "
                        "on other text (--profile-tokens of the validation text, all resident)")
    p.add_argument("--profile-tokens", type=int, default=256)
    p.add_argument("--matmul", default="float", choices=["float", "int8"],
                   help="the matmul arithmetic (load_model's matmul): int8 slots keep Q4_0's "
                        "nibbles packed, so an expert load is a copy")
    p.add_argument("--ab-rounds", type=int, default=5,
                   help="rounds of the warm A/B (default 5; 0 skips it): one model per "
                        "--ab-budgets entry and one all resident, each decoding in turn, "
                        "alternating the order, so every ratio compares the same minutes")
    p.add_argument("--ab-budgets", default="50%",
                   help="budgets the warm A/B compares with all resident (default 50%%)")
    p.add_argument("--cold-budgets", default="min",
                   help="budgets of the cold decode table (default min: one layer's top-k, "
                        "where a token's time is its reads; empty skips it): each decoded token "
                        "after the model file is dropped from the page cache, paired with a "
                        "sequential read and a scattered read of the same bytes")
    p.add_argument("--cold-reads", default="cached,direct",
                   help="how the cold decode table's stores read uncached experts (load_model's "
                   "expert_reads), each a row per budget, in turn: cached (the page cache: "
                   "read-ahead advice, then the mapped file) and direct (reader threads, "
                   "O_DIRECT into staging buffers)")
    p.add_argument("--pressure-budgets", default="min,25%",
                   help="budgets of the memory-pressure table (empty skips it): decoding in a "
                   "memory cgroup too small for the file, the two ways of reading alternating "
                   "(moe_pressure.py; needs root, else the table says skipped)")
    p.add_argument("--pressure-room", default=256, type=int, metavar="MIB",
                   help="the cgroup's limit: MiB for all the decode allocates after entering "
                   "it, page cache included (default 256)")
    p.add_argument("--pressure-blocks", default=4, type=int,
                   help="blocks per way of reading (default 4)")
    p.add_argument("--load-path", action="store_true",
                   help="only the expert-load table (codec vs one-pass repack, cold and warm)")
    p.add_argument("--quick", action="store_true", help="a tiny model, a few tokens (tests)")
    p.add_argument("--dir", default=None, help="folder for the model file (default: a temp one)")
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None)
    a = p.parse_args(argv)
    if a.quick:
        a.layers, a.experts, a.dim, a.ff, a.top_k = 2, 8, 64, 128, 2
        a.prompt_tokens, a.decode_tokens, a.ab_rounds = 12, 4, min(a.ab_rounds, 2)
        a.pressure_blocks = min(a.pressure_blocks, 1)
    return a


def _write(a, folder: Path) -> Path:
    return write_tiny_moe(folder / f"bench-moe-{a.qtype}.gguf", arch="qwen3moe", qtype=a.qtype,
                          n_layers=a.layers, dim=a.dim, n_heads=max(a.dim // 64, 2),
                          n_kv_heads=max(a.dim // 128, 1), head_dim=min(64, a.dim // 2), ff=a.ff,
                          n_experts=a.experts, n_used=a.top_k, skew=a.skew,
                          random_expert_blocks=True, residual_scale=a.residual_scale)


def _drop_cache(model, path: Path) -> float | None:
    """Unmap-advise our own mapping and drop the file's cached pages; -> resident fraction."""
    data = model.net._gf.reader.data
    mm = getattr(data, "_mmap", None)
    if isinstance(mm, mmap.mmap):
        mm.madvise(mmap.MADV_DONTNEED)
    drop_file_cache(path)
    return resident_fraction(path)


class _LoadTimer:
    """Wraps the store's `write` (one expert into a slot, from the mapped file): seconds spent,
    all threads and the calling (compute) thread's share; the store keeps no timing."""

    def __init__(self, store):
        self.seconds = self.wait = 0.0
        self.lock, write, main = threading.Lock(), store.write, threading.get_ident()

        def timed(key, slot):
            t0 = time.perf_counter()
            try:
                return write(key, slot)
            finally:
                dt = time.perf_counter() - t0
                with self.lock:
                    self.seconds += dt
                    self.wait += dt if threading.get_ident() == main else 0.0

        store.write = timed

    def reset(self):
        self.seconds = self.wait = 0.0


def _run(model, ids, n_decode: int) -> dict:
    """Prefill ids, decode greedily; seconds, expert bytes read, decode logits digest."""
    net, store = model.net, model.net.experts
    t = store.telemetry
    s = model.session(context_limit=len(ids) + n_decode)
    try:
        t0 = time.perf_counter()
        logits = prefill(net, s, np.asarray(ids, dtype=np.int64))[0]
        t1, read0 = time.perf_counter(), t.bytes_read
        rows, token_ms = [logits], []
        for _ in range(n_decode):
            tok = np.array([int(np.argmax(rows[-1]))], dtype=np.int64)
            t_tok = time.perf_counter()
            rows.append(net.forward_chunk(s, tok, all_logits=False)[0])
            token_ms.append((time.perf_counter() - t_tok) * 1e3)
        t2 = time.perf_counter()
    finally:
        s.close()
    return {"prefill_tok_s": len(ids) / (t1 - t0), "decode_tok_s": n_decode / (t2 - t1),
            "decode_bytes_read_per_token": (t.bytes_read - read0) / n_decode,
            "token_ms": token_ms, "digest": np.stack(rows).tobytes()}


def _resident_ms(model, ids, n_decode: int) -> float:
    """The median decode token of the same prompt with every expert resident (page cache
    warm): the compute a cold token does too, so a cold token's time less this is what its
    reads cost it."""
    model.net.set_experts(None)
    _run(model, ids, 1)  # the pool's and the caches' first touch
    return float(np.median(_run(model, ids, n_decode)["token_ms"]))


def _cold_tokens(model, path: Path, ids, a, spec: str, base: bytes, reads: str) -> dict:
    """Cold decode, token by token, at budget `spec` (prefetcher off, as by default here).
    The prompt is prefilled with the whole file in the page cache; then before each of
    --decode-tokens decoded tokens the file is dropped from the page cache (and from our
    mapping), as when the kernel reclaims a running model's pages. Over each token the disk's
    own count of bytes read is taken (read amplification: read-ahead beyond the expert
    ranges). Each token is followed by two reads of the same bytes, each from a dropped cache:
    a plain sequential read of as many bytes of the file (what "the disk's sequential
    bandwidth" is here), and the token's own expert ranges, every range asked of the kernel at
    once and nothing computed (what this disk gives scattered reads of those sizes). The
    token's read rate is the store's bytes read over the token's wall time, its compute
    included. Medians over the tokens that read something, of each rate and of the two
    per-token ratios; the logits of every token must equal the all-resident run's. Beside it,
    what the reads cost: the median bytes over the time they added to the median token, that
    is the median token less the median token of the same decode with every expert resident
    (`_resident_ms`, measured right after; `_reads_share`). The first is what a token gets
    (the target's measure), the second how much slower than all-resident a byte read makes
    it; at the smallest budget a token is nearly all reads and the two are close, at larger
    ones the compute of the experts that hit weighs on the first. `reads`: the store's
    expert_reads (cached or direct)."""
    name, budget = _budget(spec, model)
    store = model.net.set_experts(budget, a.policy, reads=reads)
    store.use_prefetch(False)
    keys, write = [], store.write
    store.write = lambda key, slot: keys.append(key) or write(key, slot)
    t = store.telemetry
    s = model.session(context_limit=len(ids) + a.decode_tokens)
    per = []
    sequential_read(path, drop=False)  # a warm start: the prompt runs on a cached file
    try:
        rows = [prefill(model.net, s, np.asarray(ids, dtype=np.int64))[0]]
        for _ in range(a.decode_tokens):
            keys.clear()
            read0 = t.bytes_read
            _drop_cache(model, path)
            tok = np.array([int(np.argmax(rows[-1]))], dtype=np.int64)
            disk0, t0 = disk_read_bytes(path), time.perf_counter()
            rows.append(model.net.forward_chunk(s, tok, all_logits=False)[0])
            seconds, disk1 = time.perf_counter() - t0, disk_read_bytes(path)
            got = t.bytes_read - read0
            _drop_cache(model, path)  # our mapping's pages too, or they stay cached
            if not got:  # every expert of the token was resident: nothing read to pair
                continue
            seq = sequential_read(path, got)
            _drop_cache(model, path)
            ranges = [m.byte_range(e) for lay, e in keys for m in store.source.layers[lay]]
            scat = scattered_read(path, ranges)
            per.append({"bytes": got, "seconds": seconds, "read": got / seconds / 1e9,
                        "disk": None if disk0 is None else disk1 - disk0,
                        "seq": seq["gb_per_s"], "scattered": scat["gb_per_s"]})
    finally:
        s.close()
        del store.write  # the class's method again
    exact = np.stack(rows).tobytes() == base
    direct = store.source.reader is not None and store.source.reader.direct
    resident = _resident_ms(model, ids, a.decode_tokens)
    reads = {"reads": reads + (" (O_DIRECT)" if direct else "")}
    if not per:
        return {"budget": name, **reads, "tokens": 0, "exact": exact,
                "loadavg": os.getloadavg()[0]}
    med = {k: float(np.median([p[k] for p in per])) for k in ("read", "seq", "scattered")}
    read_mb = float(np.median([p["bytes"] for p in per])) / 1e6
    token_ms = float(np.median([p["seconds"] for p in per])) * 1e3
    vs_seq = [p["read"] / p["seq"] for p in per]
    vs_scat = [p["read"] / p["scattered"] for p in per]
    disk = [p["disk"] for p in per if p["disk"] is not None]
    return {"budget": name, **reads, "tokens": len(per), "read_mb": read_mb,
            "disk_mb": float(np.median(disk)) / 1e6 if disk else None,
            "token_ms": token_ms, **med, "resident_ms": resident,
            "cost_vs_seq": _reads_share(read_mb, token_ms, resident, med["seq"]),
            "vs_seq": float(np.median(vs_seq)), "vs_seq_range": (min(vs_seq), max(vs_seq)),
            "vs_scattered": float(np.median(vs_scat)),
            "vs_scattered_range": (min(vs_scat), max(vs_scat)),
            "loadavg": os.getloadavg()[0], "exact": exact}


def _pressure(model, path: Path, ids, a, spec: str) -> list[dict]:
    """The memory-pressure rows of budget `spec` (moe_pressure.py)."""
    def reference(n):
        model.net.set_experts(None)
        r = _run(model, ids, n)
        return r["digest"], float(np.median(r["token_ms"]))

    def make_store():
        store = model.net.set_experts(_budget(spec, model)[1], a.policy, reads="cached")
        store.use_prefetch(False)
        return store

    block = max(a.decode_tokens // 2, 4)
    return pressure_rows(model, path, ids, make_store, a.pressure_room << 20, a.pressure_blocks,
                         block, reference, lambda: _drop_cache(model, path))


def _cold_table(rows) -> str:
    out = ["| budget | reads | tokens | read/token MB | disk read/token MB | token ms | "
           "all-resident token ms | read GB/s | sequential GB/s | scattered GB/s | "
           "read / sequential (range) | read cost rate / sequential | "
           "read / scattered (range) | load | exact |", "|---" * 15 + "|"]
    for r in rows:
        if not r["tokens"]:
            out.append(f"| {r['budget']} | {r['reads']} | 0 (every token's experts resident: "
                       "nothing read) |" + " - |" * 10
                       + f" {r['loadavg']:.1f} | {'yes' if r['exact'] else 'NO'} |")
            continue
        disk = "-" if r["disk_mb"] is None else f"{r['disk_mb']:.1f}"
        out.append(f"| {r['budget']} | {r['reads']} | {r['tokens']} | {r['read_mb']:.1f} | "
                   f"{disk} | {r['token_ms']:.1f} | {r['resident_ms']:.1f}"
                   f" | {r['read']:.2f} | {r['seq']:.2f} | {r['scattered']:.2f} | "
                   f"{r['vs_seq']:.2f} ({r['vs_seq_range'][0]:.2f}-{r['vs_seq_range'][1]:.2f})"
                   f" | {r['cost_vs_seq']:.2f}"
                   f" | {r['vs_scattered']:.2f} ({r['vs_scattered_range'][0]:.2f}-"
                   f"{r['vs_scattered_range'][1]:.2f}) | {r['loadavg']:.1f} | "
                   f"{'yes' if r['exact'] else 'NO'} |")
    return "\n".join(out)


def _budget(spec: str, model) -> tuple[str, object]:
    store = model.net.experts
    if spec == "min":
        return f"min ({model.config.n_experts_used} slots)", \
            model.config.n_experts_used * store.slot_bytes
    return spec, (None if spec == "100%" else spec)


def _profile(model, n_tokens: int) -> dict:
    """{(layer, expert): times chosen} over the first n_tokens of the validation text (CPython
    prose, not the benchmark's prompt), every expert resident: the routing profile a user would
    record on their own text before pinning."""
    from cfr_atlas.validate import validation_text

    model.net.set_experts(None)
    model.logits(model.tokenize(validation_text())[:n_tokens])
    counts = model.net.experts.telemetry.routing
    return {(layer, e): int(n) for (layer, e), n in np.ndenumerate(counts) if n}


def _row(model, path, ids, a, name, budget, cache: str, prefetch: bool, base: bytes,
         profile: dict | None) -> dict:
    store = model.net.set_experts(budget, a.policy, profile)
    store.use_prefetch(prefetch)
    timer = _LoadTimer(store)
    resident = None
    if cache == "warm":
        _run(model, ids, a.decode_tokens)
    else:
        resident = _drop_cache(model, path)
    timer.reset()
    t = store.telemetry
    before = {k: getattr(t, k) for k in ("bytes_read", "prefetched", "prefetch_hits", "misses")}
    r = _run(model, ids, a.decode_tokens)
    d = {k: getattr(t, k) - v for k, v in before.items()}
    return {"budget": name, "cache": cache, "prefetch": prefetch, "pool_bytes": store.pool.nbytes,
            "prefill_tok_s": r["prefill_tok_s"], "decode_tok_s": r["decode_tok_s"],
            "decode_read_per_token": r["decode_bytes_read_per_token"],
            "bytes_read": d["bytes_read"],
            "load_mb_s": d["bytes_read"] / timer.seconds / 1e6 if timer.seconds else None,
            "wait_s": timer.wait, "load_s": timer.seconds, "misses": d["misses"],
            "prefetched": d["prefetched"], "prefetch_hits": d["prefetch_hits"],
            "loadavg": os.getloadavg()[0], "resident_before": resident,
            "exact": r["digest"] == base}


def _warm_ab(a, path: Path, ids, base: bytes) -> list[dict]:
    """The warm decode ratio, measured as an interleaved A/B: one model per budget (100% and
    each of --ab-budgets, the same file), each run once to warm its pool and the page cache,
    then --ab-rounds rounds in which each model prefills and decodes in turn (the order
    reversed every other round). Per budget: the median decode tokens/s, and the median and
    range of its per-round ratio to the 100% model of the same round."""
    specs = ["100%", *[b for b in a.ab_budgets.split(",") if b != "100%"]]
    models = []
    for spec in specs:
        m = load_model(path, matmul=a.matmul)
        name, budget = _budget(spec, m)
        store = m.net.set_experts(budget, a.policy)
        store.use_prefetch(False)
        _run(m, ids, a.decode_tokens)
        models.append((name, m))
    speed = {name: [] for name, _ in models}
    read = {name: [] for name, _ in models}
    exact = {name: True for name, _ in models}
    for rnd in range(a.ab_rounds):
        for name, m in (models if rnd % 2 == 0 else models[::-1]):
            r = _run(m, ids, a.decode_tokens)
            speed[name].append(r["decode_tok_s"])
            read[name].append(r["decode_bytes_read_per_token"])
            exact[name] = exact[name] and r["digest"] == base
    full = speed[models[0][0]]
    rows = []
    for name, _ in models:
        ratios = [x / f for x, f in zip(speed[name], full, strict=True)]
        rows.append({"budget": name, "decode_tok_s": float(np.median(speed[name])),
                     "ratio": float(np.median(ratios)), "ratio_min": min(ratios),
                     "ratio_max": max(ratios), "read_per_token": float(np.median(read[name])),
                     "rounds": a.ab_rounds, "exact": exact[name],
                     "loadavg": os.getloadavg()[0]})
    return rows


def _ab_table(rows) -> str:
    out = ["| budget | decode tok/s (median) | vs 100% (median of rounds) | rounds' range | "
           "read/token MB | load | exact |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['budget']} | {r['decode_tok_s']:.1f} | {r['ratio']:.2f}x | "
                   f"{r['ratio_min']:.2f}-{r['ratio_max']:.2f} | {r['read_per_token'] / 1e6:.2f}"
                   f" | {r['loadavg']:.1f} | {'yes' if r['exact'] else 'NO'} |")
    return "\n".join(out)


def _table(rows, seq, skew) -> str:
    out = [f"sequential read of the file: {seq['gb_per_s'] * 1e3:.0f} MB/s (mean of a read before"
           f" and after the rows: {seq['runs']}; page cache dropped first); routing skew (top "
           f"quarter's share of picks) per layer: {', '.join(f'{s:.2f}' for s in skew)}", "",
           "| budget | cache | prefetch | pool MiB | prefill tok/s | decode tok/s | vs 100% | "
           "read/token MB | load MB/s | vs seq | wait s | prefetched (hits) | load | exact |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    full = next(r["decode_tok_s"] for r in rows if r["budget"] == "100%" and r["cache"] == "warm")
    seq_mb = seq["gb_per_s"] * 1e3
    for r in rows:
        load = "-" if r["load_mb_s"] is None else f"{r['load_mb_s']:.0f}"
        ratio = "-" if r["load_mb_s"] is None else f"{r['load_mb_s'] / seq_mb:.2f}"
        out.append(f"| {r['budget']} | {r['cache']} | {'on' if r['prefetch'] else 'off'} | "
                   f"{r['pool_bytes'] / 2**20:.1f} | {r['prefill_tok_s']:.1f} | "
                   f"{r['decode_tok_s']:.1f} | {r['decode_tok_s'] / full:.2f}x | "
                   f"{r['decode_read_per_token'] / 1e6:.2f} | {load} | {ratio} | "
                   f"{r['wait_s']:.2f} | {r['prefetched']} ({r['prefetch_hits']}) | "
                   f"{r['loadavg']:.1f} | {'yes' if r['exact'] else 'NO'} |")
    return "\n".join(out)


def _load_path(model, path, a, reps: int = 2, per_layer: int = 8) -> list[dict]:
    """Expert loads alone (no compute), through the store's own step path (plan, the kernel
    asked for the step's ranges, then one write per expert): per layer one step of
    `per_layer` experts drawn at random (the same draw for every row of a rep), into a fresh
    25% pool; the codec's NumPy repack against the one-pass kernel, cold and warm page cache,
    interleaved with sequential reads of the same file. Wall and CPU seconds of the steps."""
    rows = []
    for rep in range(reps):
        seq = sequential_read(path)
        rows.append({"path": "sequential read", "cache": "cold", "mb": seq["bytes"] / 1e6,
                     "wall": seq["seconds"], "cpu": None, "loadavg": os.getloadavg()[0]})
        rng = np.random.default_rng(rep)
        steps = None
        for one_pass in (False, True):
            for cache in ("cold", "warm"):
                store = model.net.set_experts("25%")
                store.use_prefetch(False)
                if steps is None:
                    steps = [(lay, rng.choice(store.n_experts, min(per_layer, store.n_experts),
                                              replace=False)) for lay in range(store.n_layers)]
                if not one_pass:
                    store.layouts = [lay._replace(one_pass=(False,) * len(lay.one_pass))
                                     for lay in store.layouts]
                if cache == "cold":
                    _drop_cache(model, path)
                else:  # the same bytes once, to warm the page cache
                    for lay, experts in steps:
                        for e in experts:
                            for m in store.source.layers[lay]:
                                np.add.reduce(m.block_bytes(int(e))[::4096])
                t0, c0 = time.perf_counter(), time.thread_time()
                for lay, experts in steps:
                    for _ in store.experts(lay, experts):
                        pass
                wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
                rows.append({"path": "one-pass" if one_pass else "codec (NumPy)", "cache": cache,
                             "mb": store.telemetry.bytes_read / 1e6, "wall": wall, "cpu": cpu,
                             "loadavg": os.getloadavg()[0], "rep": rep})
    model.net.set_experts(None)
    return rows


def _load_table(rows) -> str:
    out = ["| repack | cache | MB | wall s | MB/s | vs seq | CPU s | MB per CPU s | load |",
           "|---|---|---|---|---|---|---|---|---|"]
    seq = None
    for r in rows:
        rate = r["mb"] / r["wall"]
        if r["path"] == "sequential read":
            seq = rate
        cpu = "-" if r["cpu"] is None else f"{r['cpu']:.2f}"
        per_cpu = "-" if not r["cpu"] else f"{r['mb'] / r['cpu']:.0f}"
        out.append(f"| {r['path']} | {r['cache']} | {r['mb']:.0f} | {r['wall']:.2f} | "
                   f"{rate:.0f} | {rate / seq:.2f} | {cpu} | {per_cpu} | {r['loadavg']:.1f} |")
    return "\n".join(out)


def _plot(rows, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for cache in ("warm", "cold"):
        for on in (False, True):
            sel = [r for r in rows if r["cache"] == cache and r["prefetch"] == on]
            ax.plot([r["budget"] for r in sel], [r["decode_tok_s"] for r in sel],
                    "o-" if on else "s--", label=f"{cache}, prefetch {'on' if on else 'off'}")
    ax.set_xlabel("expert budget")
    ax.set_ylabel("decode tokens/s")
    ax.set_title("MoE decode vs expert budget (page cache warm / cold)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None) -> int:
    a = _args(argv)
    if a.dir is not None:
        if os.path.exists(a.dir) and not os.path.isdir(a.dir):
            raise SystemExit(f"bench_moe: --dir {a.dir} is a file, not a folder")
        os.makedirs(a.dir, exist_ok=True)  # the file's folder: made if it does not exist
    with tempfile.TemporaryDirectory(dir=a.dir) as tmp:
        path = _write(a, Path(tmp))
        first = {**sequential_read(path), "loadavg": os.getloadavg()[0]}
        model = load_model(path, matmul=a.matmul)
        ids = model.tokenize(TEXT * (1 + a.prompt_tokens // 20))[:a.prompt_tokens]
        if a.load_path:
            print(_load_table(_load_path(model, path, a)))
            return 0
        base = _run(model, ids, a.decode_tokens)["digest"]
        skew = [r["skew"] for r in model.experts.telemetry.routing_report()]
        profile = _profile(model, a.profile_tokens) if a.policy == "pinned" else None
        rows = []
        for spec in a.budgets.split(","):
            name, budget = _budget(spec, model)
            for cache in ("warm", "cold"):
                for prefetch in (False, True):  # interleaved A/B, back to back
                    rows.append(_row(model, path, ids, a, name, budget, cache, prefetch, base,
                                     profile))
        cold = [_cold_tokens(model, path, ids, a, spec, base, reads)
                for spec in a.cold_budgets.split(",") if spec
                for reads in a.cold_reads.split(",") if reads]
        pressure = [(spec, _pressure(model, path, ids, a, spec))
                    for spec in a.pressure_budgets.split(",") if spec]
        loads = _load_path(model, path, a)
        del model
        ab = _warm_ab(a, path, ids, base) if a.ab_rounds else []
        last = {**sequential_read(path), "loadavg": os.getloadavg()[0]}
    seq = {"gb_per_s": (first["gb_per_s"] + last["gb_per_s"]) / 2,
           "runs": f"{first['gb_per_s'] * 1e3:.0f} and {last['gb_per_s'] * 1e3:.0f} MB/s at load "
                   f"{first['loadavg']:.1f} / {last['loadavg']:.1f}"}
    print(_table(rows, seq, skew))
    if cold:
        print("\nCold decode, token by token (the file dropped from the page cache before each "
              "token; each token followed by a sequential read of as many bytes and a "
              "scattered read of its own expert ranges; medians over the tokens):\n")
        print(_cold_table(cold))
    if pressure:
        print("\nDecode under memory pressure (in a memory cgroup too small for the file; "
              "the ways of reading alternate in blocks of tokens; medians over the tokens):")
        for spec, rows_ in pressure:
            print("\n" + pressure_table(rows_, spec))
    print("\nExpert loads alone (one step of 8 random experts per layer, through the store), "
          "interleaved with sequential reads:\n")
    print(_load_table(loads))
    if ab:
        print(f"\nWarm decode, interleaved A/B ({a.ab_rounds} rounds, prefetcher off, policy "
              f"{a.policy}, {a.matmul} arithmetic):\n")
        print(_ab_table(ab))
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    if a.plot:
        _plot(rows, a.plot)
    pressed = [r for _, rows_ in pressure for r in rows_ if "exact" in r]
    return 0 if all(r["exact"] for r in rows + ab + cold + pressed) else 1


if __name__ == "__main__":
    sys.exit(main())
