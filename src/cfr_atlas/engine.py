"""`Model`: the user-facing handle — `load_model()`, tokenize, logits, generate, stream, chat.

It glues a model family, the tokenizer and chat template from the same GGUF, sessions (K/V
state under an optional budget) and the generation iterator. Every entry point builds a fresh
`Session`, so calls are independent; `last_telemetry` describes the most recent one.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Iterator

import numpy as np

from cfr_atlas.generate import DEFAULT_CHUNK, Generation, check_ids, prefill
from cfr_atlas.models import tile_cache as tile_files
from cfr_atlas.models.expert_memory import expert_options
from cfr_atlas.models.families import load_net
from cfr_atlas.models.gguf_io import GGUFFile, bundled_model_path
from cfr_atlas.models.prefix import DEFAULT_DISK_BYTES, PrefixTier, default_prefix_dir
from cfr_atlas.models.session import Session, parse_bytes
from cfr_atlas.ops import rms_norm
from cfr_atlas.sampling import SamplingParams
from cfr_atlas.text import ChatTemplate, Tokenizer


def load_model(path: str | os.PathLike | None = None, *,
               prefix_cache: str | os.PathLike | bool | None = None,
               prefix_cache_bytes: int | str = DEFAULT_DISK_BYTES,
               prefix_store: str | None = None, prefix_store_ttl: int | None = None,
               matmul: str = "float", expert_budget: int | str | None = None,
               expert_policy: str = "lru", routing_profile: dict | None = None,
               expert_reads: str = "auto",
               tile_cache: str | os.PathLike | bool | None = None) -> Model:
    """Load a GGUF model (default: the bundled SmolLM2-135M-Instruct Q4_1).

    matmul: "float" (float32 activations times the dequantized weights) or "int8" (activations
    quantized to int8 per 32-element block, integer block dots, as llama.cpp; Q4_0, Q4_1,
    Q8_0, Q5_0, Q5_1, IQ4_NL, Q3_K, Q4_K, Q5_K and Q6_K weights, the output head with ~15-bit
    activations in two integer passes; Q2_K stays float). Both are batch invariant bit for bit.

    prefix_cache: a folder for the persistent prefix cache (True: the per-user default,
    ~/.cache/cfr-atlas/prefix); prompts that start with cached whole blocks skip recomputing
    them, with bitwise the same results. None (default): no prefix cache.
    prefix_cache_bytes: the folder's byte budget (default 8 GiB; an int or e.g. "2GiB"); block
    files beyond it are evicted least recently used first, whichever model wrote them.
    prefix_store: a Redis URL (redis://HOST:PORT/DB) for a prefix tier below RAM and disk that
    every replica pointing at it shares (kv/redis_store.py, docs/SCALING.md); works with or
    without `prefix_cache`. Redis being down or slow only costs cache hits.
    prefix_store_ttl: seconds a block stays in Redis after its last use (None: until Redis's
    own maxmemory eviction).

    expert_budget (MoE models only): bytes for routed-expert weights (an int, "256MiB" or a
    share of all experts such as "50%"); None keeps every expert resident. Any budget gives
    bitwise the same logits (docs/MOE.md). expert_policy: "lru", "frequency" or "pinned"
    (pins the experts most chosen in `routing_profile`, {(layer, expert): count}).
    expert_reads: how a budgeted store reads experts that are not in the OS page cache:
    "cached" through it (read-ahead advice, then the mapped file), "direct" off the disk into
    small staging buffers by a pool of reader threads (O_DIRECT), "auto" (default) direct when
    the experts' file bytes exceed the memory left beside the pool. Output does not change.

    tile_cache: where the repacked weight tiles are kept for the next load, which maps them
    instead of repacking (models/tile_cache.py; bitwise the same tiles, checksummed). None
    (default): the per-user folder (~/.cache/cfr-atlas/tiles), for models whose tiles take at
    most 2 GiB; True: that folder, any size; a folder: there, any size; False: no cache.
    """
    _start_kernel_runtime()
    return Model(GGUFFile(path if path is not None else bundled_model_path()),
                 prefix_cache=prefix_cache, prefix_cache_bytes=prefix_cache_bytes,
                 prefix_store=prefix_store, prefix_store_ttl=prefix_store_ttl, matmul=matmul,
                 expert_budget=expert_budget, expert_policy=expert_policy,
                 routing_profile=routing_profile, expert_reads=expert_reads,
                 tile_cache=tile_cache)


def _start_kernel_runtime() -> None:
    """Start numba's one-time set-up on a daemon thread, so it overlaps reading the file, the
    repack and the tokenizer instead of delaying the first forward pass. The first kernel call
    of a process builds numba's typing and target contexts and its runtime module (~0.35 s of
    the bundled model's ~2 s start-up, measured in docs/PERFORMANCE.md "Start-up"); one tiny
    rms_norm does it, with the overload the forward pass uses. Numba's compiler lock orders it
    with the main thread's kernel calls; a failure here is left for the first real call to
    raise, with its own traceback."""
    threading.Thread(target=_touch_kernels, name="cfr-atlas-jit-setup", daemon=True).start()


def _touch_kernels() -> None:
    try:
        rms_norm(np.ones((1, 8), dtype=np.float32), np.ones(8, dtype=np.float32), 1e-5)
    except Exception:  # the main thread's own kernel call reports it
        pass


def _tile_cache(gf: GGUFFile, matmul: str, tile_cache,
                read: bool = True) -> tile_files.TileCache | None:
    """The TileCache `load_model`'s tile_cache option asks for (None when False, or when the
    cache cannot be set up: that only costs the repack); read=False: repack and rewrite."""
    if tile_cache is False:
        return None
    default = tile_cache is None or tile_cache is True
    folder = tile_files.default_dir() if default else tile_cache
    try:
        return tile_files.TileCache(folder, gf.identity(), matmul, max_bytes=(
            tile_files.DEFAULT_MAX_BYTES if tile_cache is None else None), read=read)
    except OSError:
        return None


def _identity(file_identity: str, matmul: str) -> str:
    """What cached K/V is keyed by: the file's content hash, and the matmul arithmetic when it
    is not float (int8 K/V differ from float K/V, so the two never share prefix blocks)."""
    if matmul == "float":
        return file_identity
    return hashlib.sha256(f"{file_identity}:matmul={matmul}".encode()).hexdigest()


class Model:
    """A loaded model with its tokenizer; see the module docstring."""

    def __init__(self, gf: GGUFFile, *, prefix_cache=None,
                 prefix_cache_bytes: int | str = DEFAULT_DISK_BYTES, prefix_store=None,
                 prefix_store_ttl: int | None = None, matmul: str = "float",
                 expert_budget: int | str | None = None, expert_policy: str = "lru",
                 routing_profile: dict | None = None, expert_reads: str = "auto",
                 tile_cache=None):
        self.path = gf.path
        experts = expert_options(gf, expert_budget, expert_policy, routing_profile,
                                 expert_reads)
        gf.tile_cache = _tile_cache(gf, matmul, tile_cache)
        self.net = load_net(gf, matmul=matmul, **experts)  # the family's class, by architecture
        self.tokenizer = Tokenizer.from_gguf(gf.reader)  # while the tile cache's sum is checked
        self.chat_template = ChatTemplate.from_gguf(gf.reader, self.tokenizer)
        if gf.tile_cache is not None and not gf.tile_cache.verify():  # damaged: repack
            gf.tile_cache = _tile_cache(gf, matmul, tile_cache, read=False)
            self.net = load_net(gf, matmul=matmul, **experts)
        if gf.tile_cache is not None:
            gf.tile_cache.save()  # a first load: the tiles it repacked, for the next one
        gf.tile_cache = None
        self.identity = _identity(gf.identity(), matmul)
        self.net.identity = self.identity
        self.config = self.net.config
        folder = default_prefix_dir() if prefix_cache is True else prefix_cache
        disk_bytes = parse_bytes(prefix_cache_bytes, "prefix_cache_bytes")
        self.prefix = None
        if folder or prefix_store:
            self.prefix = PrefixTier(self.net, self.identity, folder or None,
                                     disk_bytes=disk_bytes, store=prefix_store,
                                     store_ttl=prefix_store_ttl)
        self.last_telemetry: dict = {}

    def prefix_store_stats(self):
        """The shared prefix store's counters (`RemoteStats`), or None without one."""
        remote = None if self.prefix is None else self.prefix.remote
        return None if remote is None else remote.stats()

    @property
    def experts(self):
        """An MoE model's ExpertStore (None for a dense model)."""
        return getattr(self.net, "experts", None)

    def _with_experts(self, telemetry: dict) -> dict:
        """A call's telemetry plus the expert store's counters (MoE models)."""
        if self.experts is None:
            return telemetry
        return {**telemetry, **self.experts.telemetry.summary()}

    # --- text ------------------------------------------------------------------------------
    def tokenize(self, text: str, *, special: bool = False) -> list[int]:
        """Text -> ids. Control-token text in `text` stays text unless `special=True` (for a
        prompt you templated yourself: then `<|im_start|>` becomes the control token)."""
        return self.tokenizer.encode(text, special=special)

    def detokenize(self, ids) -> str:
        return self.tokenizer.decode(list(ids))

    # --- sessions and logits ---------------------------------------------------------------
    def session(self, **kv) -> Session:
        """A fresh sequence: kv_budget, regenerator, policy, storage_dtype (default "float16"),
        page_tokens, cache_dir, context_limit, cache_salt (see `Session`). Every method below
        that takes `**kv` passes them here; `cache_salt` (str, default "" = none) keys the prefix
        cache's blocks, so requests with different salts never share cached K/V."""
        return Session(self.net, prefix=self.prefix, **kv)

    def _sized(self, n_tokens: int, kv: dict) -> dict:
        """Session options for a sequence that will hold at most `n_tokens` tokens: the
        context limit (unless given) is that, so budgeted buffers are sized to it."""
        return {"context_limit": min(n_tokens, self.config.context_length), **kv}

    def logits(self, ids, *, chunk_tokens: int = DEFAULT_CHUNK, **kv) -> np.ndarray:
        """Next-token logits at every position: (len(ids), vocab) float32."""
        ids = check_ids(ids, self.config.vocab_size)
        with _closing(self.session(**self._sized(len(ids), kv))) as s:
            out = prefill(self.net, s, ids, chunk_tokens=chunk_tokens, all_logits=True)
            self.last_telemetry = self._with_experts(s.telemetry_summary())
        return out

    def next_logits(self, ids, *, chunk_tokens: int = DEFAULT_CHUNK, **kv) -> np.ndarray:
        """Logits after the whole prompt: (vocab,) float32 == logits(ids)[-1]."""
        ids = check_ids(ids, self.config.vocab_size)
        with _closing(self.session(**self._sized(len(ids), kv))) as s:
            out = prefill(self.net, s, ids, chunk_tokens=chunk_tokens)[0]
            self.last_telemetry = self._with_experts(s.telemetry_summary())
        return out

    def embedding(self, text: str | list[int], **kv) -> np.ndarray:
        """Mean of the final normalized hidden states over the input, L2-normalized: (dim,).

        Session options (kv_budget, regenerator, cache_dir, ...) apply as for `logits`: under
        a kv_budget the K/V really allocated stays within it (see `last_telemetry`)."""
        ids = check_ids(self.tokenize(text) if isinstance(text, str) else text,
                        self.config.vocab_size)
        with _closing(self.session(**{"context_limit": len(ids), **kv})) as s:
            h = np.concatenate([self.net.forward_chunk(s, ids[a:a + DEFAULT_CHUNK], hidden=True)
                                for a in range(0, len(ids), DEFAULT_CHUNK)])
            self.last_telemetry = self._with_experts(s.telemetry_summary())
        return mean_pool(h)

    # --- generation ------------------------------------------------------------------------
    def stream(self, prompt: str | list[int], *, max_tokens: int = 128, temperature: float = 0.0,
               top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
               repeat_penalty: float = 1.0, repeat_last_n: int = 64, seed: int | None = None,
               stop=(), chunk_tokens: int = DEFAULT_CHUNK, **kv) -> Iterator[str]:
        """Yield text pieces as they are generated (never a broken UTF-8 character).

        Driven by `generate.Generation`, as the server is. Afterwards `last_telemetry` holds
        the session's K/V summary plus `prompt_tokens`, `generated_tokens`, `prefill_seconds`
        and `decode_seconds` (each phase's own steps; `seconds` is their sum) and
        `logits_sha256`, a fingerprint of every sampled step's logits.

        A str prompt is text (control-token text in it stays text); for a chat pass
        `chat_ids(messages)`, for a prompt you templated yourself `tokenize(p, special=True)`.
        """
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                repeat_penalty=repeat_penalty, repeat_last_n=repeat_last_n,
                                seed=seed)
        ids = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        with _closing(self.session(**self._sized(len(ids) + max_tokens, kv))) as s:
            run = Generation(self.net, s, ids, params, max_tokens=max_tokens,
                             tokenizer=self.tokenizer, stops=stop, chunk_tokens=chunk_tokens)
            for event in run.events():
                if event.text:
                    yield event.text
            self.last_telemetry = self._with_experts(run.telemetry())

    def generate(self, prompt: str | list[int], **kw) -> str:
        """The whole completion as one string (same options as `stream`)."""
        return "".join(self.stream(prompt, **kw))

    def chat_prompt(self, messages) -> str:
        """The rendered chat template, for display; tokenize messages with `chat_ids`."""
        return self.chat_template.render(messages, add_generation_prompt=True)

    def chat_ids(self, messages) -> list[int]:
        """Prompt ids of a chat: the template's literals are control tokens, the messages'
        text is text (a message cannot forge `<|im_start|>system`)."""
        return self.chat_template.encode(self.tokenizer, messages, add_generation_prompt=True)

    def chat(self, messages, **kw) -> str:
        """Reply to a list of {"role", "content"} messages using the GGUF's chat template."""
        return self.generate(self.chat_ids(messages), **kw)


def mean_pool(hidden: np.ndarray) -> np.ndarray:
    """Final hidden states (T, dim) -> their mean in float64, L2-normalized, as float32."""
    v = hidden.astype(np.float64).mean(axis=0)
    return (v / max(np.linalg.norm(v), 1e-12)).astype(np.float32)


class _closing:
    def __init__(self, session: Session):
        self.session = session

    def __enter__(self) -> Session:
        return self.session

    def __exit__(self, *exc) -> None:
        self.session.close()
