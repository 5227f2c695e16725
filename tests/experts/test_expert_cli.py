"""`cfr-atlas generate --expert-budget` on a tiny MoE file: same text as all-resident (reading
uncached experts through the page cache or directly), the expert counters on stderr, and a
budget holding no expert or an unknown --expert-reads refused with exit code 2."""

import pytest

from cfr_atlas import cli


def _generate(capsys, path, *extra):
    code = cli.main(["generate", "--model", str(path), "--max-tokens", "4", "--raw", *extra,
                     "The capital of France is"])
    out, err = capsys.readouterr()
    return code, out, err


def test_generate_with_expert_budget_prints_same_text_and_counters(capsys, moe_file):
    path = moe_file("qwen3moe")
    code, full, _ = _generate(capsys, path)
    assert code == 0
    for reads in ("cached", "direct"):
        code, budgeted, err = _generate(capsys, path, "--expert-budget", "25%",
                                        "--expert-policy", "frequency", "--expert-reads", reads)
        assert code == 0 and budgeted == full
        assert "expert hits" in err and "misses" in err


def test_an_unknown_way_of_reading_experts_exits_2(capsys, moe_file):
    with pytest.raises(SystemExit) as exit_:  # argparse's usage error
        _generate(capsys, moe_file("qwen3moe"), "--expert-reads", "fast")
    assert exit_.value.code == 2 and "--expert-reads" in capsys.readouterr().err


def test_expert_budget_below_one_expert_exits_2(capsys, moe_file):
    code, _, err = _generate(capsys, moe_file("qwen3moe"), "--expert-budget", "1KiB")
    assert code == 2 and "expert_budget" in err and "smallest budget" in err
