"""Float64 reference forward pass for llama/qwen2 GGUF files, written plainly (llama2.c style).

`reference_logits(path, ids)` reads a GGUF with gguf-py's own reader, dequantizes every tensor
with gguf-py's own `dequantize` to float64 and runs the whole model top to bottom with no cache,
no fusion and no shortcuts. It is the oracle the engine is compared against, so it shares no
code with `cfr_atlas` and favours being obviously right over being fast.

It imports nothing from `cfr_atlas` (not even its error types): NumPy and gguf-py only. A
malformed file raises ReferenceError.

Conventions (the contract of `cfr_atlas.testing.tiny_gguf`, and llama.cpp's):
  * a matrix with GGUF `ne = [n_in, n_out]` dequantizes to (n_out, n_in) and is applied as x @ W.T;
  * "llama" = NORM rope, rotating adjacent pairs (x[2i], x[2i+1]) by pos * theta^(-2i/n_rot)
    (llama.cpp's converter permutes HF q/k weights into this layout); "qwen2" = NEOX rope,
    rotating (x[i], x[i + n_rot/2]), plus biases on q/k/v;
  * GQA: query head h reads kv head h // (n_heads // n_kv_heads).
  * RoPE frequencies as llama.cpp computes them (ggml_rope_cache_init / rope_yarn): pair i turns
    by pos * freq_scale * theta^(-2i/n_rot) / ff[i]. ff is the optional `rope_freqs.weight`
    (n_rot/2,) tensor (Llama 3.1/3.2: the converter bakes "llama3" scaling into it), else 1.
    freq_scale = 1 / `rope.scaling.factor` for scaling type "linear", which is llama.cpp's
    default when `rope.scaling.type` is absent (factor absent or 0 -> 1); type "none" -> 1.
    Any other type (yarn, longrope, ...) is refused: the reference does not model it.
  * K/V storage (`kv_round`): None keeps K and V in float64. "float16" / "bfloat16" round every
    K and V row (K after RoPE), once, to nearest with ties to even, before any query reads it, as
    an engine storing its K/V in that format does; everything else stays float64. float16 is
    NumPy's cast; bfloat16 (8 significant bits, float32's exponent range) is `round_bfloat16`
    below, written here on its own, not taken from the engine.
"""

from __future__ import annotations

import math

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize


class ReferenceError(ValueError):
    """The GGUF is outside what this reference models (missing key or tensor, unknown rope)."""


NEOX_ROPE = {"llama": False, "qwen2": True}  # arch -> rope pairs are split halves
QKV_BIAS = {"llama": False, "qwen2": True}


_MISSING = object()


def _meta(reader: GGUFReader, key: str, default=_MISSING):
    field = reader.get_field(key)
    if field is None:
        if default is _MISSING:
            raise ReferenceError(f"GGUF metadata key {key!r} is missing")
        return default
    return field.contents()


