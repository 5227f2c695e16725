"""Where a decode token's time goes: weight matmuls, the output head, the K/V store +
attention, and the rest.

    python benchmarks/profile_decode.py [--model FILE] [--contexts 16,2048] [--tokens 24]
                                        [--matmul float|int8]

For each context, one process loads the model (float16 K/V, no budget: the defaults), prefills
the shipped validation text, then decodes --tokens tokens per path and round, the paths
interleaved so that all see the same minutes of the machine:
  step     the decode step (models/decode.py: a few compiled calls per layer), when the model
           has one;
  pieces   forward_layers' pieces for the same token (decode step off), with the compiled
           hot walk (`Atlas.write_attend` taking `HotCache.append_fold` when every page is
           hot): the decode path before the step existed;
  general  the pieces with the compiled walk off too (every layer through `write_stored` +
           `attend_heads`).
Per token (median over tokens): the total, the time inside the layers' weight products
(`QuantWeight.matmul` / `QuantWeight.product`: the kernels and their wrappers), inside
`QuantWeight.matmul_refined` (the output head), inside `Session.store_attend` /
`Session.decode_attend` / `Session.record_rows` and the step's `HotWalks.run` (the
regenerator's copy, the hot-cache write, the fold, the merge; the pieces also check and round
the rows there, the step in its qkv_rows kernel, which is "rest"),
the rest (norms, RoPE, activations, residuals, the per-layer Python of the forward pass), and
Python function calls per token (cProfile, a separate pass: the profiler slows Python, not the
kernels). Ratios compare paths of one run only.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from cfr_atlas.atlas.batch_walk import HotWalks  # noqa: E402
from cfr_atlas.atlas.hot_cache import HotCache  # noqa: E402
from cfr_atlas.engine import load_model  # noqa: E402
from cfr_atlas.generate import prefill  # noqa: E402
from cfr_atlas.models.session import Session  # noqa: E402
from cfr_atlas.quant.weight import QuantWeight  # noqa: E402
from cfr_atlas.validate import validation_text  # noqa: E402

PARTS = ("matmul", "head", "store_attend")


class Timers:
    """Wall time inside QuantWeight.matmul / product (the layers), QuantWeight.matmul_refined
    (the output head) and Session.store_attend / decode_attend / record_rows and HotWalks.run
    (the step's walks, a sequence alone included), outermost calls only, while
    the patches are on (`close` takes them off). One thread: the profile's own."""

    def __init__(self):
        self.seconds = defaultdict(float)
        self._depth = 0
        self._saved = []
        for cls, name, part in ((QuantWeight, "matmul", "matmul"),
                                (QuantWeight, "product", "matmul"),
                                (QuantWeight, "matmul_refined", "head"),
                                (Session, "store_attend", "store_attend"),
                                (Session, "decode_attend", "store_attend"),
                                (Session, "record_rows", "store_attend"),
                                (HotWalks, "run", "store_attend")):
            self._saved.append((cls, name, cls.__dict__[name]))
            setattr(cls, name, self._wrap(getattr(cls, name), part))

    def close(self) -> None:
        for cls, name, fn in self._saved:
            setattr(cls, name, fn)

    def _wrap(self, fn, part):
        def timed(*args, **kw):
            if self._depth:
                return fn(*args, **kw)
            self._depth += 1
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                self.seconds[part] += time.perf_counter() - t0
                self._depth -= 1
        return timed


def _use_path(model, path: str, step) -> None:
    """Select a path (see the module docstring); "step" restores the model as loaded."""
    model.net.decode_step = step if path == "step" else None
    if path == "general":  # "the walk does not apply": the general calls
        HotCache.walk_misses = lambda *a, **k: None
        HotCache.append_fold = lambda *a, **k: (-1, 0, 0)
    else:
        HotCache.append_fold, HotCache.walk_misses = HotCache._compiled_walks


def profile(model, ids: np.ndarray, context: int, tokens: int, rounds: int) -> dict:
    timers = Timers()
    step = model.net.decode_step
    paths = ("step", "pieces", "general") if step is not None else ("pieces", "general")
    sessions, pos, rows = {}, {}, {p: [] for p in paths}
    for path in paths:
        sessions[path] = model.session()
        prefill(model.net, sessions[path], ids[:context])
        pos[path] = context
    try:
        for _ in range(rounds):
            for path in paths:
                _use_path(model, path, step)
                for _ in range(tokens):
                    timers.seconds.clear()
                    t0 = time.perf_counter()
                    model.net.forward_chunk(sessions[path], ids[pos[path]:pos[path] + 1],
                                            all_logits=False)
                    total = time.perf_counter() - t0
                    rows[path].append((total, *(timers.seconds[p] for p in PARTS)))
                    pos[path] += 1
        calls = {}
        for path in paths:  # Python calls per token, in a profiled pass of its own
            _use_path(model, path, step)
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(4):
                model.net.forward_chunk(sessions[path], ids[pos[path]:pos[path] + 1],
                                        all_logits=False)
                pos[path] += 1
            prof.disable()
            calls[path] = pstats.Stats(prof).total_calls / 4
    finally:
        _use_path(model, "step", step)
        timers.close()
        for s in sessions.values():
            s.close()
    out = {}
    for path, samples in rows.items():
        med = [statistics.median(col) for col in zip(*samples, strict=True)]
        out[path] = {"total_ms": 1e3 * med[0], "matmul_ms": 1e3 * med[1],
                     "head_ms": 1e3 * med[2], "store_attend_ms": 1e3 * med[3],
                     "rest_ms": 1e3 * (med[0] - sum(med[1:])), "calls": calls[path]}
    return out


def _ms(x: float) -> str:
    """Milliseconds with three decimals below 1 ms, so a small part never prints as 0.0."""
    return f"{x:.1f}" if abs(x) >= 1 else f"{x:.3f}"


def table(results: dict) -> str:
    lines = ["| context | path | ms / token | matmul | head | store + attention | rest | "
             "Python calls / token |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for context, modes in results.items():
        for mode, r in modes.items():
            ms = " | ".join(_ms(r[k]) for k in ("total_ms", "matmul_ms", "head_ms",
                                                    "store_attend_ms", "rest_ms"))
            lines.append(f"| {context:,} | {mode} | {ms} | {r['calls']:,.0f} |")
        first = next(iter(modes))
        for other in list(modes)[1:]:  # each path against the first (the step, when there)
            a, b = modes[first], modes[other]
            lines.append(f"| {context:,} | {other} / {first} | "
                         f"{b['total_ms'] / a['total_ms']:.2f}x | | | "
                         f"{b['store_attend_ms'] / a['store_attend_ms']:.2f}x | | |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="GGUF file (default: the bundled SmolLM2)")
    ap.add_argument("--contexts", default="16,2048", help="comma-separated contexts")
    ap.add_argument("--tokens", type=int, default=8, help="decode tokens per round and path")
    ap.add_argument("--rounds", type=int, default=3, help="rounds (paths alternate)")
    ap.add_argument("--matmul", default="float", choices=["float", "int8"],
                    help="the weight products' arithmetic (load_model's matmul)")
    a = ap.parse_args(argv)
    contexts = [int(c) for c in a.contexts.split(",")]
    model = load_model(a.model, matmul=a.matmul)
    need = max(contexts) + (a.rounds + 1) * (a.tokens + 4) + 8
    ids = np.asarray(model.tokenize(validation_text()), dtype=np.int64)
    ids = np.resize(ids, need)  # the text repeated if a context is longer
    results = {c: profile(model, ids, c, a.tokens, a.rounds) for c in contexts}
    print(table(results))
    return 0


HotCache._compiled_walks = HotCache.append_fold, HotCache.walk_misses

if __name__ == "__main__":
    sys.exit(main())
