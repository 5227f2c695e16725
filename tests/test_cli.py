"""`cfr-atlas` from the command line: one-line errors with exit code 2, help, inspect, generate.

Every bad model file is built in a temp dir from a tiny GGUF: missing, a directory, not GGUF,
truncated (in the header and in the tensor data), an unsupported architecture, an unsupported
quant type. Each must give exactly one stderr line `cfr-atlas: error: ...` that names the
problem and what to do, exit code 2 and no traceback. Tiny models only, except one slow test
on the bundled model. The serve subcommand's wiring is tested in tests/serve/test_cli_serve.py.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType

from cfr_atlas import cli
from cfr_atlas.engine import load_model
from cfr_atlas.jit_progress import HEADER
from cfr_atlas.testing import rewrite_gguf
from cfr_atlas.validate import validation_text

PROMPT = "The capital of France is"
TELEMETRY = ("kv budget", "peak resident kv", "full kv", "pages regen'd", "hot hit rate",
             "regen seconds", "prompt cached", "prefill tok/s",
             "decode tok/s")  # at least these, in this order


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory, tiny_llama, tiny_gguf) -> dict[str, Path]:
    """name -> a model path that must be refused with a one-line error."""
    d = tmp_path_factory.mktemp("bad_models")
    data = tiny_llama.read_bytes()
    files = {"missing": d / "missing.gguf", "directory": d}
    for name, content in (("not_gguf", b"<html>Not Found</html>\n"),
                          ("truncated_header", data[:200]),
                          ("truncated_tensors", data[:-1000])):
        files[name] = d / f"{name}.gguf"
        files[name].write_bytes(content)
    files["mamba"] = rewrite_gguf(tiny_llama, d / "mamba.gguf", arch="mamba")
    wide = tiny_gguf(dim=256, hidden_dim=256)  # rows of 256: whole IQ4_XS super-blocks
    files["iq4_xs"] = rewrite_gguf(wide, d / "iq4_xs.gguf",
                                   retype={"blk.1.attn_q.weight": GGMLQuantizationType.IQ4_XS})
    return files


# each bad file -> phrases its one error line must hold: what is wrong, then what to do
EXPECTED = {
    "missing": ("does not exist", "give a path to a .gguf file"),
    "directory": ("is a directory", "give a path to a .gguf file"),
    "not_gguf": ("is not a GGUF file", "convert the model"),
    "truncated_header": ("truncated", "download or convert it again"),
    "truncated_tensors": ("truncated", "download or convert it again"),
    "mamba": ("architecture 'mamba' is not supported", "llama, olmoe, qwen2, qwen2moe, qwen3moe",
              "use a GGUF of one of those"),
    "iq4_xs": ("blk.1.attn_q.weight", "IQ4_XS", "Q8_0, Q4_0, Q4_1", "re-quantize"),
}


def run(capsys, *argv) -> tuple[int, str, str]:
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code: int, err: str, *phrases: str) -> None:
    assert code == 2, err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("cfr-atlas: error: "), err
    assert "Traceback" not in err
    for phrase in phrases:
        assert phrase in lines[0], (phrase, lines[0])


# --- bad model files --------------------------------------------------------------------------


@pytest.mark.parametrize("name", EXPECTED)
def test_generate_refuses_bad_model_file(capsys, bad_files, name):
    code, out, err = run(capsys, "generate", "--model", bad_files[name], "--max-tokens", 1, "hi")
    assert_one_line_error(code, err, *EXPECTED[name])
    assert out == ""


@pytest.mark.parametrize("name", [n for n in EXPECTED if n != "iq4_xs"])  # inspect loads no weights
def test_inspect_refuses_bad_model_file(capsys, bad_files, name):
    code, _, err = run(capsys, "inspect", bad_files[name])
    assert_one_line_error(code, err, *EXPECTED[name])


@pytest.mark.parametrize("cmd", ["chat", "validate"])
def test_other_commands_refuse_a_missing_model(capsys, bad_files, cmd):
    code, _, err = run(capsys, cmd, "--model", bad_files["missing"])
    assert_one_line_error(code, err, *EXPECTED["missing"])


@pytest.mark.parametrize("name", ["truncated_tensors", "iq4_xs"])
def test_subprocess_prints_no_traceback(bad_files, name):
    proc = subprocess.run(
        [sys.executable, "-m", "cfr_atlas.cli", "generate", "--model", str(bad_files[name]),
         "--max-tokens", "1", "hi"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert_one_line_error(proc.returncode, proc.stderr, *EXPECTED[name])
    assert proc.stdout == ""


# --- bad options ------------------------------------------------------------------------------


@pytest.mark.parametrize("argv, phrases", [
    (["--kv-budget", "abc"], ("kv_budget", "cannot read 'abc' as a size", "16MiB")),
    (["--kv-budget", "1KiB"], ("kv_budget", "1,024 bytes is below", "scratch",
                               "smallest accepted budget is 49,152 bytes")),  # float16 K/V
    (["--kv-budget", "1KiB", "--kv-dtype", "float32"], ("kv_budget", "1,024 bytes is below",
                                                        "smallest accepted budget is 65,536")),
    (["--max-tokens", "-1"], ("max_tokens", "-1")),
])  # fmt: skip
def test_bad_option_values_exit_2(capsys, tiny_llama, tmp_path, argv, phrases):
    code, _, err = run(capsys, "generate", "--model", tiny_llama, "--cache-dir", tmp_path,
                       *argv, PROMPT)
    assert_one_line_error(code, err, *phrases)


def test_unparseable_option_is_argparse_usage_error(capsys, tiny_llama):
    with pytest.raises(SystemExit) as exc:
        cli.main(["generate", "--model", str(tiny_llama), "--max-tokens", "four", PROMPT])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "invalid int value: 'four'" in err and "Traceback" not in err


# --- help ---------------------------------------------------------------------------------------

SAMPLING = ["--model", "--max-tokens", "--temperature", "--top-k", "--top-p", "--min-p",
            "--repeat-penalty", "--seed", "--kv-budget", "--regenerator", "--kv-dtype",
            "--cache-dir", "--prefix-cache", "--raw"]
HELP = {
    "generate": ["prompt", *SAMPLING],
    "chat": SAMPLING,
    "inspect": ["file"],
    "validate": ["--model", "--tokens", "--kv-budget", "--regenerator", "--continuation",
                 "--chunk-tokens", "--cache-dir", "--compare"],
    "serve": ["--host", "--port", "--model", "--name", "--kv-budget", "--cache-dir",
              "--prefix-cache", "--max-active", "--max-queue", "--max-tokens"],
}


@pytest.mark.parametrize("cmd", HELP)
def test_subcommand_help_lists_its_options(capsys, monkeypatch, cmd):
    monkeypatch.setenv("COLUMNS", "100")
    with pytest.raises(SystemExit) as exc:
        cli.main([cmd, "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: cfr-atlas {cmd}")
    for option in HELP[cmd]:
        assert option in out, option


def test_top_level_help_lists_subcommands(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert all(cmd in out for cmd in HELP)


# --- inspect and generate on a tiny model -------------------------------------------------------


def test_inspect_prints_metadata_tensors_and_kv_bytes_per_token(capsys, tiny_llama):
    code, out, _ = run(capsys, "inspect", tiny_llama)
    assert code == 0
    assert f"file: {tiny_llama}" in out
    assert "general.architecture = llama" in out and "llama.block_count = 2" in out
    assert "Q8_0" in out and "F32" in out  # matrices and norms
    per_token = 2 * 2 * 2 * (64 // 4)  # K and V, 2 layers, 2 kv heads, head_dim 16
    assert (f"K/V bytes per token: {per_token * 2:,} (float16, the default), "
            f"{per_token * 4:,} (float32)") in out


def telemetry(err: str) -> dict[str, str]:
    """label -> value of the `# label value` lines that must make up all of stderr, besides
    the kernel-compilation report a cold numba cache prints (cfr_atlas.jit_progress)."""
    lines = [line for line in err.splitlines()
             if line != HEADER and not re.match(r"  \[\d+\] \S+ \.\.\. [\d.]+ s$", line)]
    assert lines and all(line.startswith("# ") for line in lines), err
    t = {line[2:18].strip(): line[19:] for line in lines}
    assert [label for label in t if label in TELEMETRY] == list(TELEMETRY), err
    return t


def size_bytes(text: str) -> float:
    """'384.0 KiB' -> 393216.0, as the CLI prints sizes."""
    value, unit = text.split()
    return float(value) * 1024 ** ["B", "KiB", "MiB", "GiB"].index(unit)


def test_generate_prints_text_then_telemetry_on_stderr(capsys, tiny_llama, tmp_path):
    code, out, err = run(capsys, "generate", "--model", tiny_llama, "--max-tokens", 4,
                         "--cache-dir", tmp_path, "--raw", PROMPT)
    assert code == 0
    assert out == load_model(tiny_llama).generate(PROMPT, max_tokens=4) + "\n"
    assert out.strip()
    t = telemetry(err)
    assert t["kv budget"] == "unbounded" and t["pages regen'd"] == "0"
    assert t["prefill tok/s"].split(" s)")[0].split("(")[1].startswith("prompt 5, 5 computed, ")
    assert t["decode tok/s"].split("(")[1].startswith("4 tokens, ")
    for label in ("prefill tok/s", "decode tok/s"):  # each phase timed: a rate, not "-"
        assert float(t[label].split()[0]) > 0, t[label]


@pytest.mark.parametrize("regenerator", ["spill", "recompute"])
def test_generate_under_kv_budget_prints_the_same_text(capsys, tiny_llama, tmp_path,
                                                       regenerator):
    prompt = validation_text()[:2500]  # ~1800 tiny tokens: 450 KiB of float16 K/V vs 384 KiB
    common = ["generate", "--model", tiny_llama, "--max-tokens", 4, "--cache-dir", tmp_path,
              "--raw", prompt]
    code, full_out, full_err = run(capsys, *common)
    assert code == 0
    # recompute also pays for its kept layer inputs (512 B per token here, ~900 KiB)
    budget = "384KiB" if regenerator == "spill" else "1408KiB"
    code, out, err = run(capsys, *common, "--kv-budget", budget, "--regenerator", regenerator)
    assert code == 0
    assert out == full_out and out.strip()
    t = telemetry(err)
    assert t["kv budget"] == ("384.0 KiB" if regenerator == "spill" else "1.4 MiB")
    # printed to 0.1 of a unit, like the budget itself: rounding keeps <= (it is monotone)
    assert size_bytes(t["peak resident kv"]) <= size_bytes(t["kv budget"])
    assert size_bytes(t["allocated kv"].split(" (")[0]) <= size_bytes(t["kv budget"])
    assert t["full kv"] == telemetry(full_err)["full kv"]
    assert int(t["pages regen'd"].replace(",", "")) > 0


CHECK_EXACT = ["generate", "--max-tokens", 4, "--kv-budget", "384KiB", "--check-exact", "--raw",
               validation_text()[:2500]]  # ~1800 tiny tokens: 900 KiB of K/V against 384 KiB


def exact_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("# exact")]
    assert len(lines) == 1, err
    return lines[0]


# recompute keeps ~900 KiB of layer inputs inside the budget, so it needs a larger one; both
# leave far less than the 900 KiB of K/V hot
@pytest.mark.parametrize("regenerator,budget", [("spill", "384KiB"), ("recompute", "1280KiB")])
def test_check_exact_passes_when_budgeted_run_is_bitwise_equal(capsys, tiny_llama, tmp_path,
                                                               regenerator, budget):
    code, out, err = run(capsys, *CHECK_EXACT, "--model", tiny_llama, "--cache-dir", tmp_path,
                         "--regenerator", regenerator, "--kv-budget", budget)
    assert code == 0, err
    assert out.strip()
    assert "yes: bitwise equal to the all-in-RAM run" in exact_line(err)
    assert int(telemetry(err)["pages regen'd"].replace(",", "")) > 0  # the budget really bit


def test_check_exact_fails_on_a_real_mismatch(capsys, monkeypatch, tiny_llama, tmp_path):
    """A page file whose mapped pages silently hold one V value off in its last bit (with
    checksums to match): the budgeted run's logits differ from the all-in-RAM run's, so exit 1."""
    from cfr_atlas.atlas.page_sum import page_checksum
    from cfr_atlas.kv.page_file import SpillKv

    faults = []
    real = SpillKv.map_pages

    def corrupted(self, layer, heads, lo, lens, need):
        maps = real(self, layer, heads, lo, lens, need)
        v, expect = maps.v.copy(), maps.expect.copy()
        for h, i in np.argwhere(need & ~maps.missing):
            s = maps.slot[h, i]
            v[s].reshape(-1).view(np.uint8)[0] ^= 1  # the last bit of one V element
            expect[h, i] = page_checksum(maps.k[s], v[s])
            faults.append((layer, h, i))
        return maps._replace(v=v, expect=expect)

    monkeypatch.setattr(SpillKv, "map_pages", corrupted)
    code, out, err = run(capsys, *CHECK_EXACT, "--model", tiny_llama, "--cache-dir", tmp_path)
    assert faults, "the budgeted run regenerated no page: the fault never fired"
    assert code == 1, err
    line = exact_line(err)
    assert "NO: they differ from the all-in-RAM run" in line and "all 4 steps" in line


def test_generate_applies_the_chat_template_unless_raw(capsys, tiny_llama, tmp_path):
    _, _, err = run(capsys, "generate", "--model", tiny_llama, "--max-tokens", 1,
                    "--cache-dir", tmp_path, PROMPT)
    model = load_model(tiny_llama)
    n_chat = len(model.chat_ids([{"role": "user", "content": PROMPT}]))
    assert f"(prompt {n_chat}, " in telemetry(err)["prefill tok/s"]


@pytest.mark.slow
def test_bundled_model_end_to_end(capsys, bundled_model_path, tmp_path):
    code, out, _ = run(capsys, "inspect")
    assert code == 0 and "K/V bytes per token: 23,040 (float16, the default), 46,080" in out
    args = ["generate", "--max-tokens", 8, "--cache-dir", tmp_path,
            "What is the capital of France? Answer in one word."]
    code, full, _ = run(capsys, *args)
    assert code == 0 and "Paris" in full
    code, budgeted, err = run(capsys, *args, "--kv-budget", "2MiB")
    assert code == 0 and budgeted == full
    assert telemetry(err)["kv budget"] == "2.0 MiB"
