"""benchmarks/trl_bench.py, the H200 comparison of TRL's trainers, as a dry run on the CPU: every implementation in
its own process, the same first loss, leantune's head serving every step."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("trl")
SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "trl_bench.py"


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    from transformers import LlamaConfig

    from leantune import assets

    folder = tmp_path_factory.mktemp("trl_bench") / "model"
    LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # SmolLM2's, whose vocabulary the config matches
        shutil.copy(Path(assets.smollm2_path()) / name, folder / name)
    return str(folder)


@pytest.mark.parametrize("trainer", ["sft", "dpo"])
def test_trl_bench_dry_run(model_folder, tmp_path, trainer, capsys, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parents[1] / "src"))
    spec = importlib.util.spec_from_file_location("trl_bench", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    code = bench.main(["--config", model_folder, "--trainer", trainer, "--impls", "trl,leantune,leantune+default-gc",
                       "--seq", "32", "--warmup", "1", "--steps", "1", "--device", "cpu", "--out", str(tmp_path)])
    assert code == 0
    trl_run, ours = (json.loads((tmp_path / f"{trainer}-{impl}.json").read_text()) for impl in ("trl", "leantune"))
    assert trl_run["status"] == ours["status"] == "ok"
    assert trl_run["loss_head_calls"] == 0
    assert ours["loss_head_calls"] == 2 * (2 if trainer == "dpo" else 1)  # per step; DPO adds the reference pass
    assert "leantune" in ours["summary_loss_runs"]
    default_gc = json.loads((tmp_path / f"{trainer}-leantune-default-gc.json").read_text())
    assert ours["frozen_objects"] > 1000 and trl_run["frozen_objects"] == default_gc["frozen_objects"] == 0
    assert default_gc["first_loss"] == ours["first_loss"] and default_gc["loss_head_calls"] == ours["loss_head_calls"]
    assert abs(ours["first_loss"] - trl_run["first_loss"]) <= 1e-2 * abs(trl_run["first_loss"])  # bf16 model
    assert ours["tokens_per_s"] > 0 and len(ours["step_s"]) == 1
    if trainer == "sft":  # the trainer's own count of the tokens it fed: the whole row
        assert ours["tokens"] == trl_run["tokens"] == [32]
    else:  # the chosen and rejected rows, each at most --seq tokens
        assert 0 < ours["tokens"][0] == trl_run["tokens"][0] <= 2 * 32
    table = capsys.readouterr().out
    assert f"| {trainer} | leantune |" in table and (tmp_path / f"{trainer}-table.md").exists()
    assert "| reference |" in table and table.rstrip().endswith("| ok |")
    with pytest.raises(SystemExit):  # an unknown name stops the run before any implementation runs
        bench.main(["--config", model_folder, "--impls", "leantune,hf", "--out", str(tmp_path / "bad")])
    assert not (tmp_path / "bad" / "sft-leantune.json").exists()
