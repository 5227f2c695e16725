"""Server throughput and latency under N concurrent greedy streams (continuous batching).

    python benchmarks/bench_serve.py [--model PATH] [--clients 1,2,4,8] [--tokens 64]
                                     [--matmul float|int8] [--plot PATH] [--json PATH]

Starts `cfr-atlas serve` in its own process (default: the bundled model; max-active = the
largest N), warms it up, then for each N runs N clients at once, each streaming one greedy
/api/generate of `--tokens` tokens from its own fixed prompt. Prints one table: aggregate
tokens/s (every client's generated tokens over the wall time from the first request to the
last answer), its ratio to one stream, and p50/p95 of the time to first token and of the gap
between streamed tokens. One run on one machine: compare rows within the run, not across runs.
`--in-process` adds a second table without the server: the median time of one batched decode
step (`forward_batch` of N single tokens) in this process, the ceiling batching can reach.
`--matmul` picks the arithmetic of both (the server's `--matmul`, `load_model(matmul=...)`).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time

import httpx


def prompts(n: int) -> list[str]:
    """n fixed prompts: 30-word slices of the bundled validation text (prose continuations,
    so greedy streams of the bundled model run their full length instead of stopping early)."""
    from cfr_atlas.validate import validation_text

    words = validation_text().split()
    return [" ".join(words[i * 40:i * 40 + 30]) for i in range(n)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str | None, max_active: int,
                 matmul: str = "float") -> tuple[subprocess.Popen, str]:
    """`cfr-atlas serve` in a child process; returns it and its URL once it answers."""
    port = _free_port()
    cmd = [sys.executable, "-m", "cfr_atlas.cli", "serve", "--port", str(port), "--name",
           "bench", "--max-active", str(max_active), "--max-queue", str(2 * max_active),
           "--matmul", matmul]
    proc = subprocess.Popen(cmd + (["--model", model] if model else []), env=os.environ.copy(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url, end = f"http://127.0.0.1:{port}", time.monotonic() + 300
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited: {proc.stderr.read()[-2000:]}")
        try:
            httpx.get(url + "/api/version", timeout=1)
            return proc, url
        except httpx.TransportError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("the server did not answer within 300 s")


def stream_one(url: str, prompt: str, tokens: int, start: threading.Barrier) -> dict:
    """One greedy stream: request start, arrival time of every streamed line, token count.
    The client (an httpx.Client, as the official clients hold one) is made before the start:
    making one costs ~20 ms of CPU (its TLS context), which is the client's, not the
    server's, and would land on the server's cores here, N at once."""
    body = {"model": "bench", "prompt": prompt, "raw": True, "stream": True,
            "options": {"num_predict": tokens, "temperature": 0}}
    try:
        client = httpx.Client(timeout=600)
    except BaseException:
        start.abort()  # the other clients' waits raise instead of waiting forever
        raise
    with client:
        start.wait()
        t0, arrivals, count = time.perf_counter(), [], 0
        with client.stream("POST", url + "/api/generate", json=body) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                msg = json.loads(line)
                if msg.get("error"):
                    raise RuntimeError(msg["error"])
                if msg.get("done"):
                    count = msg["eval_count"]
                elif msg.get("response"):
                    arrivals.append(time.perf_counter())
        end = time.perf_counter()
    return {"t0": t0, "arrivals": arrivals, "tokens": count, "end": end}


def run_clients(url: str, n: int, tokens: int) -> dict:
    """N streams started together -> aggregate tokens/s and latency percentiles (ms)."""
    barrier, out, texts = threading.Barrier(n), [None] * n, prompts(n)

    def client(i):
        out[i] = stream_one(url, texts[i], tokens, barrier)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = max(r["end"] for r in out) - min(r["t0"] for r in out)
    ttft = [(r["arrivals"][0] - r["t0"]) * 1e3 for r in out if r["arrivals"]]
    gaps = [(b - a) * 1e3 for r in out for a, b in itertools.pairwise(r["arrivals"])]
    return {"clients": n, "tokens": sum(r["tokens"] for r in out), "seconds": wall,
            "tokens_per_s": sum(r["tokens"] for r in out) / wall,
            "ttft_p50": _pct(ttft, 50), "ttft_p95": _pct(ttft, 95),
            "token_p50": _pct(gaps, 50), "token_p95": _pct(gaps, 95)}


def _pct(values: list[float], q: int) -> float:
    if len(values) < 2:
        return values[0] if values else float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def table(rows: list[dict]) -> str:
    one = rows[0]["tokens_per_s"] if rows and rows[0]["clients"] == 1 else float("nan")
    lines = ["| clients | tokens | tokens/s | x one stream | TTFT p50 ms | TTFT p95 ms "
             "| per-token p50 ms | per-token p95 ms |", "|---:" * 8 + "|"]
    for r in rows:
        lines.append(f"| {r['clients']} | {r['tokens']} | {r['tokens_per_s']:.1f} | "
                     f"{r['tokens_per_s'] / one:.2f} | {r['ttft_p50']:.0f} | "
                     f"{r['ttft_p95']:.0f} | {r['token_p50']:.1f} | {r['token_p95']:.1f} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = [r["clients"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(n, [r["tokens_per_s"] for r in rows], "o-")
    a.set(xlabel="concurrent greedy streams", ylabel="aggregate tokens/s", xticks=n,
          title="throughput")
    for key, label in (("token_p50", "per token p50"), ("token_p95", "per token p95"),
                       ("ttft_p50", "first token p50"), ("ttft_p95", "first token p95")):
        b.plot(n, [r[key] for r in rows], "o-", label=label)
    b.set(xlabel="concurrent greedy streams", ylabel="ms", xticks=n, title="latency",
          yscale="log")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def in_process(model_path: str | None, counts: list[int], repeats: int = 7,
               matmul: str = "float") -> str:
    """Median wall time of one `forward_batch` decode step of N sequences (after a 40-token
    prompt each), steps of different N interleaved so drifting load hits them alike."""
    import numpy as np

    from cfr_atlas.engine import load_model
    from cfr_atlas.models.batch import BatchItem

    model = load_model(model_path, matmul=matmul)
    sessions = [model.session() for _ in range(max(counts))]
    for s, text in zip(sessions, prompts(len(sessions)), strict=True):
        model.net.forward_chunk(s, np.array(model.tokenize(text)[:40]), all_logits=False)
    token, times = np.array([42], dtype=np.int64), {n: [] for n in counts}
    for _ in range(repeats):
        for n in counts:
            t0 = time.perf_counter()
            model.net.forward_batch([BatchItem(s, token) for s in sessions[:n]])
            times[n].append(time.perf_counter() - t0)
    for s in sessions:
        s.close()
    one = 1 / statistics.median(times[counts[0]]) * counts[0]
    lines = ["| sequences | ms per step | tokens/s | x first row |", "|---:" * 4 + "|"]
    for n in counts:
        t = statistics.median(times[n])
        lines.append(f"| {n} | {t * 1e3:.1f} | {n / t:.1f} | {n / t / one:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="GGUF path (default: the bundled model)")
    ap.add_argument("--clients", default="1,2,4,8", help="comma-separated N (default 1,2,4,8)")
    ap.add_argument("--tokens", type=int, default=64, help="tokens per stream (default 64)")
    ap.add_argument("--plot", default=None, metavar="PATH", help="write a PNG of the table")
    ap.add_argument("--json", default=None, metavar="PATH", help="write the rows as JSON")
    ap.add_argument("--matmul", default="float", choices=["float", "int8"],
                    help="the weight products' arithmetic (default float, as the server's)")
    ap.add_argument("--in-process", action="store_true",
                    help="also time batched decode steps without the server")
    a = ap.parse_args(argv)
    counts = [int(x) for x in a.clients.split(",")]
    proc, url = start_server(a.model, max(counts), a.matmul)
    try:
        # warm-up at the largest N: every kernel a timed row calls is compiled or loaded
        # first (N prompts prefilled together reach the threaded activation quantizer)
        run_clients(url, max(counts), 4)
        rows = [run_clients(url, n, a.tokens) for n in counts]
    finally:
        proc.terminate()
        proc.wait(30)
    print(f"bench_serve: {a.tokens} greedy tokens per stream, "
          f"{os.cpu_count()} CPUs visible, model {a.model or 'bundled'}, matmul {a.matmul}")
    print(table(rows))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    if a.plot:
        plot(rows, a.plot)
        print(f"plot: {a.plot}")
    if a.in_process:
        print("\nforward_batch decode step alone (no server), median of 7:")
        print(in_process(a.model, counts, matmul=a.matmul))
    return 0


if __name__ == "__main__":
    sys.exit(main())
