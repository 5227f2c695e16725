"""cfr-atlas against llama.cpp on the same GGUF files, each engine in its own process.

    python benchmarks/bench_decode.py [--threads 2] [--rounds 2] [--plot out.png] [--json out.json]
    python benchmarks/bench_decode.py --quick          # tiny generated model, short contexts

Files: the bundled SmolLM2-135M Q4_1 and its Q4_0 and Q8_0 versions, written into a temporary
folder by `requant.variants` (gguf-py's quantizers on the dequantized bundled weights; norms and
the token embedding kept as stored). Both engines get the same token ids (the shipped validation
text through the GGUF's tokenizer), the same threads and the same contexts:
  * prefill N: tokens/s of N prompt tokens into an empty K/V cache (median of --repeats);
  * decode @C: after C tokens of context, 1 / median seconds of one token (--decode-tokens steps,
    each feeding the text's next id, so both engines do the same work).
Each (format, engine) runs in a fresh worker process (two OpenMP / numba thread pools in one
process fight over the cores); engines alternate within a round and the order flips every
(round, format), and a cell is the median over --rounds. Ratios are ours / llama.cpp, printed
beside the issue-11 targets: decode after <= 16 tokens >= 1.2x, longer decode and prefill
>= 1.5x.

Decode against memory bandwidth: before and after the runs a worker measures the machine's read
bandwidth with the same threads (a vectorized sum over a 1 GiB buffer, best of 7);
a second table gives, per engine and decode context, the weight bytes a token streams (ours:
the repacked tiles; llama.cpp: the file's tensors, the token embedding left out when the file
has a separate output head), the GB/s that makes at the measured speed, its share of the
measured bandwidth, and the bound: tokens/s if those bytes streamed at that bandwidth and
nothing else took time. Where both engines run near their bound, a ratio above bound / bound
needs fewer bytes, not faster code.

Settings: llama.cpp (llama-cpp-python, `benchmarks/install_llama_cpp.sh`) with
n_threads = n_threads_batch = --threads, n_batch = n_ubatch = 512, n_ctx covering the longest
run, its default f16 K/V, flash attention on (what llama.cpp's own default "auto" resolves to
on a CPU; llama-cpp-python's default is off, --flash-attn off measures that) and
OMP_WAIT_POLICY the same for both engines (both use OpenMP thread pools: llama.cpp's own,
numba's OpenMP layer): --omp-wait-policy default (unset: OpenMP spins a while at a barrier,
then sleeps) or active (spin) on a quiet machine, passive on a shared, busy one, where spinning
barriers collapse (llama.cpp's decode after 512 tokens measured 0.5-0.8 tok/s ACTIVE against
19-27 PASSIVE at load average 15). Until session 31 the policy reached llama.cpp's worker only,
and PASSIVE by default: on a quiet machine that held llama.cpp's decode to a third of its speed
(bundled Q4_1 after 16 tokens: 37 against 106 tok/s ACTIVE, docs/PERFORMANCE.md). Ours with
its defaults (float16 K/V, no budget, 256-token prefill chunks), as two engines: float arithmetic
(the default) and `matmul="int8"` (activations quantized per 32-element block, integer dots,
as llama.cpp computes), each with its own ratio to llama.cpp. llama.cpp is skipped, with a
note, when `llama_cpp` is not importable. This script does not compare the engines' outputs
(see docs/CONFORMANCE.md and benchmarks/llamacpp_ref.py).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ENGINES = ("ours", "ours-int8", "llamacpp")
NAMES = {"ours": "cfr-atlas", "ours-int8": "cfr-atlas int8", "llamacpp": "llama.cpp"}
# our engines -> the suffix of their ratio / met keys: float (the default), matmul="int8"
OURS = {"ours": "", "ours-int8": "_int8"}
N_BATCH = 512
VENDORED = {"0.3.36": "ggml-org/llama.cpp@0c1e57098"}  # llama-cpp-python's CHANGELOG


def target(kind: str, n: int) -> float:
    """The issue's target ratio (ours / llama.cpp) for a row."""
    return 1.2 if kind == "decode" and n <= 16 else 1.5


