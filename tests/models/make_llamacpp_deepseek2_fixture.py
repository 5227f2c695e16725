"""Write tests/models/data/llamacpp_deepseek2.json: llama.cpp's logits on the tiny deepseek2
(MLA) files, so CI checks the MLA conformance without building llama.cpp (test_deepseek2.py::
test_logits_match_llama_cpp_fixture). For each (case, weight type) of test_deepseek2.LLAMACPP:
the sha256 of the file `write_tiny_deepseek2` writes (the fixture is valid only for those
bytes), llama.cpp's argmax at every position of test_deepseek2.IDS and its top-8 (id, logit).

Usage (needs llama-cpp-python, `benchmarks/install_llama_cpp.sh`):
    PYTHONPATH=src python tests/models/make_llamacpp_deepseek2_fixture.py
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parents[1] / "benchmarks"))
OUT = HERE / "data" / "llamacpp_deepseek2.json"


def main() -> None:
    from make_llamacpp_moe_fixture import case
    from test_deepseek2 import CASES, IDS, LLAMACPP

    from cfr_atlas.testing.tiny_deepseek2 import write_tiny_deepseek2

    cases = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, qtype in LLAMACPP:
            path = write_tiny_deepseek2(Path(tmp) / f"{name}-{qtype}.gguf", qtype=qtype,
                                        **CASES[name])
            key = f"{name}/{qtype}"
            cases[key] = case(path, IDS)
            print(key, "argmax", cases[key]["argmax"][:6], "...")
    OUT.write_text(json.dumps({"ids": IDS, "cases": cases}, separators=(",", ":")))
    print(f"wrote {OUT} ({OUT.stat().st_size:,} bytes)")


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    main()
