"""benchmarks/bench_decode.py stays runnable: a --quick run on a generated model prints the table
for three formats, writes JSON and a plot, and (when llama-cpp-python is importable) measures
llama.cpp in its own process beside us; its requantized variants load in our engine and
carry the new types. Also benchmarks/llamacpp_ref.py against our tokenizer and forward pass.
Checks the output's shape, never its speed."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

HAVE_LLAMA_CPP = importlib.util.find_spec("llama_cpp") is not None


@pytest.fixture(scope="module")
def bench(load_benchmark):
    return load_benchmark("bench_decode")


def test_quick_run_prints_table_json_and_plot(bench, tmp_path, capsys):
    out_json, out_png = tmp_path / "rows.json", tmp_path / "plot.png"
    assert bench.main(["--quick", "--json", str(out_json), "--plot", str(out_png)]) == 0
    out = capsys.readouterr().out
    got = json.loads(out_json.read_text())
    rows, meta = got["rows"], got["meta"]
    workloads = ["prefill 32", "prefill 64", "decode @16", "decode @64"]
    assert [(r["format"], r["workload"]) for r in rows] == [
        (f, w) for f in ("Q4_1", "Q4_0", "Q8_0") for w in workloads]
    assert [r["target"] for r in rows[:4]] == [1.5, 1.5, 1.2, 1.5]
    assert all(r["ours"] > 0 and len(r["ours_runs"]) == 1 for r in rows)
    assert all(r["ours-int8"] > 0 and len(r["ours-int8_runs"]) == 1 for r in rows)
    assert "cfr-atlas int8 tok/s" in out
    if HAVE_LLAMA_CPP:
        assert all(r["llamacpp"] > 0 and r["ratio"] == r["ours"] / r["llamacpp"]
                   and r["ratio_int8"] == r["ours-int8"] / r["llamacpp"] for r in rows)
        assert meta["llamacpp_info"]["version"] == "0.3.36"
        assert "| Q8_0 | decode @64 |" in out and "llama-cpp-python 0.3.36" in out
    else:
        assert all(r["llamacpp"] is None and r["ratio"] is None and r["ratio_int8"] is None
                   for r in rows)
        assert "skipped llama.cpp" in out
    assert meta["threads"] == 2 and meta["quick"]
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert all(r["ours-int8_weight_bytes"] > 0 for r in rows)
    assert len(meta["stream_gbs"]) == 2 and min(meta["stream_gbs"]) > 0
    assert "Decode against memory bandwidth" in out and "| Q8_0 | decode @64 | " in out


def test_weight_bytes_and_the_bandwidth_table(bench, tmp_path):
    """The bytes a decode token streams: ours walks the network for every QuantWeight and
    agrees with LlamaWeights.nbytes (the embedding left out only when the head is separate);
    llama.cpp's is the file's tensor bytes. The table's arithmetic by hand."""
    from cfr_atlas.engine import load_model

    tiny = bench.quick_model(tmp_path)
    for arithmetic in ("float", "int8"):
        net = load_model(tiny, matmul=arithmetic).net
        w = net.weights
        untied = w.embed is not w.output
        assert bench.our_weight_bytes(net) == w.nbytes - (w.embed.nbytes if untied else 0)
    tensors = {t.name: int(t.n_bytes) for t in GGUFReader(tiny).tensors}
    head = "output.weight" in tensors
    assert bench.gguf_weight_bytes(tiny) == sum(tensors.values()) - (
        tensors["token_embd.weight"] if head else 0)
    row = {"format": "Q4_0", "kind": "decode", "workload": "decode @16", "ours": 100.0,
           "ours_weight_bytes": 10**8, "ours-int8": None, "ours-int8_weight_bytes": None,
           "llamacpp": 150.0, "llamacpp_weight_bytes": 5 * 10**7}
    table = bench.bandwidth_table([row, {**row, "kind": "prefill"}], stream=20.0)
    # ours: 100 MB x 100 tok/s = 10 GB/s, half of 20, bound 200; llama.cpp: 7.5 GB/s, bound 400
    assert table.splitlines()[2] == ("| Q4_0 | decode @16 | 100.0 | 10.0 | 0.50 | 200 | "
                                     "50.0 | 7.5 | 0.38 | 400 |")
    assert len(table.splitlines()) == 3  # decode rows only


