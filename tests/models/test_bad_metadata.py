"""Bad GGUF config metadata is a ModelFormatError naming the field and the value, and on the
command line one `cfr-atlas: error: ...` line with exit code 2 (never a crash or a silent
truncation such as int(4.5) == 4)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from gguf import GGUFValueType

from cfr_atlas import cli
from cfr_atlas.engine import load_model
from cfr_atlas.errors import ModelFormatError
from cfr_atlas.models.gguf_io import GGUFFile
from cfr_atlas.models.llama import LlamaConfig
from cfr_atlas.testing import rewrite_gguf

U32, I32, F32, STR = (GGUFValueType.UINT32, GGUFValueType.INT32, GGUFValueType.FLOAT32,
                      GGUFValueType.STRING)

# case -> (key, value, GGUF type, phrases the error must hold). The tiny llama has dim 64,
# 4 heads, 2 K/V heads, head_dim 16.
CASES = {
    "zero heads": ("llama.attention.head_count", 0, U32, ("head_count = 0", "outside [1,")),
    "zero kv heads": ("llama.attention.head_count_kv", 0, U32, ("head_count_kv = 0",)),
    "heads not dividing dim": ("llama.attention.head_count", 3, U32,
                               ("dim 64, 3 heads", "do not divide", "llama.embedding_length")),
    "kv heads not dividing heads": ("llama.attention.head_count_kv", 3, U32,
                                    ("4 heads and 3 K/V heads", "do not divide", "head_count_kv")),
    "non-integer heads": ("llama.attention.head_count", 4.5, F32,
                          ("head_count must be an integer", "4.5", "float")),
    "string layers": ("llama.block_count", "two", STR, ("block_count must be an integer",
                                                        "'two'")),
    "zero layers": ("llama.block_count", 0, U32, ("block_count = 0",)),
    "absurd layers": ("llama.block_count", 10**6, U32, ("block_count = 1000000", "outside")),
    "absurd dim": ("llama.embedding_length", 1 << 30, U32, ("embedding_length = 1073741824",)),
    "zero context": ("llama.context_length", 0, U32, ("context_length = 0",)),
    "negative context": ("llama.context_length", -4096, I32, ("context_length = -4096",)),
    "zero hidden": ("llama.feed_forward_length", 0, U32, ("feed_forward_length = 0",)),
    "nan epsilon": ("llama.attention.layer_norm_rms_epsilon", float("nan"), F32,
                    ("layer_norm_rms_epsilon", "nan")),
    "negative epsilon": ("llama.attention.layer_norm_rms_epsilon", -1e-5, F32,
                         ("layer_norm_rms_epsilon", "got -9.99")),
    "infinite theta": ("llama.rope.freq_base", float("inf"), F32, ("rope.freq_base", "inf")),
    "odd rope dims": ("llama.rope.dimension_count", 7, U32, ("dimension_count = 7", "odd")),
    "rope dims above head_dim": ("llama.rope.dimension_count", 32, U32,
                                 ("dimension_count = 32", "outside [1, 16]")),
    "zero vocab": ("llama.vocab_size", 0, U32, ("vocab_size = 0",)),
}


def with_meta(src: Path, dst: Path, key: str, value, vtype: GGUFValueType) -> Path:
    """Copy GGUF `src` to `dst` with metadata `key` set to `value` of type `vtype`."""
    return rewrite_gguf(src, dst, meta={key: (value, vtype)})


@pytest.fixture(scope="module")
def bad(tiny_llama, tmp_path_factory):
    d = tmp_path_factory.mktemp("bad_meta")
    return {case: with_meta(tiny_llama, d / f"{i}.gguf", *CASES[case][:3])
            for i, case in enumerate(CASES)}


def test_the_rewrite_itself_keeps_a_good_file_good(tiny_llama, tmp_path):
    same = with_meta(tiny_llama, tmp_path / "same.gguf", "llama.attention.head_count", 4, U32)
    assert LlamaConfig.from_gguf(GGUFFile(same)) == LlamaConfig.from_gguf(GGUFFile(tiny_llama))


@pytest.mark.parametrize("case", CASES)
def test_bad_metadata_is_a_model_format_error_naming_field_and_value(bad, case):
    with pytest.raises(ModelFormatError) as err:
        LlamaConfig.from_gguf(GGUFFile(bad[case]))
    for phrase in CASES[case][3]:
        assert phrase in str(err.value), (phrase, str(err.value))
    with pytest.raises(ModelFormatError):
        load_model(bad[case])


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("cmd", ["inspect", "generate"])
def test_cli_prints_one_line_and_exits_2(bad, case, cmd, capsys):
    argv = [cmd, str(bad[case])] if cmd == "inspect" else \
        [cmd, "--model", str(bad[case]), "--max-tokens", "1", "hi"]
    code = cli.main(argv)
    out, err = capsys.readouterr()
    assert code == 2 and out.startswith("file:" if cmd == "inspect" else "") and \
        "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("cfr-atlas: error: "), err
    assert all(phrase in lines[0] for phrase in CASES[case][3]), lines[0]


def test_cli_subprocess_exit_code(bad):
    proc = subprocess.run([sys.executable, "-m", "cfr_atlas.cli", "generate", "--model",
                           str(bad["nan epsilon"]), "--max-tokens", "1", "hi"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "layer_norm_rms_epsilon" in proc.stderr
