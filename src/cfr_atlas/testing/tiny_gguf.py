"""Tiny random GGUF models for tests and benchmarks, laid out the way llama.cpp's converter does it.

`write_tiny_gguf` writes one complete llama or qwen2 file: the metadata keys llama.cpp reads, a
small byte-level GPT-2 BPE tokenizer (256 byte symbols, a few hundred English merges, ChatML
special tokens and chat template) and random weights in any supported quant type.
`tiny_model_path` caches written files per directory and parameter set.

The contract a tiny file carries (and tests/models/reference.py computes with):
  * arch "llama" uses NORM rope (adjacent pairs x[2i], x[2i+1]); "qwen2" uses NEOX rope (split
    halves x[i], x[i + n_rot/2]) and has F32 `.bias` tensors on attn_q/attn_k/attn_v.
  * A matrix W of shape (n_out, n_in) is written row-major, so GGUF `ne = [n_in, n_out]` and the
    quant blocks run along n_in. Norm weights and biases are always F32.
  * The same seed draws the same float weights whatever the qtype, so an F32 and a Q4_0 file with
    one seed differ only by quantization error.
  * Optional RoPE scaling as llama.cpp's converter writes it: `rope_freq_factors` becomes the F32
    tensor `rope_freqs.weight` (n_rot/2,) (`llama3_rope_factors` computes Llama 3.1's), and
    `rope_scaling_type` / `rope_scaling_factor` the `{arch}.rope.scaling.*` keys, any string.

This module holds no forward pass and imports nothing of the engine, so the engine is always
tested against files it did not write itself.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import math
import os
from itertools import pairwise
from pathlib import Path

import numpy as np
from gguf import (
    GGML_QUANT_VERSION,
    GGMLQuantizationType,
    GGUFReader,
    GGUFValueType,
    GGUFWriter,
    LlamaFileType,
    TokenType,
)
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import quantize

from cfr_atlas.errors import ConfigError

ARCHS = ("llama", "qwen2")
SUPPORTED_QTYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")
# Roles of the 2D matrices; a `qtype` dict maps some of these to a type, the rest get Q8_0.
MATRIX_ROLES = (
    "token_embd", "output",
    "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down",
)  # fmt: skip
DEFAULT_QTYPE = "Q8_0"
_FILE_TYPE = {
    "F32": LlamaFileType.ALL_F32,
    "F16": LlamaFileType.MOSTLY_F16,
    "BF16": LlamaFileType.MOSTLY_BF16,
    "Q8_0": LlamaFileType.MOSTLY_Q8_0,
    "Q4_0": LlamaFileType.MOSTLY_Q4_0,
    "Q4_1": LlamaFileType.MOSTLY_Q4_1,
}

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
BOS_TOKEN, EOS_TOKEN = "<|endoftext|>", "<|im_end|>"
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Merges are derived from these, in this order (rank = order of appearance). Suffixes and
# fragments are merged as written; words get the GPT-2 space prefix "Ġ" as well.
_FRAGMENTS = "th he in er an re on at en nd es or ing ed ion tion ly al ar st ou it is le"
_WORDS = (
    "the of and to in is that for it with as was on be at by this are from or have an not but "
    "they his her which you we all can will one has more their there been if would about what "
    "so The capital France Paris city language model token hello world Hello a I A"
)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (b' ' -> 'Ġ', b'\\n' -> 'Ċ')."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    others = [b for b in range(256) if b not in printable]
    chars = [*printable, *(256 + n for n in range(len(others)))]
    return {b: chr(c) for b, c in zip([*printable, *others], chars, strict=True)}


def _bpe(word: str, ranks: dict[tuple[str, str], int]) -> list[str]:
    """Split `word` (byte-level symbols) by applying merges lowest rank first."""
    parts = list(word)
    while len(parts) > 1:
        rank, i = min((ranks.get(p, math.inf), i) for i, p in enumerate(pairwise(parts)))
        if rank == math.inf:
            break
        parts[i : i + 2] = [parts[i] + parts[i + 1]]
    return parts


def build_vocab() -> tuple[list[str], list[str], list[int]]:
    """(tokens, merges, token_types): 256 byte symbols, one token per merge, then specials."""
    sym = bytes_to_unicode()
    tokens = list(sym.values())
    ranks: dict[tuple[str, str], int] = {}
    words = _FRAGMENTS.split() + [w for word in _WORDS.split() for w in (word, " " + word)]
    for word in words:
        # Merge what current BPE leaves of the word left to right, so each word ends as one token.
        parts = _bpe("".join(sym[b] for b in word.encode()), ranks)
        while len(parts) > 1:
            a, b = parts[0], parts[1]
            if (a, b) not in ranks:
                ranks[(a, b)] = len(ranks)
                tokens.append(a + b)
            parts[:2] = [a + b]
    types = [TokenType.NORMAL] * len(tokens) + [TokenType.CONTROL] * len(SPECIAL_TOKENS)
    return tokens + list(SPECIAL_TOKENS), [f"{a} {b}" for a, b in ranks], [int(t) for t in types]


def _weights(rng, *, arch, n_layers, dim, n_heads, n_kv_heads, hidden_dim, vocab, tied):
    """[(name, role, float32 array)] in file order; role None for F32-only norms and biases.

    Matrices are N(0, 1/n_in) so every projection keeps O(1) activations; embedding/output rows
    are N(0, 4/dim), so logits of the unit-RMS final state have std ~2: peaked, not huge.
    """
    kv_dim = n_kv_heads * (dim // n_heads)

    def mat(n_out, n_in):
        return rng.standard_normal((n_out, n_in)) / math.sqrt(n_in)

    def norm(n):
        return 1.0 + 0.1 * rng.standard_normal(n)

    out = [("token_embd.weight", "token_embd", 2.0 * mat(vocab, dim))]
    for i in range(n_layers):
        p = f"blk.{i}."
        out.append((p + "attn_norm.weight", None, norm(dim)))
        for role, n_out in (("attn_q", dim), ("attn_k", kv_dim), ("attn_v", kv_dim)):
            out.append((p + role + ".weight", role, mat(n_out, dim)))
            if arch == "qwen2":
                out.append((p + role + ".bias", None, 0.2 * rng.standard_normal(n_out)))
        out.append((p + "attn_output.weight", "attn_output", mat(dim, dim)))
        out.append((p + "ffn_norm.weight", None, norm(dim)))
        out.append((p + "ffn_gate.weight", "ffn_gate", mat(hidden_dim, dim)))
        out.append((p + "ffn_up.weight", "ffn_up", mat(hidden_dim, dim)))
        out.append((p + "ffn_down.weight", "ffn_down", mat(dim, hidden_dim)))
    out.append(("output_norm.weight", None, norm(dim)))
    if not tied:
        out.append(("output.weight", "output", 2.0 * mat(vocab, dim)))
    return [(name, role, a.astype(np.float32)) for name, role, a in out]


def _tensor_types(qtype, roles: list[str | None]) -> list[str]:
    """One type name per tensor: F32 for norms/biases, else from `qtype` (str, dict or "mixed")."""
    if qtype == "mixed":  # cycle the types over matrices in file order: all six by the 6th
        it = iter(range(len(roles)))
        return [
            "F32" if r is None else SUPPORTED_QTYPES[next(it) % len(SUPPORTED_QTYPES)]
            for r in roles
        ]
    by_role = dict.fromkeys(MATRIX_ROLES, DEFAULT_QTYPE) | (
        qtype if isinstance(qtype, dict) else dict.fromkeys(MATRIX_ROLES, qtype)
    )
    bad = {k: v for k, v in by_role.items() if k not in MATRIX_ROLES or v not in SUPPORTED_QTYPES}
    if bad:
        raise ConfigError(
            "qtype", f"{bad} not allowed: roles {MATRIX_ROLES}, types {SUPPORTED_QTYPES}"
        )
    return ["F32" if r is None else by_role[r] for r in roles]


def llama3_rope_factors(n_rot: int, theta: float, *, factor: float = 8.0,
                        low_freq_factor: float = 1.0, high_freq_factor: float = 4.0,
                        original_context_length: int = 8192) -> list[float]:
    """Llama 3.1's rope scaling as llama.cpp's converter bakes it into rope_freqs.weight: pair i
    with wavelength 2 pi / freq_i keeps its frequency below context / high_freq_factor, is
    slowed by `factor` above context / low_freq_factor, and is interpolated smoothly between."""
    freqs = 1.0 / theta ** (np.arange(0, n_rot, 2, dtype=np.float32) / n_rot)
    low_wavelen = original_context_length / low_freq_factor
    high_wavelen = original_context_length / high_freq_factor
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / float(freq)
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(float(factor))
        else:
            smooth = ((original_context_length / wavelen - low_freq_factor)
                      / (high_freq_factor - low_freq_factor))
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return out


def _check_shapes(arch, n_layers, dim, n_heads, n_kv_heads) -> None:
    if arch not in ARCHS:
        raise ConfigError("arch", f"{arch!r} is not one of {ARCHS}")
    if n_layers < 1 or dim % n_heads or n_heads % n_kv_heads or (dim // n_heads) % 2:
        raise ConfigError(
            "n_heads",
            f"need n_layers >= 1, dim % n_heads == 0, n_heads % n_kv_heads == 0 and an even "
            f"head_dim; got n_layers={n_layers} dim={dim} n_heads={n_heads} "
            f"n_kv_heads={n_kv_heads}",
        )


def write_tiny_gguf(
    path,
    *,
    arch: str = "llama",
    qtype: str | dict[str, str] = "Q8_0",
    n_layers: int = 2,
    dim: int = 64,
    n_heads: int = 4,
    n_kv_heads: int = 2,
    hidden_dim: int = 128,
    context_length: int = 4096,
    rope_theta: float = 10000.0,
    seed: int = 0,
    tied_embeddings: bool = True,
    norm_eps: float = 1e-5,
    rope_freq_factors: list[float] | None = None,
    rope_scaling_type: str | None = None,
    rope_scaling_factor: float | None = None,
) -> Path:
    """Write a complete tiny GGUF to `path` (temp file, then os.replace) and return the path."""
    _check_shapes(arch, n_layers, dim, n_heads, n_kv_heads)
    tokens, merges, token_types = build_vocab()
    tensors = _weights(
        np.random.default_rng(seed), arch=arch, n_layers=n_layers, dim=dim, n_heads=n_heads,
        n_kv_heads=n_kv_heads, hidden_dim=hidden_dim, vocab=len(tokens), tied=tied_embeddings,
    )  # fmt: skip
    if rope_freq_factors is not None:  # first, as the converter's extra tensors come first
        ff = np.asarray(rope_freq_factors, dtype=np.float32)
        tensors.insert(0, ("rope_freqs.weight", None, ff))
    types = _tensor_types(qtype, [role for _, role, _ in tensors])
    matrix_types = [t for (_, role, _), t in zip(tensors, types, strict=True) if role]
    main_type = max(SUPPORTED_QTYPES, key=matrix_types.count)  # mixed files: most common

    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    w = GGUFWriter(tmp, arch)  # adds general.architecture itself
    w.add_name(f"tiny-{arch}")
    w.add_block_count(n_layers)
    w.add_context_length(context_length)
    w.add_embedding_length(dim)
    w.add_feed_forward_length(hidden_dim)
    w.add_head_count(n_heads)
    w.add_head_count_kv(n_kv_heads)
    w.add_rope_freq_base(rope_theta)
    w.add_layer_norm_rms_eps(norm_eps)
    w.add_rope_dimension_count(dim // n_heads)
    if rope_scaling_type is not None:
        w.add_string(f"{arch}.rope.scaling.type", rope_scaling_type)
    if rope_scaling_factor is not None:
        w.add_float32(f"{arch}.rope.scaling.factor", rope_scaling_factor)
    w.add_vocab_size(len(tokens))
    w.add_file_type(_FILE_TYPE[main_type])
    w.add_quantization_version(GGML_QUANT_VERSION)

    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(tokens)
    w.add_token_types(token_types)
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index(BOS_TOKEN))
    w.add_eos_token_id(tokens.index(EOS_TOKEN))
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML_TEMPLATE)

    for (name, _, array), type_name in zip(tensors, types, strict=True):
        ggml_type = GGMLQuantizationType[type_name]
        block = GGML_QUANT_SIZES[ggml_type][0]
        if array.shape[-1] % block:
            raise ConfigError(
                "dim",
                f"{name} row size {array.shape[-1]} is not a multiple of the "
                f"{type_name} block size {block}",
            )
        w.add_tensor(name, quantize(array, ggml_type), raw_dtype=ggml_type)
    return finish(w, tmp, path)



def finish(w, tmp: Path, path: Path) -> Path:
    """Write GGUFWriter w's header, metadata and tensors to its file `tmp`, close it, and move
    it to `path` (a reader never sees a half-written file); returns path."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, path)
    return path


