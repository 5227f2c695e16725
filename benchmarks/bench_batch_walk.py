"""Batched decode walks on / off in one process: what one call per layer for all sequences'
attention (atlas/batch_walk.py) saves a decode step.

    python benchmarks/bench_batch_walk.py [--model PATH] [--sequences 2,4,8] [--context 0]
                                          [--rounds 8] [--steps 8] [--matmul int8|float]

For each N: N sessions (the defaults: float16 K/V, no budget) prefill their own prompt (30
words of the shipped validation text each, or with --context C, C + 5 i tokens of it for
sequence i), then `forward_batch` of N single tokens runs in blocks of --steps steps, the
batched walks on and off alternating block by block on the same sequences (off: every
sequence makes its own call, `DecodeStep._walks` returning None), the order of the two flipped
every round. Prints per N the median step time of each arm, the median over rounds of the
per-round on / off ratio and its range. Within one process only: the machine's noise between
processes was larger than these differences (docs/PERFORMANCE.md, "Session 38").
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np


def _sessions(model, n: int, context: int) -> list:
    from cfr_atlas.validate import validation_text

    text = validation_text()
    words, ids = text.split(), np.asarray(model.tokenize(text), dtype=np.int64)
    sessions = [model.session() for _ in range(n)]
    for i, s in enumerate(sessions):
        if context:
            prompt = np.resize(np.roll(ids, 37 * i), context + 5 * i)
        else:
            prompt = np.asarray(model.tokenize(" ".join(words[i * 40:i * 40 + 30])),
                                dtype=np.int64)
        for a in range(0, len(prompt), 512):
            model.net.forward_chunk(s, prompt[a:a + 512], output=False)
    return sessions


def measure(model, n: int, context: int, rounds: int, steps: int) -> dict:
    """{"on": [median ms per round], "off": [...], "ratios": [on / off per round]}."""
    from cfr_atlas.models.batch import BatchItem
    from cfr_atlas.models.decode import DecodeStep

    real = DecodeStep.__dict__["_walks"]
    off = staticmethod(lambda sessions: None)
    sessions = _sessions(model, n, context)
    token = np.array([42], dtype=np.int64)

    def step():
        out = model.net.forward_batch([BatchItem(s, token) for s in sessions])
        for r in out:
            if isinstance(r, Exception):
                raise r

    res: dict = {"on": [], "off": [], "ratios": []}
    try:
        for arm in (real, off, real):  # compile and warm both paths
            DecodeStep._walks = arm
            for _ in range(2):
                step()
        for r in range(rounds):
            med = {}
            for name in (("on", "off") if r % 2 == 0 else ("off", "on")):
                DecodeStep._walks = real if name == "on" else off
                times = []
                for _ in range(steps):
                    t0 = time.perf_counter()
                    step()
                    times.append(time.perf_counter() - t0)
                med[name] = statistics.median(times)
                res[name].append(med[name] * 1e3)
            res["ratios"].append(med["on"] / med["off"])
    finally:
        DecodeStep._walks = real
        for s in sessions:
            s.close()
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="GGUF path (default: the bundled model)")
    ap.add_argument("--sequences", default="2,4,8", help="comma-separated N (default 2,4,8)")
    ap.add_argument("--context", type=int, default=0,
                    help="prompt tokens per sequence (default 0: 30 words of text each)")
    ap.add_argument("--rounds", type=int, default=8, help="on / off rounds (default 8)")
    ap.add_argument("--steps", type=int, default=8, help="steps per block (default 8)")
    ap.add_argument("--matmul", default="int8", choices=["int8", "float"])
    a = ap.parse_args(argv)
    try:
        ns = [int(x) for x in a.sequences.split(",")]
        if min(ns) < 2 or a.rounds < 1 or a.steps < 1 or a.context < 0:
            raise ValueError
    except ValueError:
        print("bench_batch_walk: --sequences needs integers >= 2, --rounds and --steps >= 1, "
              "--context >= 0", file=sys.stderr)
        return 2
    from cfr_atlas.engine import load_model

    model = load_model(a.model, matmul=a.matmul)
    print(f"bench_batch_walk: matmul {a.matmul}, context "
          f"{a.context or '30 words'}, {a.rounds} rounds of {a.steps} steps per arm")
    print("| sequences | off ms/step | on ms/step | on / off (median of rounds) | range |")
    print("|---:|---:|---:|---:|---|")
    for n in ns:
        r = measure(model, n, a.context, a.rounds, a.steps)
        print(f"| {n} | {statistics.median(r['off']):.2f} | {statistics.median(r['on']):.2f} | "
              f"{statistics.median(r['ratios']):.3f} | "
              f"{min(r['ratios']):.2f}-{max(r['ratios']):.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
