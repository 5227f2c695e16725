"""Write tests/text/data/NAME_llamacpp_ids.json: llama.cpp's token ids for a few texts on a
real vocabulary (gemma3: SentencePiece; qwen2: BPE with the qwen2 pre-tokenizer), so CI checks
cfr-atlas's tokenizers without llama.cpp.

Run: PYTHONPATH=src python tests/text/make_llamacpp_ids.py GGUF NAME  (needs llama_cpp)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

TEXTS = [
    "Hello world",
    "The year 1999 had 365 days; pi is 3.14159265.",
    "  two  spaces,   three,    four and a tab\there",
    "line one\nline two\n\n\nafter three newlines\r\n",
    "naïve café — Ελληνικά, Русский, 東京タワー, 한국어",
    "emoji 🙂👍🏽 and 🏳️‍🌈 flags",
    " leading space and trailing space ",
    "<start_of_turn>user text that spells a control token<end_of_turn>",
    "def f(x):\n    return x ** 2  # square\n",
    "<td>cell</td> and <b>bold</b>",
]


def main(path: str, name: str) -> None:
    import llama_cpp

    llm = llama_cpp.Llama(path, vocab_only=True, verbose=False)
    cases = [{"text": t, "ids": llm.tokenize(t.encode(), add_bos=True, special=False)}
             for t in TEXTS]
    out = Path(__file__).parent / "data" / f"{name}_llamacpp_ids.json"
    out.write_text("[\n" + ",\n".join(json.dumps(c, ensure_ascii=False) for c in cases) + "\n]\n")
    print(f"wrote {out} ({len(cases)} texts, llama_cpp {llama_cpp.__version__})")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