# --- workers (one engine, one file, every row) --------------------------------------------------
def _warm(run_prompt, run_token, ids) -> None:
    """Compile / allocate before timing: a short prompt and two single tokens."""
    run_prompt(ids[:32], fresh=True)
    run_token(ids[32:33])
    run_token(ids[33:34])


def _measure(spec: dict, ids: np.ndarray, run_prompt, run_token) -> dict:
    """{"prefill N": tok/s, "decode @C": tok/s} with the given engine callbacks.

    run_prompt(ids, fresh) feeds ids (into an empty cache if fresh); run_token(ids) one token.
    Decode contexts are visited in increasing order on one sequence: the text's ids fill it
    up to each context, then --decode-tokens single tokens are timed."""
    _warm(run_prompt, run_token, ids)
    out = {}
    for n in spec["prompts"]:
        times = []
        for _ in range(spec["repeats"]):
            times.append(run_prompt(ids[:n], fresh=True))
        out[f"prefill {n}"] = n / statistics.median(times)
    pos = 0
    for i, ctx in enumerate(spec["contexts"]):
        run_prompt(ids[pos:ctx], fresh=i == 0)
        times = [run_token(ids[t:t + 1]) for t in range(ctx, ctx + spec["decode_tokens"])]
        out[f"decode @{ctx}"] = 1.0 / statistics.median(times)
        pos = ctx + spec["decode_tokens"]
    return out


def ours_worker(spec: dict, ids: np.ndarray) -> dict:
    from cfr_atlas.engine import load_model
    from cfr_atlas.generate import prefill

    model = load_model(spec["model"], matmul="int8" if spec["engine"] == "ours-int8" else "float")
    state = {"s": None}

    def run_prompt(chunk, fresh: bool) -> float:
        if fresh:
            if state["s"] is not None:
                state["s"].close()
            state["s"] = model.session()  # float16 K/V, no budget: the defaults
        t0 = time.perf_counter()
        prefill(model.net, state["s"], chunk)
        return time.perf_counter() - t0

    def run_token(tok) -> float:
        t0 = time.perf_counter()
        model.net.forward_chunk(state["s"], tok, all_logits=False)
        return time.perf_counter() - t0

    rows = _measure(spec, ids, run_prompt, run_token)
    state["s"].close()
    import numba

    return {"rows": rows, "info": {"numba_threads": numba.get_num_threads()},
            "weight_bytes": our_weight_bytes(model.net)}


def our_weight_bytes(net) -> int:
    """Bytes of weights a decode token streams through our kernels: every QuantWeight the
    network holds (the repacked tiles, `QuantWeight.nbytes`), the token embedding left out
    when a separate output head exists (a token reads one row of it)."""
    from cfr_atlas.quant import QuantWeight

    found, stack, seen = {}, [net.weights], set()
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, QuantWeight):
            found[id(obj)] = obj
        elif isinstance(obj, (list, tuple)):
            stack.extend(obj)
        elif type(obj).__module__.startswith("cfr_atlas.models") and hasattr(obj, "__dict__"):
            stack.extend(vars(obj).values())
    embed, head = getattr(net.weights, "embed", None), getattr(net.weights, "output", None)
    if isinstance(embed, QuantWeight) and embed is not head:
        found.pop(id(embed), None)
    return sum(w.nbytes for w in found.values())


def gguf_weight_bytes(path) -> int:
    """The same for llama.cpp on a GGUF file: every tensor's stored bytes (its CPU repack keeps
    the size), token_embd left out when output.weight exists."""
    from gguf import GGUFReader

    tensors = {t.name: int(t.n_bytes) for t in GGUFReader(path).tensors}
    if "output.weight" in tensors:
        tensors.pop("token_embd.weight", None)
    return sum(tensors.values())