def test_bad_contexts_are_refused(bench):
    with pytest.raises(SystemExit):
        bench.parse_args(["--contexts", "16,20", "--decode-tokens", "16"])  # runs would overlap
    with pytest.raises(SystemExit):
        bench.parse_args(["--engines", "ours,vllm"])


def test_requantized_variants_keep_what_llama_quantize_keeps(load_benchmark, tiny_gguf, tmp_path):
    from cfr_atlas.engine import load_model

    requant = load_benchmark("requant")
    src = tiny_gguf(qtype={"token_embd": "Q8_0", "attn_q": "Q4_1", "attn_k": "Q4_1",
                           "attn_v": "Q4_1", "attn_output": "Q4_1", "ffn_gate": "Q4_1",
                           "ffn_up": "Q4_1", "ffn_down": "Q4_1"})
    files = requant.variants(src, tmp_path, ("Q4_0", "Q8_0"))
    ref = load_model(src).next_logits([5, 6, 7])
    src_r = GGUFReader(src)
    merges = src_r.fields["tokenizer.ggml.merges"].contents()
    before = dequantize(_tensor(src_r, "blk.1.ffn_down.weight").data, GGMLQuantizationType.Q4_1)
    for qtype, path in files.items():
        r = GGUFReader(path)
        assert r.fields["general.file_type"].contents() == requant.FILE_TYPES[qtype]
        types = {t.name: t.tensor_type for t in r.tensors}
        assert types["token_embd.weight"] == GGMLQuantizationType.Q8_0
        assert types["blk.0.attn_norm.weight"] == GGMLQuantizationType.F32
        assert types["blk.1.ffn_down.weight"] == GGMLQuantizationType[qtype]
        assert r.fields["tokenizer.ggml.merges"].contents() == merges
        after = dequantize(_tensor(r, "blk.1.ffn_down.weight").data, GGMLQuantizationType[qtype])
        rel = np.linalg.norm(after - before) / np.linalg.norm(before)
        assert 0 < rel < {"Q4_0": 0.15, "Q8_0": 0.01}[qtype]  # the same weights, requantized
        logits = load_model(path).next_logits([5, 6, 7])
        assert np.corrcoef(logits, ref)[0, 1] > 0.95


def _tensor(r: GGUFReader, name: str):
    return next(t for t in r.tensors if t.name == name)


@pytest.mark.skipif(not HAVE_LLAMA_CPP, reason="llama-cpp-python not installed (bench extra)")
def test_llamacpp_ref_agrees_with_our_tokenizer_and_logits(bench, load_benchmark, tmp_path):
    from cfr_atlas.engine import load_model

    ref = load_benchmark("llamacpp_ref")
    path = bench.quick_model(tmp_path)  # tiny Q4_1 llama that llama.cpp loads
    model = load_model(path)
    text = "The capital of France is Paris, a city with a language model."
    ids = ref.llamacpp_tokenize(path, text, add_bos=False)
    assert ids == model.tokenize(text)
    ours = model.logits(ids)
    theirs = ref.llamacpp_logits(path, ids, threads=2)
    assert theirs.shape == ours.shape == (len(ids), model.config.vocab_size)
    assert theirs.dtype == np.float32
    # llama.cpp multiplies int8-quantized activations: close to ours, never bitwise
    assert np.abs(theirs - ours).max() < 0.5
    assert (theirs.argmax(1) == ours.argmax(1)).mean() >= 0.9
    with pytest.raises(ValueError, match="n_ctx 4"):
        ref.llamacpp_logits(path, ids, n_ctx=4)


def test_wait_policy_is_the_same_for_both_engines(bench, monkeypatch):
    """Both engines run OpenMP thread pools: one OMP_WAIT_POLICY for every worker (a policy
    for llama.cpp alone had held its decode to a third of its speed), and "default" unsets
    it even if the caller's shell set it."""
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    for policy in ("ACTIVE", "PASSIVE", None):
        spec = {"threads": 2, "omp_wait_policy": policy}
        for engine in ("ours", "ours-int8", "llamacpp"):
            env = bench.worker_env(spec | {"engine": engine})
            assert env.get("OMP_WAIT_POLICY") == policy and env["NUMBA_NUM_THREADS"] == "2"
