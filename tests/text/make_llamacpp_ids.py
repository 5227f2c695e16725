"""Write tests/text/data/gemma3_llamacpp_ids.json: llama.cpp's token ids for a few texts on the
real Gemma 3 vocabulary, so CI checks cfr-atlas's SentencePiece tokenizer without llama.cpp.

Run: PYTHONPATH=src python tests/text/make_llamacpp_ids.py GEMMA_GGUF  (needs llama_cpp)
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


def main(path: str) -> None:
    import llama_cpp

    llm = llama_cpp.Llama(path, vocab_only=True, verbose=False)
    cases = [{"text": t, "ids": llm.tokenize(t.encode(), add_bos=True, special=False)}
             for t in TEXTS]
    out = Path(__file__).parent / "data" / "gemma3_llamacpp_ids.json"
    out.write_text(json.dumps(cases, ensure_ascii=False, indent=0) + "\n")
    print(f"wrote {out} ({len(cases)} texts, llama_cpp {llama_cpp.__version__})")


if __name__ == "__main__":
    main(sys.argv[1])