def stream_worker(spec: dict, ids: np.ndarray) -> dict:
    """The machine's read bandwidth with the engines' threads: a parallel, vectorized sum of
    every byte of a 1 GiB buffer (--quick: 64 MiB, a smoke test), best of 7, in GB/s. A decode
    token streaming B bytes of weights cannot run faster than bandwidth / B."""
    import numba

    @numba.njit(parallel=True, cache=False)
    def touch(a, parts):
        n = a.size // parts
        out = np.zeros(parts, dtype=np.uint64)
        for p in numba.prange(parts):
            b = a[p * n:(p + 1) * n]  # indices from 0: no wraparound test, so LLVM vectorizes
            acc = np.uint64(0)
            for i in range(b.size):
                acc += b[i]
            out[p] = acc
        return out.sum()

    buf = np.ones(spec["stream_bytes"] // 8, dtype=np.uint64)  # 1 GiB (--quick: 64 MiB)
    parts = 64 * spec["threads"]
    touch(buf, parts)
    best = min(_timed(touch, buf, parts) for _ in range(7))
    return {"rows": {"stream GB/s": buf.nbytes / best / 1e9}, "info": {}}


def _timed(f, *args) -> float:
    t0 = time.perf_counter()
    f(*args)
    return time.perf_counter() - t0


def llamacpp_worker(spec: dict, ids: np.ndarray) -> dict:
    import llama_cpp

    llm = llama_cpp.Llama(model_path=spec["model"], n_ctx=spec["n_ctx"],
                          n_threads=spec["threads"], n_threads_batch=spec["threads"],
                          n_batch=N_BATCH, n_ubatch=N_BATCH, flash_attn=spec["flash_attn"],
                          verbose=False)

    def run_prompt(chunk, fresh: bool) -> float:
        if fresh:
            llm.reset()  # eval then drops every cached cell past n_tokens = 0
        t0 = time.perf_counter()
        llm.eval(chunk.tolist())
        return time.perf_counter() - t0

    def run_token(tok) -> float:
        t0 = time.perf_counter()
        llm.eval(tok.tolist())
        return time.perf_counter() - t0

    rows = _measure(spec, ids, run_prompt, run_token)
    info = {"version": llama_cpp.__version__,
            "llama_cpp_commit": VENDORED.get(llama_cpp.__version__, "unknown"),
            "system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip(),
            "flash_attn": _flash_attn(llm)}
    return {"rows": rows, "info": info, "weight_bytes": gguf_weight_bytes(spec["model"])}


def _flash_attn(llm) -> str:
    p = llm.context_params
    for name in ("flash_attn_type", "flash_attn"):
        if hasattr(p, name):
            return f"{name}={getattr(p, name)}"
    return "unknown"


WORKERS = {"ours": ours_worker, "ours-int8": ours_worker, "llamacpp": llamacpp_worker,
           "stream": stream_worker}


def worker_env(spec: dict) -> dict:
    """The worker's environment: threads pinned, one OpenMP wait policy for both engines
    (None: the variable unset, OpenMP's default, whatever the caller's shell set)."""
    t = str(spec["threads"])
    env = os.environ | {"NUMBA_NUM_THREADS": t, "OMP_NUM_THREADS": t,
                        "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    env.pop("OMP_WAIT_POLICY", None)
    if spec["omp_wait_policy"] is not None:
        env["OMP_WAIT_POLICY"] = spec["omp_wait_policy"]
    return env


def run_worker(spec: dict) -> dict:
    """One engine on one file in a fresh process (`worker_env`)."""
    env = worker_env(spec)
    cmd = [sys.executable, __file__, "--worker", json.dumps(spec)]
    res = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    if res.returncode:
        raise SystemExit(f"worker failed: {' '.join(cmd)}\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


# --- the driver ---------------------------------------------------------------------------------
def text_ids(model_path, n: int, folder) -> Path:
    """The validation text's ids (repeated if it is short) through the file's tokenizer."""
    from gguf import GGUFReader

    from cfr_atlas.text import Tokenizer
    from cfr_atlas.validate import validation_text

    ids = Tokenizer.from_gguf(GGUFReader(model_path)).encode(validation_text())
    ids = np.resize(np.asarray(ids, dtype=np.int64), max(n, 34))
    path = Path(folder) / "ids.npy"
    np.save(path, ids)
    return path


def quick_model(folder) -> Path:
    """A 2-layer Q4_1 model (dim 64) standing in for the bundled one in --quick runs, its
    pre-tokenizer spelled "gpt-2" as llama.cpp knows it (the tiny writer's "gpt2" it refuses)."""
    from gguf import GGUFValueType

    from cfr_atlas.testing import rewrite_gguf, write_tiny_gguf

    tiny = write_tiny_gguf(Path(folder) / "tiny.gguf", qtype="Q4_1")
    return rewrite_gguf(tiny, Path(folder) / "tiny.Q4_1.gguf",
                        meta={"tokenizer.ggml.pre": ("gpt-2", GGUFValueType.STRING)})


def plans(a, files: dict, ids_path: Path) -> list[dict]:
    """Every worker run in order: rounds x formats x engines, the engine order flipping."""
    longest = max(max(a.prompts), a.contexts[-1] + a.decode_tokens)
    base = {"threads": a.threads, "prompts": a.prompts, "contexts": a.contexts,
            "repeats": a.repeats, "decode_tokens": a.decode_tokens, "ids": str(ids_path),
            "flash_attn": a.flash_attn == "on",
            "omp_wait_policy": (None if a.omp_wait_policy == "default"
                                else a.omp_wait_policy.upper()),
            "n_ctx": -(-(longest + 1) // 256) * 256}
    out = []
    for r in range(a.rounds):
        for i, (fmt, path) in enumerate(files.items()):
            engines = a.engines if (r + i) % 2 == 0 else a.engines[::-1]
            out += [base | {"round": r, "format": fmt, "engine": e, "model": str(path)}
                    for e in engines]
    return out


def collect(a, runs: list[dict]) -> list[dict]:
    """One row per (format, workload): medians over rounds, ratio, target, met."""
    rows = []
    for fmt in dict.fromkeys(r["format"] for r in runs):
        keys = [("prefill", n) for n in a.prompts] + [("decode", c) for c in a.contexts]
        for kind, n in keys:
            name = f"{kind} {n}" if kind == "prefill" else f"decode @{n}"
            row = {"format": fmt, "kind": kind, "n": n, "workload": name,
                   "target": target(kind, n)}
            for e in ENGINES:
                mine = [r for r in runs if r["format"] == fmt and r["engine"] == e]
                got = [r["rows"][name] for r in mine]
                row[e] = statistics.median(got) if got else None
                row[f"{e}_runs"] = got
                row[f"{e}_weight_bytes"] = mine[0].get("weight_bytes") if mine else None
            for e, key in OURS.items():
                both = row[e] is not None and row["llamacpp"] is not None
                row[f"ratio{key}"] = row[e] / row["llamacpp"] if both else None
                row[f"met{key}"] = row[f"ratio{key}"] >= row["target"] if both else None
            rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    """Markdown: each of our engines that ran, its tok/s and its ratio to llama.cpp."""
    ours = [e for e in OURS if any(r[e] is not None for r in rows)]
    cols = [c for e in ours for c in (f"{NAMES[e]} tok/s", "ratio", "met")]
    head = ("| format | workload | llama.cpp tok/s | " + " | ".join(cols) + " | target |\n"
            + "|---" * (len(cols) + 4) + "|")
    lines = [head]

    def num(v, fmt):
        return "-" if v is None else format(v, fmt)

    for r in rows:
        cells = []
        for e in ours:
            met = r[f"met{OURS[e]}"]
            cells += [num(r[e], ".1f"), num(r[f"ratio{OURS[e]}"], ".2f"),
                      "-" if met is None else ("yes" if met else "NO")]
        lines.append(f"| {r['format']} | {r['workload']} | {num(r['llamacpp'], '.1f')} | "
                     + " | ".join(cells) + f" | >= {r['target']:.1f} |")
    return "\n".join(lines)


def bandwidth_table(rows: list[dict], stream: float) -> str:
    """Markdown, decode rows: per engine the weight bytes a token streams, the GB/s that makes
    at the measured tok/s, and its share of the machine's read bandwidth (`stream_worker`);
    `bound` = the tok/s of streaming those bytes at that bandwidth, nothing else done. K/V,
    activations and the embedding row are not counted, so long contexts read more."""
    engines = [e for e in ENGINES if any(r[e] is not None for r in rows)]
    head = ("| format | workload | " + " | ".join(
        f"{NAMES[e]} MB / token | GB/s | of stream | bound tok/s" for e in engines) + " |\n"
            + "|---" * (2 + 4 * len(engines)) + "|")
    lines = [head]
    for r in rows:
        if r["kind"] != "decode":
            continue
        cells = []
        for e in engines:
            b, tps = r[f"{e}_weight_bytes"], r[e]
            if b is None or tps is None:
                cells += ["-"] * 4
                continue
            gbs = b * tps / 1e9
            cells += [f"{b / 1e6:.1f}", f"{gbs:.1f}", f"{gbs / stream:.2f}",
                      f"{stream * 1e9 / b:.0f}"]
        lines.append(f"| {r['format']} | {r['workload']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows: list[dict], path) -> None:
    """Tokens/s vs context tokens, one panel per format: decode solid, prefill dashed,
    cfr-atlas blue, its int8 arithmetic orange, llama.cpp green."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    formats = list(dict.fromkeys(r["format"] for r in rows))
    fig, axes = plt.subplots(1, len(formats), figsize=(5 * len(formats), 4.2), squeeze=False)
    for ax, fmt in zip(axes[0], formats, strict=True):
        for j, e in enumerate(ENGINES):
            for kind, style in (("decode", "o-"), ("prefill", "s--")):
                sel = [r for r in rows if r["format"] == fmt and r["kind"] == kind and r[e]]
                if sel:
                    ax.plot([r["n"] for r in sel], [r[e] for r in sel], style, color=f"C{j}",
                            label=f"{NAMES[e]} {kind}")
        ax.set(xscale="log", yscale="log", title=fmt, xlabel="context / prompt tokens",
               ylabel="tokens/s (median)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def machine() -> dict:
    cpu = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((ln.split(":", 1)[1].strip() for ln in cpu.splitlines()
                  if ln.startswith("model name")), "unknown")
    flags = next((ln.split(":", 1)[1].split() for ln in cpu.splitlines()
                  if ln.startswith("flags")), [])
    wanted = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8")
    return {"cpu": model, "cpu_flags": [f for f in wanted if f in flags],
            "cores": os.cpu_count(), "loadavg_start": list(os.getloadavg())}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ints = lambda s: sorted(int(x) for x in s.split(",") if x)  # noqa: E731
    ap.add_argument("--model", default=None, help="Q4_1 GGUF (default: the bundled SmolLM2)")
    ap.add_argument("--formats", type=lambda s: s.split(","), default=["Q4_1", "Q4_0", "Q8_0"])
    ap.add_argument("--engines", type=lambda s: s.split(","), default=list(ENGINES),
                    help="ours (float arithmetic, the default), ours-int8 (matmul='int8'), "
                         "llamacpp (dropped if llama_cpp is not importable); default: all")
    ap.add_argument("--flash-attn", choices=["on", "off"], default="on",
                    help="llama.cpp's flash attention (on: what its default 'auto' picks)")
    ap.add_argument("--omp-wait-policy", choices=["default", "active", "passive"],
                    default="default",
                    help="OMP_WAIT_POLICY of both engines' workers (default: unset, OpenMP's "
                         "own; active on a quiet machine, passive on a busy one)")
    ap.add_argument("--threads", type=int, default=2, help="threads for both engines")
    ap.add_argument("--rounds", type=int, default=2, help="worker runs per cell (median)")
    ap.add_argument("--repeats", type=int, default=3, help="prefill repeats per run (median)")
    ap.add_argument("--decode-tokens", type=int, default=16, help="decode steps timed (median)")
    ap.add_argument("--prompts", type=ints, default=[512, 2048], help="prefill lengths")
    ap.add_argument("--contexts", type=ints, default=[16, 2048, 6000], help="decode contexts")
    ap.add_argument("--quick", action="store_true",
                    help="tiny generated model, prompts 32,64, contexts 16,64, 2 decode tokens, "
                         "1 round, 1 repeat (keeps the script from rotting; not a measurement)")
    ap.add_argument("--plot", default=None, help="write tokens/s vs context (PNG)")
    ap.add_argument("--json", default=None, help="write meta and rows as JSON")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.quick:
        a.prompts, a.contexts, a.decode_tokens, a.rounds, a.repeats = [32, 64], [16, 64], 2, 1, 1
    bad = [e for e in a.engines if e not in ENGINES]
    if bad or min(a.threads, a.rounds, a.repeats, a.decode_tokens) < 1:
        ap.error(f"engines {bad} unknown (choose from {ENGINES}), or threads/rounds/repeats/"
                 f"decode-tokens < 1")
    gaps = np.diff([0, *a.contexts])
    if not a.prompts or not a.contexts or gaps[0] < 1 or (gaps[1:] < a.decode_tokens).any():
        ap.error(f"need prompts and contexts >= 1, contexts {a.contexts} at least "
                 f"--decode-tokens {a.decode_tokens} apart")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.worker:
        spec = json.loads(a.worker)
        print(json.dumps(WORKERS[spec["engine"]](spec, np.load(spec["ids"]))))
        return 0
    meta = machine() | {"threads": a.threads, "omp_wait_policy": a.omp_wait_policy,
                        "flash_attn": a.flash_attn, "rounds": a.rounds, "repeats": a.repeats,
                        "decode_tokens": a.decode_tokens, "quick": a.quick}
    if "llamacpp" in a.engines and importlib.util.find_spec("llama_cpp") is None:
        a.engines = [e for e in a.engines if e != "llamacpp"]
        meta["skipped"] = "llama.cpp: llama_cpp (llama-cpp-python) is not importable"
    from requant import variants

    with tempfile.TemporaryDirectory() as tmp:
        from cfr_atlas.models.gguf_io import bundled_model_path

        src = quick_model(tmp) if a.quick else Path(a.model or bundled_model_path())
        files = variants(src, tmp, a.formats)
        ids = text_ids(src, max(max(a.prompts), a.contexts[-1] + a.decode_tokens), tmp)
        runs = []
        stream_spec = {"engine": "stream", "threads": a.threads, "ids": str(ids),
                       "omp_wait_policy": None, "stream_bytes": (64 if a.quick else 1024) << 20}
        streams = [run_worker(stream_spec)["rows"]["stream GB/s"]]
        for spec in plans(a, files, ids):
            print(f"round {spec['round']}: {spec['format']} {NAMES[spec['engine']]}",
                  file=sys.stderr, flush=True)
            got = run_worker(spec)
            runs.append(spec | got)
            print("  " + ", ".join(f"{k} {v:.1f}" for k, v in got["rows"].items()),
                  file=sys.stderr, flush=True)
            meta.setdefault(f"{spec['engine']}_info", got["info"])
        streams.append(run_worker(stream_spec)["rows"]["stream GB/s"])
    meta["stream_gbs"] = streams
    meta["loadavg_end"] = list(os.getloadavg())
    rows = collect(a, runs)
    print(f"{meta['cpu']} ({', '.join(meta['cpu_flags'])}), {a.threads} threads, medians of "
          f"{a.rounds} round(s); load average {meta['loadavg_start'][0]:.2f} at start, "
          f"{meta['loadavg_end'][0]:.2f} at end")
    if "llamacpp_info" in meta:
        info = meta["llamacpp_info"]
        print(f"llama-cpp-python {info['version']} ({info['llama_cpp_commit']}, "
              f"{info['flash_attn']}): {info['system_info']}")
    if max(meta["loadavg_start"][0], meta["loadavg_end"][0]) > a.threads:
        print("WARNING: the machine was busy (load average above --threads): compare within "
              "this run only, and expect ratios to move on a quiet machine")
    print(table(rows))
    if streams:
        stream = statistics.median(streams)
        print(f"\nDecode against memory bandwidth: a {a.threads}-thread read of a 1 GiB buffer "
              f"ran {', '.join(f'{g:.1f}' for g in streams)} GB/s (before, after the runs); "
              f"weights only:")
        print(bandwidth_table(rows, stream))
    if "skipped" in meta:
        print(f"(skipped {meta['skipped']}: run benchmarks/install_llama_cpp.sh to compare)")
    if a.json:
        Path(a.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    if a.plot:
        plot(rows, a.plot)
        print(f"wrote {a.plot}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # its sibling requant.py
    raise SystemExit(main())
