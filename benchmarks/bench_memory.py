"""Process memory and speed under K/V budgets, per phase, with bitwise checks.

    python benchmarks/bench_memory.py [--contexts 2048,4096] [--budgets unbounded,64MiB,16MiB,1MiB]
        [--decode-tokens 8] [--tiny-context 32768] [--plot out.png]

Each (context, budget) runs in its own process. The worker reads /proc/self/status (Linux)
after each phase: after load (model loaded, kernels compiled by a short warm-up sequence that
is then closed), after prefill (the shipped real text up to the context length) and after
`--decode-tokens` greedy tokens, with the sequence alive. It reports anonymous memory
(RssAnon: heap, NumPy arrays, the repacked weights) and file-backed memory (RssFile: the
memory-mapped GGUF, shared libraries) separately, so the figures are what the process holds at
that point, not the high-water mark of loading. Also: the K/V the sequence really allocated
(telemetry `peak_allocated_kv_bytes`, from the arrays' nbytes) against the budget, the full
K/V size, tokens/s, pages regenerated, and whether every logit (the last prefill row and each
decode step) is bitwise equal to the unbounded run of the same context. The tiny model row (a
generated 2-layer GGUF) shows a long context cheaply.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
import time

import numpy as np


def rss() -> dict[str, int]:
    """RssAnon / RssFile of this process, bytes (Linux /proc/self/status)."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) * 1024
    return out


def worker(args) -> None:
    from cfr_atlas.engine import load_model
    from cfr_atlas.generate import prefill

    model = load_model(args.model)
    if args.tiny:
        rng = np.random.default_rng(0)
        ids = rng.integers(0, model.config.vocab_size, args.context, dtype=np.int64)
    else:
        from cfr_atlas.validate import validation_text

        ids = np.array(model.tokenize(validation_text())[:args.context], dtype=np.int64)
    kv = {} if args.budget == "unbounded" else {"kv_budget": args.budget,
                                                 "prefetch_pages": args.prefetch}
    phases = {}
    with tempfile.TemporaryDirectory() as tmp:
        warm = model.session(cache_dir=tmp, context_limit=16, **kv)  # compile kernels
        for _ in range(2):
            model.net.forward_chunk(warm, ids[:8 + warm.n_tokens][-8:], all_logits=False)
        warm.close()
        del warm
        phases["load"] = rss()
        s = model.session(context_limit=args.context + args.decode_tokens, cache_dir=tmp, **kv)
        t0 = time.perf_counter()
        logits = prefill(model.net, s, ids)[0]
        t_prefill = time.perf_counter() - t0
        phases["prefill"] = rss()
        digest = hashlib.sha256(logits.tobytes())
        t0 = time.perf_counter()
        for _ in range(args.decode_tokens):
            tok = np.array([int(np.argmax(logits))], dtype=np.int64)
            logits = model.net.forward_chunk(s, tok, all_logits=False)[0]
            digest.update(logits.tobytes())
        t_decode = time.perf_counter() - t0
        phases["decode"] = rss()
        tel = s.telemetry_summary()
        s.close()
    print(json.dumps({
        "prefill_tps": len(ids) / t_prefill, "decode_tps": args.decode_tokens / t_decode,
        "phases": phases, "allocated_kv": tel["peak_allocated_kv_bytes"],
        "budget": tel["budget_bytes"], "full_kv": tel["full_kv_bytes"],
        "regenerated": tel["pages_regenerated"], "digest": digest.hexdigest()}))


