"""Where a decode token's time goes: weight matmuls, the output head, the K/V store +
attention, and the rest.

    python benchmarks/profile_decode.py [--model FILE] [--contexts 16,2048] [--tokens 24]
                                        [--matmul float|int8]

For each context, one process loads the model (float16 K/V, no budget: the defaults), prefills
the shipped validation text, then decodes --tokens tokens twice per round, interleaved: once
through the compiled decode path (`Atlas.write_attend` taking `HotCache.append_walk` +
`fold.fold_hot` when every page is hot) and once with that path switched off (every layer
through `write_stored` + `attend_heads`, the general path), so both columns see
the same minutes of the machine. Per token (median over tokens): the total, the time inside
`QuantWeight.matmul` (the layers' kernels and their Python wrappers), inside
`QuantWeight.matmul_refined` (the output head), inside `Session.store_attend` (checks, the
regenerator's copy, the hot-cache write, the fold, the merge), the rest (norms, RoPE,
activations, residuals, the per-layer Python of the forward pass), and Python function
calls per token (cProfile, a separate pass: the profiler slows Python, not the kernels).
Ratios compare columns of one run only.
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

from cfr_atlas.atlas.hot_cache import HotCache  # noqa: E402
from cfr_atlas.engine import load_model  # noqa: E402
from cfr_atlas.generate import prefill  # noqa: E402
from cfr_atlas.models.session import Session  # noqa: E402
from cfr_atlas.quant.weight import QuantWeight  # noqa: E402
from cfr_atlas.validate import validation_text  # noqa: E402

PARTS = ("matmul", "head", "store_attend")


class Timers:
    """Wall time inside QuantWeight.matmul (the layers), QuantWeight.matmul_refined (the output
    head) and Session.store_attend, outermost calls only."""

    def __init__(self):
        self.seconds = defaultdict(float)
        self._depth = 0
        for cls, name, part in ((QuantWeight, "matmul", "matmul"),
                                (QuantWeight, "matmul_refined", "head"),
                                (Session, "store_attend", "store_attend")):
            setattr(cls, name, self._wrap(getattr(cls, name), part))

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


def _general_path(on: bool) -> None:
    """Switch the compiled decode path off (append_walk says "not all hot") or back on."""
    if on:
        HotCache.append_walk = lambda *a, **k: None
    else:
        HotCache.append_walk = HotCache._compiled_append_walk


def profile(model, ids: np.ndarray, context: int, tokens: int, rounds: int) -> dict:
    timers = Timers()
    sessions, pos, rows = {}, {}, {"compiled": [], "general": []}
    for mode in rows:
        sessions[mode] = model.session()
        prefill(model.net, sessions[mode], ids[:context])
        pos[mode] = context
    for _ in range(rounds):
        for mode in rows:
            _general_path(mode == "general")
            for _ in range(tokens):
                timers.seconds.clear()
                t0 = time.perf_counter()
                model.net.forward_chunk(sessions[mode], ids[pos[mode]:pos[mode] + 1],
                                        all_logits=False)
                total = time.perf_counter() - t0
                rows[mode].append((total, *(timers.seconds[p] for p in PARTS)))
                pos[mode] += 1
    calls = {}
    for mode in rows:  # Python calls per token, in a profiled pass of its own
        _general_path(mode == "general")
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(4):
            model.net.forward_chunk(sessions[mode], ids[pos[mode]:pos[mode] + 1],
                                    all_logits=False)
            pos[mode] += 1
        prof.disable()
        calls[mode] = pstats.Stats(prof).total_calls / 4
    _general_path(False)
    for s in sessions.values():
        s.close()
    out = {}
    for mode, samples in rows.items():
        med = [statistics.median(col) for col in zip(*samples, strict=True)]
        out[mode] = {"total_ms": 1e3 * med[0], "matmul_ms": 1e3 * med[1],
                     "head_ms": 1e3 * med[2], "store_attend_ms": 1e3 * med[3],
                     "rest_ms": 1e3 * (med[0] - sum(med[1:])), "calls": calls[mode]}
    return out


def table(results: dict) -> str:
    lines = ["| context | path | ms / token | matmul | head | store + attention | rest | "
             "Python calls / token |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for context, modes in results.items():
        for mode, r in modes.items():
            lines.append(f"| {context:,} | {mode} | {r['total_ms']:.1f} | {r['matmul_ms']:.1f} | "
                         f"{r['head_ms']:.1f} | {r['store_attend_ms']:.1f} | {r['rest_ms']:.1f} | "
                         f"{r['calls']:,.0f} |")
        c, g = modes["compiled"], modes["general"]
        lines.append(f"| {context:,} | general / compiled | {g['total_ms'] / c['total_ms']:.2f}x "
                     f"| | | {g['store_attend_ms'] / c['store_attend_ms']:.2f}x | | |")
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


HotCache._compiled_append_walk = HotCache.append_walk

if __name__ == "__main__":
    sys.exit(main())
