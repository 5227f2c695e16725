"""Logits of cfr-atlas against llama.cpp (llama-cpp-python) on the same GGUF and the same ids.

For each text: cfr-atlas's logits at every position (float16 K/V, the default) and llama.cpp's
(`logits_all`, its default f16 K/V cache), then the share of positions whose argmax agrees,
max |diff| and mean |diff| over all logits. Prints a table row per text for docs/CONFORMANCE.md
and, with --fixture, writes a compact JSON that CI checks without llama.cpp
(tests/models/test_real_conformance.py): llama.cpp's argmax at every position and its top-8
(id, logit) at a few positions.

Usage: PYTHONPATH=src python benchmarks/conformance_llamacpp.py MODEL.gguf [--fixture OUT.json]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

SHORT_TEXTS = [
    "The quick brown fox jumps over the lazy dog. Then it runs into the forest.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + ",
    "In 1969, the Apollo 11 mission landed two astronauts on the Moon. They spent",
    "Water boils at 100 degrees Celsius at sea level, but at higher altitudes it",
]
LONG_TOKENS = 1024
FIXTURE_POSITIONS = 8


def texts(model) -> list[tuple[str, list[int]]]:
    from cfr_atlas.validate import validation_text

    out = [(f"short {i + 1}", model.tokenize(t)) for i, t in enumerate(SHORT_TEXTS)]
    text = validation_text()
    tail = text[len(text) // 2:]  # held out: not the prefix the other tests use
    out.append((f"long ({LONG_TOKENS} tokens)", model.tokenize(tail)[:LONG_TOKENS]))
    return out


def llamacpp_logits(llm, ids: list[int]) -> np.ndarray:
    llm.reset()
    llm.eval(ids)
    return np.array(llm.scores[:len(ids)], dtype=np.float32)


def compare(ours: np.ndarray, theirs: np.ndarray) -> dict:
    diff = np.abs(ours.astype(np.float64) - theirs)
    return {"argmax": float((ours.argmax(1) == theirs.argmax(1)).mean()),
            "max_diff": float(diff.max()), "mean_diff": float(diff.mean())}


def fixture_case(name: str, ids: list[int], theirs: np.ndarray) -> dict:
    pos = np.linspace(0, len(ids) - 1, min(FIXTURE_POSITIONS, len(ids))).astype(int)
    top = np.argsort(-theirs[pos], axis=1)[:, :8]
    return {"name": name, "ids": [int(i) for i in ids],
            "argmax": [int(i) for i in theirs.argmax(1)],
            "positions": pos.tolist(), "top_ids": top.tolist(),
            "top_logits": np.take_along_axis(theirs[pos], top, 1).round(4).tolist()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--fixture", default=None)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    import llama_cpp

    from cfr_atlas.engine import load_model

    model = load_model(a.model)
    llm = llama_cpp.Llama(a.model, n_ctx=LONG_TOKENS + 64, n_batch=512, logits_all=True,
                          n_threads=a.threads, verbose=False)
    cases = []
    print("| text | tokens | argmax agree | max abs diff | mean abs diff |")
    print("|---|---|---|---|---|")
    for name, ids in texts(model):
        t0 = time.perf_counter()
        ours = model.logits(ids)
        theirs = llamacpp_logits(llm, ids)
        r = compare(ours, theirs)
        print(f"| {name} | {len(ids)} | {r['argmax']:.1%} | {r['max_diff']:.3f} | "
              f"{r['mean_diff']:.4f} |  ({time.perf_counter() - t0:.0f} s)", flush=True)
        cases.append(fixture_case(name, ids, theirs))
    if a.fixture:
        meta = {"model": a.model.rsplit("/", 1)[-1], "llama_cpp": llama_cpp.__version__}
        with open(a.fixture, "w") as f:
            json.dump({"meta": meta, "cases": cases}, f, separators=(",", ":"))
        print(f"wrote {a.fixture}")


if __name__ == "__main__":
    main()
