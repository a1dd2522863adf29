"""`leantune bench cpu` end to end on a tiny Llama: two real child processes, alternating steps, agreement of the
patched and unpatched step, and the option checks."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from leantune.cli import main as cli_main

TINY = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True)


@pytest.fixture
def tiny_model(tmp_path):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**TINY), dtype=torch.float32)
    model.save_pretrained(tmp_path / "tiny")
    return str(tmp_path / "tiny")


def test_bench_cpu_runs_both_sides_alternating_and_they_agree(tiny_model, tmp_path, capsys):
    out = tmp_path / "r" / "cpu.json"
    assert cli_main(["bench", "cpu", "--model", tiny_model, "--batch", "2", "--seq", "24", "--steps", "3",
                     "--warmup", "0", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "leantune / hf+peft: time" in printed and "peak RSS" in printed
    result = json.loads(out.read_text())
    assert result["spec"] == {"model": tiny_model, "batch": 2, "seq": 24, "warmup": 0, "threads": 1, "seed": 0}
    for side in ("hf+peft", "leantune"):
        r = result[side]
        assert len(r["wall_s"]) == len(r["cpu_s"]) == 3 and min(r["wall_s"]) > 0
        assert r["median_wall_s"] == sorted(r["wall_s"])[1]
        assert r["rss_peak"] >= r["rss_loaded"] > 0
    assert result["time_ratio"] == pytest.approx(result["leantune"]["median_wall_s"]
                                                 / result["hf+peft"]["median_wall_s"])
    assert result["rss_ratio"] == pytest.approx(result["leantune"]["rss_peak"] / result["hf+peft"]["rss_peak"])
    # the same seed, weights and tokens on both sides: the fp32 loss and LoRA gradients agree (docs/design.md,
    # "Tests and tolerance")
    assert result["loss_rel_error"] <= 1e-5 and result["grad_rel_error"] <= 1e-5


@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], "--steps must be >= 1"),
    (["--threads", "0"], "--threads must be >= 1"),
    (["--warmup", "-1"], "--warmup must be >= 0"),
    (["--model", "/no/such/folder"], "expected a Hugging Face model folder"),
])
def test_bench_cpu_option_errors(argv, message, capsys):
    code = cli_main(["bench", "cpu", *argv])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err and message in err