_written: set[Path] = set()


def tiny_model_path(tmp_dir, **kw) -> Path:
    """Path of a tiny GGUF with parameters `kw` under `tmp_dir`, written once per process.

    The file name is a hash of the full parameter set (defaults filled in), so `qtype="Q8_0"`
    and no `qtype` share a file; unknown keywords raise TypeError here, before any writing.
    """
    bound = inspect.signature(write_tiny_gguf).bind(None, **kw)
    bound.apply_defaults()
    params = {k: v for k, v in bound.arguments.items() if k != "path"}
    digest = hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:16]
    path = (Path(tmp_dir) / f"tiny-{params['arch']}-{digest}.gguf").resolve()
    if path not in _written:
        write_tiny_gguf(path, **kw)
        _written.add(path)
    return path


def rewrite_gguf(src: Path, dst: Path, *, arch: str | None = None,
                 retype: dict[str, GGMLQuantizationType] | None = None,
                 meta: dict[str, tuple[object, GGUFValueType]] | None = None) -> Path:
    """Copy GGUF `src` to `dst` field by field and tensor by tensor, with general.architecture
    set to `arch`, metadata `meta` ({key: (value, type)}) set or replaced, and the tensors named
    in `retype` stored as zero blocks of another type (files tests expect to be refused)."""
    meta = meta or {}
    r = GGUFReader(src)
    w = GGUFWriter(dst, arch or r.fields["general.architecture"].contents())
    for f in r.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture" or f.name in meta:
            continue  # written by GGUFWriter itself, or replaced below
        sub = f.types[-1] if f.types[0] == GGUFValueType.ARRAY else None
        w.add_key_value(f.name, f.contents(), f.types[0], sub_type=sub)
    for key, (value, vtype) in meta.items():
        w.add_key_value(key, value, vtype)
    for t in r.tensors:
        new = (retype or {}).get(t.name)
        if new is None:
            w.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
            continue
        rows, cols = int(t.shape[1]), int(t.shape[0])  # GGUF lists dims innermost first
        block_elems, block_bytes = GGML_QUANT_SIZES[new]
        w.add_tensor(t.name, np.zeros((rows, cols // block_elems * block_bytes), dtype=np.uint8),
                     raw_dtype=new)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst
