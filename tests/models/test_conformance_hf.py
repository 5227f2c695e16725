"""Conformance with HF transformers loading the same GGUF: logits at a few hundred positions.

transformers dequantizes every GGUF tensor to float32 (through gguf-py, un-permuting llama's
Q/K rows itself) and runs its own PyTorch Llama/Qwen2; we run float32 activations on the
quantized weights as stored. The weights are therefore the same numbers and only float32
arithmetic differs (summation order in matmuls, the RoPE tables, softmax and norm details).

Tolerances, in float32 terms (u = 2**-24 ~ 6e-8 is the unit roundoff):
  * max |ours - HF| <= REL_TOL * max |HF logits|, REL_TOL = 2.5e-5 (~400 u). A length-K dot
    product summed in another order moves by ~sqrt(K) u relative (K <= 1536 here: ~40 u), and
    30 residual layers compound it. Measured: 3.0e-6 relative on the bundled 30-layer model,
    <= 1.9e-6 on the tiny ones, a margin of 8x or more. A real mismatch is far bigger: the
    same tiny weights rounded to F16 already move the logits by 1e-3 relative, 40x the bound.
  * argmax agreement >= MIN_ARGMAX (99%), and every disagreement must be a near tie: HF's top
    two logits within 2 x max |ours - HF| of each other. Measured: 100% everywhere.
  These hold with K/V stored as float32 (`storage_dtype="float32"`, passed explicitly). With the
  default float16 K/V, the bundled model's bound is REL_TOL_F16 = 2e-3: float16 keeps 11
  significant bits (u = 2**-11 ~ 4.9e-4 relative per K/V element); measured 6.7e-4 relative
  (max |diff| 0.028 at logits up to 42), a 3x margin, argmax 100% (docs/CONFORMANCE.md).

Needs torch, transformers and accelerate (transformers' GGUF loader wants it). Marked `hf`:
`make test` deselects these tests so the main suite stays light, and `make conformance` (a CI
step of its own, after `make test`) installs the packages and runs them with -s, which prints
the numbers recorded in docs/CONFORMANCE.md. Without the packages they skip, except under CI
(CI set), where they fail (the `hf_packages` fixture). Holds no engine code.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest

from cfr_atlas.engine import load_model
from cfr_atlas.validate import validation_text

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("hf_packages")]

N_TOKENS = 300  # positions compared: ~300 tokens of the shipped validation text
REL_TOL = 2.5e-5  # max |ours - HF| / max |HF logits|; see the module docstring
REL_TOL_F16 = 2e-3  # the same with float16 K/V (the default storage)
MIN_ARGMAX = 0.99


def hf_logits(path, ids: list[int]) -> np.ndarray:
    """Logits (T, vocab) float32 from transformers loading the GGUF at `path` as float32
    (remembered per file and ids: loading a real GGUF into transformers takes a minute)."""
    return _hf_logits(str(path), tuple(ids))


@functools.lru_cache(maxsize=2)
def _hf_logits(path: str, ids: tuple[int, ...]) -> np.ndarray:
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(path)
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                              dtype=torch.float32).eval()
    with torch.inference_mode():
        out = hf(torch.tensor([list(ids)], dtype=torch.long)).logits[0]
    return out.to(torch.float32).numpy()


def ours_and_hf(path, storage_dtype: str = "float32") -> tuple[np.ndarray, np.ndarray, list[int]]:
    """Both models' logits on the first N_TOKENS ids of the validation text (our tokenizer,
    BOS only if the GGUF asks for one; HF gets the same ids, so tokenizers cannot differ)."""
    model = load_model(path)
    ids = model.tokenize(validation_text())[:N_TOKENS]
    assert len(ids) == N_TOKENS
    return model.logits(ids, storage_dtype=storage_dtype), hf_logits(path, ids), ids


def compare(label: str, ours: np.ndarray, theirs: np.ndarray) -> dict:
    """Max/mean abs difference, argmax agreement and near-tie check; printed for `-s`."""
    assert ours.shape == theirs.shape and ours.dtype == np.float32
    diff = np.abs(ours - theirs)
    top2 = np.sort(theirs, axis=1)[:, -2:]
    disagree = ours.argmax(axis=1) != theirs.argmax(axis=1)
    r = {
        "positions": ours.shape[0],
        "max_abs": float(diff.max()),
        "mean_abs": float(diff.mean()),
        "scale": float(np.abs(theirs).max()),
        "argmax_agree": float(1.0 - disagree.mean()),
        "gaps_at_disagreements": (top2[:, 1] - top2[:, 0])[disagree].tolist(),
    }
    print(f"\n[conformance] {label}: {r['positions']} positions, max |diff| {r['max_abs']:.3e}, "
          f"mean |diff| {r['mean_abs']:.3e}, max |logit| {r['scale']:.2f} "
          f"(relative {r['max_abs'] / r['scale']:.2e}), argmax agreement "
          f"{r['argmax_agree']:.2%}")
    return r


def check(r: dict, rel_tol: float = REL_TOL) -> None:
    assert r["max_abs"] <= rel_tol * r["scale"], r
    assert r["argmax_agree"] >= MIN_ARGMAX, r
    assert all(gap <= 2 * r["max_abs"] for gap in r["gaps_at_disagreements"]), r


def test_versions_in_use():
    import torch
    import transformers

    print(f"\n[conformance] torch {torch.__version__} (cuda {torch.version.cuda}), "
          f"transformers {transformers.__version__}")
    assert torch.version.cuda is None, "make conformance must install the CPU build of torch"


@pytest.mark.parametrize("arch, qtype, tied", [
    ("llama", "F32", True), ("llama", "Q8_0", True), ("llama", "Q4_1", False),
    ("qwen2", "F32", False), ("qwen2", "Q8_0", True),
])  # fmt: skip
def test_tiny_gguf_matches_transformers(tiny_gguf, arch, qtype, tied):
    path = tiny_gguf(arch=arch, qtype=qtype, n_layers=2, tied_embeddings=tied)
    ours, theirs, _ = ours_and_hf(path)
    check(compare(f"tiny {arch} {qtype}{' tied' if tied else ''}", ours, theirs))


@pytest.mark.slow
@pytest.mark.parametrize("storage_dtype, rel_tol", [("float32", REL_TOL),
                                                    ("float16", REL_TOL_F16)])
def test_bundled_model_matches_transformers(bundled_model_path, storage_dtype, rel_tol):
    ours, theirs, _ = ours_and_hf(bundled_model_path, storage_dtype)
    check(compare(f"bundled {bundled_model_path.name}, {storage_dtype} K/V", ours, theirs),
          rel_tol)


# The real models of issue 12 (Q4_K_M mixes of Q4_K, Q5_0, Q6_K, Q8_0 and F32), fetched by the
# real_model fixture as `make test` already did. Same bounds as above with float32 K/V (measured
# 2.2e-6 relative on Gemma 3 270M, 2.1e-6 on Qwen2.5-Coder-0.5B: a 10x margin). With the default
# float16 K/V Gemma 3 measures 1.8e-3 relative (0.059 at logits up to 33; head_dim 256 and the
# model's large activations), too close to REL_TOL_F16 for a bound: REAL_TOL_F16 = 4e-3 is 2x
# that. Against these, llama.cpp's own logits differ by 3.2 (Gemma 3) and 0.7 (Qwen2.5) at most
# on a 1,024-token text (docs/CONFORMANCE.md): the gap of issue 12's llama.cpp conformance is
# llama.cpp's approximations, not ours.
REAL_TOL_F16 = 4e-3


@pytest.mark.slow
@pytest.mark.model
@pytest.mark.parametrize("name", ["gemma3-270m", "qwen2.5-coder-0.5b"])
@pytest.mark.parametrize("storage_dtype, rel_tol", [("float32", REL_TOL),
                                                    ("float16", REAL_TOL_F16)])
def test_real_model_matches_transformers(real_model, name, storage_dtype, rel_tol):
    path = real_model(name)
    ours, theirs, _ = ours_and_hf(path, storage_dtype)
    check(compare(f"{name}, {storage_dtype} K/V", ours, theirs), rel_tol)
