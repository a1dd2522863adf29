"""benchmarks/trl_bench.py, the H200 comparison of TRL's trainers, as a dry run on the CPU: every implementation in
its own process, the same first loss, leantune's head serving every step; GRPO with generation replaced by fixed
completions, and a run out of memory reported as a status."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import bench_scripts
import pytest
import torch

pytest.importorskip("trl")
GRPO = ["--trainer", "grpo", "--num-generations", "4", "--completion-len", "24", "--prompt-len", "8", "--warmup", "1",
        "--steps", "1", "--device", "cpu"]


def _bench():
    return bench_scripts.load("trl_bench")


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
    bench = _bench()
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


def test_trl_bench_profile_dry_run(model_folder, tmp_path, monkeypatch):
    """--profile runs one more, untimed step under torch.profiler (the CPU records operators)."""
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parents[1] / "src"))
    code = _bench().main(["--config", model_folder, "--trainer", "dpo", "--impls", "leantune", "--seq", "32",
                          "--warmup", "1", "--steps", "1", "--device", "cpu", "--profile", "--out", str(tmp_path)])
    assert code == 0
    run = json.loads((tmp_path / "dpo-leantune.json").read_text())
    assert run["status"] == "ok" and len(run["step_s"]) == 1  # the profiled step is not among the timed ones
    assert run["loss_head_calls"] == 2 * 3  # warm-up, timed and profiled steps, each policy and reference
    assert run["profiled_step_ms"] > 0 and run["kernels_per_step"] > 0 and 0 < run["busy_fraction"] <= 1
    assert run["top_kernels"] and all(k["ms_per_step"] > 0 for k in run["top_kernels"])


def test_trl_bench_grpo_dry_run(model_folder, tmp_path, capsys, monkeypatch):
    """GRPO, TRL's head against leantune's, each in its process: the fixed completions ran once per step and real
    generation never; TRL counted exactly their tokens; the first step agrees (grad norm through the head, the
    head's entropy) and leantune's head served the reference and the policy pass of every step."""
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parents[1] / "src"))
    bench = _bench()
    code = bench.main(["--config", model_folder, "--impls", "trl,leantune", *GRPO, "--out", str(tmp_path)])
    assert code == 0
    trl_run, ours = (json.loads((tmp_path / f"grpo-{impl}.json").read_text()) for impl in ("trl", "leantune"))
    for run in (trl_run, ours):
        assert run["status"] == "ok", run
        assert run["rollout_calls"] == 2 and run["generate_calls"] == 0  # warm-up + timed step, one each
        assert run["tokens"] == [4 * (8 + 24)]  # TRL's own count: prompt + completion tokens of the group
        assert 0 <= run["generation_s"][0] < run["step_s"][0]
        assert run["first_reward_std"] > 0  # the hashed rewards spread: non-zero advantages
    assert trl_run["loss_head_calls"] == 0
    assert ours["loss_head_calls"] == 2 * 2  # per step: the reference pass (no gradient) and the policy's
    assert "ops.linear_log_probs" in ours["summary_loss_runs"]
    # bf16 model: two heads' gradient norms and entropies within bf16 bounds; the first loss is -mean(advantage)
    assert abs(ours["first_grad_norm"] - trl_run["first_grad_norm"]) <= 3e-2 * trl_run["first_grad_norm"]
    assert abs(ours["first_entropy"] - trl_run["first_entropy"]) <= 1e-2 * trl_run["first_entropy"]
    assert abs(ours["first_loss"] - trl_run["first_loss"]) <= 1e-6
    table = capsys.readouterr().out
    assert "| grpo | leantune | 4 x (8+24) |" in table and table.rstrip().endswith("| ok |")
    for bad in (["--micro-batch", "3"], ["--num-generations", "1"], ["--memory-cap-gib", "0"]):
        with pytest.raises(SystemExit):  # stopped before any implementation runs
            bench.main(["--config", model_folder, "--impls", "leantune", *GRPO, *bad, "--out", str(tmp_path / "bad")])
    assert not (tmp_path / "bad" / "grpo-leantune.json").exists()


def test_trl_bench_grpo_oom_is_a_status(model_folder, tmp_path, monkeypatch):
    """A GRPO step that runs out of memory (simulated: the completions' substitute raises torch's OutOfMemoryError)
    is a result with status oom and a table row, not a crash; at that point real generation is fenced off."""
    bench = _bench()
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "0")  # restored after: the child sets it
    seen = {}

    def out_of_memory(self, prompts, trainer):
        for call in (trainer._generate_single_turn, trainer.model.generate, trainer.model.get_base_model().generate):
            with pytest.raises(RuntimeError, match="real generation was called"):
                call()
        seen["prompts"] = len(prompts)
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB (simulated)")

    monkeypatch.setattr(bench.FixedRollouts, "__call__", out_of_memory)
    code = bench.main(["--config", model_folder, *GRPO, "--memory-cap-gib", "80", "--out", str(tmp_path),
                       "--impl", "leantune+offload"])  # the child's path, in this process
    assert code == 0
    row = json.loads((tmp_path / "grpo-leantune-offload.json").read_text())
    assert row["status"] == "oom" and "simulated" in row["error"] and row["steps_done"] == 0
    assert row["generate_calls"] == 3 and seen["prompts"] == 4  # one prompt row per completion of the group
    line = bench.table([row]).splitlines()[-1]
    assert line.startswith("| grpo | leantune+offload | 4 x (8+24), cap 80 GiB | oom: CUDA out of memory")
