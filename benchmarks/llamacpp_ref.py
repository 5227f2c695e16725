"""llama.cpp as a reference for conformance scripts: its tokenization and its logits.

    import sys; sys.path.insert(0, "benchmarks")
    from llamacpp_ref import llamacpp_tokenize, llamacpp_logits

    ids = llamacpp_tokenize(path, "Hello world", add_bos=True, special=False)   # list[int]
    logits = llamacpp_logits(path, ids)            # (len(ids), n_vocab) float32, every position

Needs llama-cpp-python (the `bench` extra; build it with benchmarks/install_llama_cpp.sh);
`import llama_cpp` fails with ImportError otherwise, so callers can skip. Any GGUF llama.cpp
loads works (Gemma 3, Qwen2.5, ...), not only the families cfr-atlas runs.

  * `llamacpp_tokenize` loads the vocabulary only (vocab_only=True, fast). add_bos=True
    prepends BOS only if the file's tokenizer.ggml.add_bos_token asks for it (llama.cpp's
    rule); special=True parses control-token text such as `<|im_start|>` into control tokens.
  * `llamacpp_logits` evaluates `ids` from an empty K/V cache with logits_all=True and returns
    the row after each position (row i predicts token i + 1). n_ctx defaults to len(ids); the
    logits buffer is n_ctx x n_vocab float32 (2,048 x 262,144 = 2 GiB for Gemma 3), so keep
    n_ctx small. llama.cpp's results depend on its batch split: n_batch = n_ubatch = 512 here,
    f16 K/V, `threads` threads (default: all cores).
  * Loaded models are cached per (path, n_ctx, threads), the last two kept; each call clears
    the K/V cache first, so calls are independent.
This module does no comparing: the caller decides what agreement means (docs/CONFORMANCE.md).
"""

from __future__ import annotations

import os
from functools import lru_cache

import numpy as np

N_BATCH = 512


@lru_cache(maxsize=2)
def _vocab(path: str):
    import llama_cpp

    return llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)


@lru_cache(maxsize=2)
def _context(path: str, n_ctx: int, threads: int):
    import llama_cpp

    return llama_cpp.Llama(model_path=path, n_ctx=n_ctx, n_batch=min(N_BATCH, n_ctx),
                           n_ubatch=min(N_BATCH, n_ctx), n_threads=threads,
                           n_threads_batch=threads, logits_all=True, verbose=False)


def llamacpp_tokenize(path, text: str, add_bos: bool = True, special: bool = False) -> list[int]:
    """Text -> llama.cpp's token ids for the GGUF at `path` (see the module docstring)."""
    return list(_vocab(str(path)).tokenize(text.encode("utf-8"), add_bos=add_bos,
                                           special=special))


def llamacpp_logits(path, ids, n_ctx: int | None = None, threads: int | None = None
                    ) -> np.ndarray:
    """Next-token logits of llama.cpp after every position of `ids`: (len(ids), n_vocab)
    float32, from an empty K/V cache. n_ctx (default len(ids)) must hold all of `ids`."""
    ids = [int(t) for t in ids]
    n_ctx = len(ids) if n_ctx is None else n_ctx
    if not ids or len(ids) > n_ctx:
        raise ValueError(f"need 1 <= len(ids) <= n_ctx, got {len(ids)} ids and n_ctx {n_ctx}")
    llm = _context(str(path), n_ctx, threads or os.cpu_count() or 1)
    llm.reset()  # eval drops every cached cell past n_tokens = 0
    llm.eval(ids)
    return np.array(llm.scores[:len(ids)], dtype=np.float32)
