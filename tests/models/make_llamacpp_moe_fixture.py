"""Write tests/models/data/llamacpp_moe.json: llama.cpp's logits on the tiny MoE files, so CI
checks the MoE conformance without building llama.cpp (test_moe.py::
test_logits_match_llama_cpp_fixture). For each architecture and weight type: the sha256 of
the file `write_tiny_moe` writes (the fixture is only valid for those bytes), llama.cpp's argmax
at every position of test_moe.IDS, and its top-8 (id, logit) at every position.

Usage (needs llama-cpp-python, `benchmarks/install_llama_cpp.sh`):
    PYTHONPATH=src python tests/models/make_llamacpp_moe_fixture.py
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parents[1] / "benchmarks"))
OUT = HERE / "data" / "llamacpp_moe.json"
QTYPES = ("Q8_0", "F32")
TOP = 8


def case(path: Path, ids: list[int]) -> dict:
    import llama_cpp

    from llamacpp_ref import llamacpp_logits

    theirs = llamacpp_logits(path, ids, threads=1)
    top = np.argsort(-theirs, axis=1, kind="stable")[:, :TOP]
    return {"sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
            "llama_cpp": llama_cpp.__version__,
            "argmax": theirs.argmax(1).tolist(), "top_ids": top.tolist(),
            "top_logits": np.take_along_axis(theirs, top, 1).round(5).tolist()}


def main() -> None:
    from test_moe import IDS

    from cfr_atlas.testing.tiny_moe import MOE_ARCHS, write_tiny_moe

    cases = {}
    with tempfile.TemporaryDirectory() as tmp:
        for arch in MOE_ARCHS:
            for qtype in QTYPES:
                path = write_tiny_moe(Path(tmp) / f"{arch}-{qtype}.gguf", arch=arch, qtype=qtype)
                cases[f"{arch}/{qtype}"] = case(path, IDS)
                print(arch, qtype, "argmax", cases[f"{arch}/{qtype}"]["argmax"][:6], "...")
    OUT.write_text(json.dumps({"ids": IDS, "cases": cases}, separators=(",", ":")))
    print(f"wrote {OUT} ({OUT.stat().st_size:,} bytes)")


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    main()