def run(model, context, budget, decode_tokens, tiny, prefetch=0) -> dict:
    cmd = [sys.executable, __file__, "--worker", "--context", str(context), "--budget", budget,
           "--decode-tokens", str(decode_tokens),
           "--prefetch", str(prefetch)] + (["--model", model] if model else []) + \
          (["--tiny"] if tiny else [])
    res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if res.returncode:
        raise SystemExit(f"worker failed: {' '.join(cmd)}\n{res.stderr[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--contexts", default="2048,4096")
    ap.add_argument("--budgets", default="unbounded,64MiB,16MiB,1MiB")
    ap.add_argument("--decode-tokens", type=int, default=8)
    ap.add_argument("--tiny-context", type=int, default=32768, help="0 to skip the tiny row")
    ap.add_argument("--plot", default=None, help="write a PNG of tokens/s and memory")
    ap.add_argument("--model", default=None)
    ap.add_argument("--prefetch", type=int, default=0,
                    help="spill read-ahead pages for budgeted runs (default 0)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--context", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--budget", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return worker(a)

    budgets = a.budgets.split(",")
    if budgets[0] != "unbounded":
        budgets.insert(0, "unbounded")
    plans = [(a.model, int(c), False) for c in a.contexts.split(",")]
    tmp = None
    if a.tiny_context:
        from cfr_atlas.testing import write_tiny_gguf

        tmp = tempfile.TemporaryDirectory()
        path = write_tiny_gguf(f"{tmp.name}/tiny.gguf", n_layers=2, dim=128, n_heads=4,
                               n_kv_heads=2, hidden_dim=256, context_length=a.tiny_context + 64)
        plans.append((str(path), a.tiny_context, True))
    mib = 1 << 20
    print("| model | context | budget | anon after load | anon after prefill | anon after decode "
          "| file-backed | K/V allocated (peak) | full K/V | prefill tok/s | decode tok/s "
          "| pages regenerated | bitwise |")
    print("|---" * 13 + "|")
    rows = []
    for model, ctx, tiny in plans:
        base = None
        for b in budgets:
            r = run(model, ctx, b, a.decode_tokens, tiny, a.prefetch)
            base = r if b == "unbounded" else base
            same = r["digest"] == base["digest"]
            rows.append((tiny, ctx, b, r))
            ph = r["phases"]
            anon = [ph[p]["RssAnon"] / mib for p in ("load", "prefill", "decode")]
            print(f"| {'tiny' if tiny else 'SmolLM2'} | {ctx:,} | {b} | {anon[0]:.0f} MiB "
                  f"| {anon[1]:.0f} MiB (+{anon[1] - anon[0]:.0f}) "
                  f"| {anon[2]:.0f} MiB (+{anon[2] - anon[0]:.0f}) "
                  f"| {ph['decode']['RssFile'] / mib:.0f} MiB "
                  f"| {r['allocated_kv'] / mib:.2f} MiB | {r['full_kv'] / mib:.1f} MiB "
                  f"| {r['prefill_tps']:.0f} | {r['decode_tps']:.1f} | {r['regenerated']:,} "
                  f"| {'yes' if same else 'NO'} |", flush=True)
            if not same:
                raise SystemExit("logits differ from the unbounded run: exactness is broken")
            if r["budget"] is not None and r["allocated_kv"] > r["budget"]:
                raise SystemExit(f"allocated K/V {r['allocated_kv']} exceeds the budget")
    if a.plot:
        _plot(rows, a.plot)


def _plot(rows, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for ctx in sorted({r[1] for r in rows if not r[0]}):
        sel = [r for r in rows if r[1] == ctx and not r[0]]
        xs = [r[3]["allocated_kv"] / 2**20 for r in sel]
        ax1.plot(xs, [r[3]["decode_tps"] for r in sel], "o-", label=f"{ctx} tokens")
        ax2.plot([r[2] for r in sel], [r[3]["phases"]["decode"]["RssAnon"] / 2**20 for r in sel],
                 "o-", label=f"{ctx} tokens")
    ax1.set_xscale("log")
    ax1.set(xlabel="allocated K/V (MiB)", ylabel="decode tokens/s", title="speed vs memory")
    ax2.set(xlabel="budget", ylabel="anonymous RSS after decode (MiB)", title="process memory")
    ax2.set_yscale("log")
    for ax in (ax1, ax2):
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