def _dequantize(tensor) -> np.ndarray:
    """GGUF tensor with ne = [n_in, n_out] -> (n_out, n_in) float64 (1D tensors stay 1D)."""
    w = dequantize(tensor.data, tensor.tensor_type).astype(np.float64)
    expected = tuple(int(n) for n in reversed(tensor.shape))
    assert w.shape == expected, (tensor.name, w.shape, expected)
    return w


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """x: (T, D), w: (D,) -> (T, D); x / sqrt(mean(x^2) + eps) * w."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope(x: np.ndarray, pos: np.ndarray, theta: float, n_rot: int, neox: bool,
         freq_factors: np.ndarray | None = None, freq_scale: float = 1.0) -> np.ndarray:
    """x: (T, H, head_dim), pos: (T,) -> (T, H, head_dim); rotates the first n_rot dims per head.

    Pair i turns by pos * freq_scale * theta^(-2i/n_rot) / freq_factors[i] radians.
    """
    half = n_rot // 2
    freq = theta ** (-2.0 * np.arange(half, dtype=np.float64) / n_rot)  # (half,) radians/position
    freq = freq_scale * freq / (1.0 if freq_factors is None else freq_factors)
    angle = pos.astype(np.float64)[:, None] * freq[None, :]  # (T, half)
    cos, sin = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]  # (T, 1, half)
    i0 = np.arange(half) if neox else 2 * np.arange(half)
    i1 = i0 + half if neox else i0 + 1
    a, b = x[..., i0], x[..., i1]
    out = x.copy()
    out[..., i0] = a * cos - b * sin
    out[..., i1] = a * sin + b * cos
    return out


def round_bfloat16(x: np.ndarray) -> np.ndarray:
    """float64 -> float64 values representable in bfloat16, round to nearest, ties to even.

    x = m * 2^e with 0.5 <= |m| < 1 (frexp); bfloat16 keeps 8 significant bits, so the quantum
    is 2^(e - 8), floored at 2^-133 (bfloat16's smallest subnormal). rint rounds half to even;
    every step is exact in float64. Values past bfloat16's range become inf (caller checks).
    """
    _, e = np.frexp(x)
    q = np.maximum(e - 8, -133)  # exponent of the quantum
    return np.ldexp(np.rint(np.ldexp(x, -q)), q)


KV_ROUND = {None: lambda x: x, "float16": lambda x: x.astype(np.float16).astype(np.float64),
            "bfloat16": round_bfloat16}


def round_kv(x: np.ndarray, kv_round: str | None) -> np.ndarray:
    """K or V rows (float64) -> the values a read sees after storing them as `kv_round`."""
    if kv_round not in KV_ROUND:
        raise ReferenceError(f"kv_round {kv_round!r} is not one of {list(KV_ROUND)}")
    with np.errstate(over="ignore"):  # overflow is checked just below
        out = KV_ROUND[kv_round](x)
    if not np.isfinite(out).all():
        raise ReferenceError(f"K/V rows overflow {kv_round} (max |x| {np.abs(x).max():.4g})")
    return out


def softmax(s: np.ndarray) -> np.ndarray:
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def rope_scale(r: GGUFReader, arch: str) -> float:
    """freq_scale from `rope.scaling.type` / `rope.scaling.factor`, as llama.cpp reads them."""
    kind = _meta(r, f"{arch}.rope.scaling.type", "linear")  # llama.cpp's default
    factor = float(_meta(r, f"{arch}.rope.scaling.factor", 0.0))
    if kind == "none":
        return 1.0
    if kind != "linear":
        raise ReferenceError(f"rope scaling type {kind!r} is not modelled by the reference")
    return 1.0 if factor == 0.0 else 1.0 / factor


def reference_logits(path, ids: list[int], kv_round: str | None = None) -> np.ndarray:
    """Token ids (T,) -> logits (T, vocab) float64, positions 0..T-1, full causal attention.

    `path` may also be an open GGUFReader: parsing a 49k-token vocabulary takes seconds.
    `kv_round`: None (K/V in float64), "float16" or "bfloat16" (see the module docstring).
    """
    round_kv(np.zeros(1), kv_round)  # an unknown format fails before the slow part
    r = path if isinstance(path, GGUFReader) else GGUFReader(path)
    arch = _meta(r, "general.architecture")
    if arch not in NEOX_ROPE:
        raise ReferenceError(f"reference has no {arch!r}; knows {list(NEOX_ROPE)}")
    n_layers = _meta(r, f"{arch}.block_count")
    dim = _meta(r, f"{arch}.embedding_length")
    n_heads = _meta(r, f"{arch}.attention.head_count")
    n_kv_heads = _meta(r, f"{arch}.attention.head_count_kv")
    eps = _meta(r, f"{arch}.attention.layer_norm_rms_epsilon")
    theta = _meta(r, f"{arch}.rope.freq_base")
    head_dim = dim // n_heads
    n_rot = _meta(r, f"{arch}.rope.dimension_count")
    group = n_heads // n_kv_heads  # query heads per kv head
    tensors = {t.name: t for t in r.tensors}

    def W(name: str) -> np.ndarray:
        if name not in tensors:
            raise ReferenceError(f"tensor {name!r} is missing from the GGUF")
        return _dequantize(tensors[name])

    ff = W("rope_freqs.weight") if "rope_freqs.weight" in tensors else None  # (n_rot/2,)
    scale = rope_scale(r, arch)
    T = len(ids)
    pos = np.arange(T)
    causal = np.triu(np.full((T, T), -np.inf), k=1)  # (T, T): 0 on and below the diagonal
    x = W("token_embd.weight")[np.asarray(ids)]  # (T, dim)

    for layer in range(n_layers):
        p = f"blk.{layer}."
        # attention: x += Wo @ attn(rope(Wq xn), rope(Wk xn), Wv xn)
        xn = rms_norm(x, W(p + "attn_norm.weight"), eps)
        q, k, v = (xn @ W(p + f"attn_{n}.weight").T for n in "qkv")
        if QKV_BIAS[arch]:
            q, k, v = q + W(p + "attn_q.bias"), k + W(p + "attn_k.bias"), v + W(p + "attn_v.bias")
        q = rope(q.reshape(T, n_heads, head_dim), pos, theta, n_rot, NEOX_ROPE[arch], ff, scale)
        k = rope(k.reshape(T, n_kv_heads, head_dim), pos, theta, n_rot, NEOX_ROPE[arch], ff, scale)
        v = v.reshape(T, n_kv_heads, head_dim)
        k, v = round_kv(k, kv_round), round_kv(v, kv_round)  # as stored, before any read
        att = np.empty((T, n_heads, head_dim))
        for h in range(n_heads):
            scores = q[:, h] @ k[:, h // group].T / math.sqrt(head_dim) + causal  # (T, T)
            att[:, h] = softmax(scores) @ v[:, h // group]
        x = x + att.reshape(T, dim) @ W(p + "attn_output.weight").T

        # feed-forward: x += down(silu(gate xn) * up xn)
        xn = rms_norm(x, W(p + "ffn_norm.weight"), eps)
        hidden = silu(xn @ W(p + "ffn_gate.weight").T) * (xn @ W(p + "ffn_up.weight").T)
        x = x + hidden @ W(p + "ffn_down.weight").T

    x = rms_norm(x, W("output_norm.weight"), eps)
    out = W("output.weight" if "output.weight" in tensors else "token_embd.weight")  # tied
    return x @ out.T
