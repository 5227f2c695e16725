"""Resident K/V and speed under K/V budgets, with bitwise checks against the unbounded run.

    python benchmarks/bench_memory.py [--contexts 1024,2048,4096,8192]
        [--budgets unbounded,64MiB,16MiB,4MiB] [--tiny-context 32768] [--plot out.png]

Each (context, budget) runs in its own process so peak RSS is that run's own. A run prefills
the shipped real text to the context length, then decodes `--decode-tokens` greedy tokens.
Columns: peak RSS, peak resident K/V (hot cache + scratch), full K/V, prefill and decode
tokens/s, and whether every logit (the last prefill row and every decode step) is bitwise equal
to the unbounded run of the same context. The tiny model row (a generated 2-layer GGUF) shows a
32K context cheaply.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import resource
import subprocess
import sys
import tempfile
import time

import numpy as np


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
    with tempfile.TemporaryDirectory() as tmp:
        warm = model.session(cache_dir=tmp, **kv)  # load / compile kernels before timing
        for _ in range(2):
            model.net.forward_chunk(warm, ids[:8 + warm.n_tokens][-8:], all_logits=False)
        warm.close()
        s = model.session(context_limit=args.context + args.decode_tokens, cache_dir=tmp, **kv)
        t0 = time.perf_counter()
        logits = prefill(model.net, s, ids)[0]
        t_prefill = time.perf_counter() - t0
        digest = hashlib.sha256(logits.tobytes())
        t0 = time.perf_counter()
        for _ in range(args.decode_tokens):
            tok = np.array([int(np.argmax(logits))], dtype=np.int64)
            logits = model.net.forward_chunk(s, tok, all_logits=False)[0]
            digest.update(logits.tobytes())
        t_decode = time.perf_counter() - t0
        tel = s.telemetry_summary()
        s.close()
    print(json.dumps({
        "prefill_tps": len(ids) / t_prefill, "decode_tps": args.decode_tokens / t_decode,
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "peak_kv": tel["peak_resident_kv_bytes"], "full_kv": tel["full_kv_bytes"],
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
    ap.add_argument("--contexts", default="1024,2048,4096,8192")
    ap.add_argument("--budgets", default="unbounded,64MiB,16MiB,4MiB")
    ap.add_argument("--decode-tokens", type=int, default=16)
    ap.add_argument("--tiny-context", type=int, default=32768, help="0 to skip the tiny row")
    ap.add_argument("--plot", default=None, help="write a PNG of tokens/s and resident K/V")
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
    head = (f"{'model':<6}{'context':>8}{'budget':>11}{'peak RSS':>10}{'peak K/V':>10}"
            f"{'full K/V':>10}{'prefill t/s':>12}{'decode t/s':>11}{'regen':>9}  bitwise")
    print(head)
    rows = []
    for model, ctx, tiny in plans:
        base = None
        for b in budgets:
            r = run(model, ctx, b, a.decode_tokens, tiny, a.prefetch)
            base = r if b == "unbounded" else base
            same = r["digest"] == base["digest"]
            rows.append((tiny, ctx, b, r))
            print(f"{'tiny' if tiny else 'smol':<6}{ctx:>8}{b:>11}{r['peak_rss'] / mib:>9.0f}M"
                  f"{r['peak_kv'] / mib:>9.1f}M{r['full_kv'] / mib:>9.1f}M"
                  f"{r['prefill_tps']:>12.1f}{r['decode_tps']:>11.1f}{r['regenerated']:>9}  "
                  f"{'yes' if same else 'NO'}", flush=True)
            if not same:
                raise SystemExit("logits differ from the unbounded run: exactness is broken")
    if a.plot:
        _plot(rows, a.plot)


def _plot(rows, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for ctx in sorted({r[1] for r in rows if not r[0]}):
        sel = [r for r in rows if r[1] == ctx and not r[0]]
        xs = [r[3]["peak_kv"] / 2**20 for r in sel]
        ax1.plot(xs, [r[3]["decode_tps"] for r in sel], "o-", label=f"{ctx} tokens")
        ax2.plot([r[2] for r in sel], [r[3]["peak_kv"] / 2**20 for r in sel], "o-",
                 label=f"{ctx} tokens")
    ax1.set_xscale("log")
    ax1.set(xlabel="peak resident K/V (MiB)", ylabel="decode tokens/s", title="speed vs memory")
    ax2.set(xlabel="budget", ylabel="peak resident K/V (MiB)", title="resident K/V")
    ax2.set_yscale("log")
    for ax in (ax1, ax2):
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
