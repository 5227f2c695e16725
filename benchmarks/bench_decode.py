"""Prefill and decode speed of the default model, side by side with llama.cpp when available.

    python benchmarks/bench_decode.py [--model PATH] [--threads 2] [--repeats 3]

Prints one table: prefill tokens/s for prompts of 512 and 2,048 tokens, decode tokens/s after
16, 2,048 and 6,000 tokens of context, and peak RSS. If `llama_cpp` (llama-cpp-python) is
importable, the same GGUF runs through llama.cpp with the same thread count in the same process
and the table gains its numbers and our/their ratios. Timings are medians.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time

import numpy as np


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _text_ids(model, n: int) -> np.ndarray:
    from cfr_atlas.validate import validation_text

    ids = model.tokenize(validation_text())
    return np.array(ids[:n], dtype=np.int64)


def ours(model, prompt_lens, decode_after, repeats: int, decode_tokens: int) -> dict:
    from cfr_atlas.generate import prefill

    out = {}
    for n in prompt_lens:
        ids = _text_ids(model, n)
        times = []
        for _ in range(repeats):
            s = model.session()
            t0 = time.perf_counter()
            prefill(model.net, s, ids)
            times.append(time.perf_counter() - t0)
            s.close()
        out[f"prefill {n}"] = n / statistics.median(times)
    for ctx in decode_after:
        ids = _text_ids(model, ctx)
        s = model.session()
        logits = prefill(model.net, s, ids)[0]
        times = []
        for _ in range(decode_tokens):
            tok = np.array([int(np.argmax(logits))], dtype=np.int64)
            t0 = time.perf_counter()
            logits = model.net.forward_chunk(s, tok, all_logits=False)[0]
            times.append(time.perf_counter() - t0)
        s.close()
        out[f"decode @{ctx}"] = 1.0 / statistics.median(times)
    return out


def theirs(path, prompt_lens, decode_after, repeats: int, decode_tokens: int, threads: int,
           model) -> dict | None:
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    llm = Llama(model_path=str(path), n_ctx=8192, n_threads=threads, n_batch=512, verbose=False)
    out = {}
    for n in prompt_lens:
        ids = _text_ids(model, n).tolist()
        times = []
        for _ in range(repeats):
            llm.reset()
            t0 = time.perf_counter()
            llm.eval(ids)
            times.append(time.perf_counter() - t0)
        out[f"prefill {n}"] = n / statistics.median(times)
    for ctx in decode_after:
        ids = _text_ids(model, ctx + decode_tokens).tolist()  # decode feeds the text's next ids
        llm.reset()
        llm.eval(ids[:ctx])
        times = []
        for tok in ids[ctx:]:
            t0 = time.perf_counter()
            llm.eval([tok])
            times.append(time.perf_counter() - t0)
        out[f"decode @{ctx}"] = 1.0 / statistics.median(times)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF path (default: bundled SmolLM2-135M)")
    ap.add_argument("--threads", type=int, default=2, help="threads for both engines")
    ap.add_argument("--repeats", type=int, default=3, help="prefill repeats (median)")
    ap.add_argument("--decode-tokens", type=int, default=16, help="decode steps timed (median)")
    ap.add_argument("--prompts", default="512,2048", help="prefill prompt lengths")
    ap.add_argument("--contexts", default="16,2048,6000", help="decode context lengths")
    a = ap.parse_args()
    os.environ.setdefault("NUMBA_NUM_THREADS", str(a.threads))
    import numba

    numba.set_num_threads(a.threads)
    from cfr_atlas.engine import load_model

    rss0 = _rss_mib()
    t0 = time.perf_counter()
    model = load_model(a.model)
    print(f"load: {time.perf_counter() - t0:.1f}s, file {model.path.stat().st_size / 2**20:.0f} "
          f"MiB, peak RSS after load {_rss_mib():.0f} MiB (before {rss0:.0f})")
    prompts = [int(x) for x in a.prompts.split(",")]
    contexts = [int(x) for x in a.contexts.split(",")]
    ours(model, [16], [16], 1, 2)  # warm-up: numba compile / cache load
    mine = ours(model, prompts, contexts, a.repeats, a.decode_tokens)
    ref = theirs(model.path, prompts, contexts, a.repeats, a.decode_tokens, a.threads, model)
    print(f"{'workload':<16}{'cfr-atlas tok/s':>17}" + (f"{'llama.cpp tok/s':>17}{'ratio':>8}"
                                                         if ref else ""))
    for k, v in mine.items():
        line = f"{k:<16}{v:>17.1f}"
        if ref:
            line += f"{ref[k]:>17.1f}{v / ref[k]:>8.2f}"
        print(line)
    if not ref:
        print("(llama-cpp-python not installed: pip install llama-cpp-python to compare)")
    print(f"peak RSS: {_rss_mib():.0f} MiB")


if __name__ == "__main__":
    main()
