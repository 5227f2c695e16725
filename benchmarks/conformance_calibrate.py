"""Calibrate a llama.cpp conformance gap: the same long text through four computations, every
pair compared over all logits.

  ours           cfr-atlas with its defaults (float16 K/V)
  lcpp_f16_fa    llama.cpp (llama-cpp-python) as benchmarks/conformance_llamacpp.py runs it:
                 f16 K/V cache, flash attention on
  lcpp_f32_nofa  llama.cpp with an f32 K/V cache and flash attention off
  hf             HF transformers on the same GGUF dequantized to float32 (only if torch and
                 transformers import; run this script with the `make conformance` venv for it)

If llama.cpp's two settings differ from each other by as much as they differ from cfr-atlas,
and cfr-atlas sits on HF, a missed llama.cpp threshold measures llama.cpp's approximations.
Results for the real models are in docs/CONFORMANCE.md, section 5.

Usage: PYTHONPATH=src python benchmarks/conformance_calibrate.py MODEL.gguf
"""

from __future__ import annotations

import argparse
import importlib.util
from itertools import combinations
from pathlib import Path

import numpy as np

from conformance_llamacpp import LONG_TOKENS, compare, texts

LLAMACPP = {"lcpp_f16_fa": {"flash_attn": True},
            "lcpp_f32_nofa": {"flash_attn": False, "type_k": 0, "type_v": 0}}  # 0 = GGML F32


def llamacpp(path: str, ids: list[int], threads: int) -> dict[str, np.ndarray]:
    import llama_cpp

    out = {}
    for tag, kw in LLAMACPP.items():
        llm = llama_cpp.Llama(path, n_ctx=LONG_TOKENS + 64, n_batch=512, logits_all=True,
                              n_threads=threads, verbose=False, **kw)
        llm.reset()
        llm.eval(ids)
        out[tag] = np.array(llm.scores[:len(ids)], dtype=np.float32)
        del llm
    return out


def hf(path: str, ids: list[int]) -> np.ndarray:
    import torch
    from transformers import AutoModelForCausalLM

    p = Path(path)
    m = AutoModelForCausalLM.from_pretrained(p.parent, gguf_file=p.name, dtype=torch.float32)
    with torch.inference_mode():
        return m.eval()(torch.tensor([ids])).logits[0].float().numpy()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    from cfr_atlas.engine import load_model

    model = load_model(a.model)
    ids = next(i for name, i in texts(model) if name.startswith("long"))
    runs = {"ours": model.logits(ids)}
    if importlib.util.find_spec("llama_cpp"):
        runs |= llamacpp(a.model, ids, a.threads)
    if importlib.util.find_spec("torch") and importlib.util.find_spec("transformers"):
        runs["hf"] = hf(a.model, ids)
    print(f"{Path(a.model).name}: {len(ids)} tokens, pairs over all logits")
    print("| pair | argmax agreement | max abs diff | mean abs diff |\n|---|---|---|---|")
    for x, y in combinations(runs, 2):
        r = compare(runs[x], runs[y])
        print(f"| {x} vs {y} | {r['argmax']:.1%} | {r['max_diff']:.3f} | "
              f"{r['mean_diff']:.4f} |")


if __name__ == "__main__":
    main()
