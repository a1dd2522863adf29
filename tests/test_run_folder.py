"""The run folder (``--output``): nothing of the user's is lost, a replaced run is kept until the new one finishes,
``--resume`` continues only the same run, a folder in use is refused (docs/design.md, "Run folder and signals")."""

from __future__ import annotations

import json

import cli_support
import pytest
import torch
from cli_support import assert_error, files_of, run_cli, stopped_run, strict_json, train_args
from test_train import write_chat_jsonl

from leantune.cli import main

tiny = cli_support.tiny  # the fixture: a tiny model and chat data


def test_existing_run_is_never_overwritten(tiny, tmp_path, capsys):
    out = tmp_path / "out"
    code, err = run_cli(capsys, *train_args(tiny, out))
    assert code == 0, err
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    code, err = run_cli(capsys, *train_args(tiny, out))
    assert_error(code, err, "already holds a run", "--overwrite", "--resume")
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    # a data error with --overwrite still leaves the old run alone
    code, err = run_cli(capsys, *train_args(tiny, out, "--overwrite", data=tmp_path / "missing.jsonl"))
    assert_error(code, err, "data file not found")
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    code, err = run_cli(capsys, *train_args(tiny, out, "--overwrite", "--seed", "1"))
    assert code == 0, err
    assert json.loads((out / "run.json").read_text())["config"]["seed"] == 1


def test_resume_without_checkpoint(tiny, tmp_path, capsys):
    code, err = run_cli(capsys, *train_args(tiny, tmp_path / "out", "--resume"))
    assert_error(code, err, "nothing to resume", str(tmp_path / "out"))


def test_output_folder_of_other_files_needs_overwrite_and_keeps_them(tiny, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    code, err = run_cli(capsys, *train_args(tiny, out))
    assert_error(code, err, f"output dir {out} is not empty and holds no leantune run", "--overwrite")
    assert files_of(out) == {out / "notes.txt": b"mine"}
    # a user file with the name of a run output is never replaced, not even with --overwrite
    (out / "metrics.jsonl").write_text("my metrics")
    code, err = run_cli(capsys, *train_args(tiny, out, "--overwrite"))
    assert_error(code, err, "metrics.jsonl", "choose another --output")
    assert files_of(out) == {out / "notes.txt": b"mine", out / "metrics.jsonl": b"my metrics"}
    (out / "metrics.jsonl").unlink()
    code, err = run_cli(capsys, *train_args(tiny, out, "--overwrite"))
    assert code == 0, err
    assert (out / "notes.txt").read_text() == "mine" and (out / "adapter").is_dir()


def test_run_that_crashed_before_its_first_checkpoint_can_be_rerun(tiny, tmp_path, capsys, monkeypatch):
    """An unexpected failure after run.json is written leaves an incomplete run, which a plain re-run replaces."""
    from leantune.train import loop, run_folder

    out = tmp_path / "out"
    real_evaluate = loop.evaluate

    def crash(*args, **kwargs):
        raise RuntimeError("simulated crash")

    monkeypatch.setattr(loop, "evaluate", crash)
    with pytest.raises(RuntimeError, match="simulated crash"):
        main([str(a) for a in train_args(tiny, out)])
    assert (out / "run.json").is_file() and not run_folder.holds_run(out)
    monkeypatch.setattr(loop, "evaluate", real_evaluate)
    code, err = run_cli(capsys, *train_args(tiny, out))
    assert code == 0, err
    assert run_folder.holds_run(out)
    code, err = run_cli(capsys, *train_args(tiny, out))  # a finished run still needs --overwrite
    assert_error(code, err, "already holds a run")


def test_a_diverged_run_stops_with_one_line_and_warn_goes_on_with_strict_json(tiny, tmp_path, capsys):
    out = tmp_path / "out"
    code, err = run_cli(capsys, *train_args(tiny, out, "--max-steps", "2", "--lr", "1e308"))
    assert_error(code, err, "training diverged at step 2", "is nan", "no checkpoint was saved before it",
                 "--divergence warn")
    records = [strict_json(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in records if r["type"] == "train"][-1] is None
    assert not (out / "adapter").exists() and not (out / "checkpoints").exists()  # no diverged weights saved
    out = tmp_path / "warned"
    code, err = run_cli(capsys, *train_args(tiny, out, "--max-steps", "2", "--lr", "1e308", "--divergence", "warn",
                                            "--eval-size", "1000"))
    assert code == 0, err
    assert err.count("leantune: warning: the run diverged at step 2") == 1
    clamped = [line for line in err.splitlines() if "--eval-size 1000" in line]
    rows = strict_json((out / "run.json").read_text())["data"]["eval_rows"]
    assert len(clamped) == 1 and f"-> {rows} rows for this 2-step run" in clamped[0], err
    records = [strict_json(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in records if r["type"] == "train"][-1] is None
    summary = strict_json((out / "summary.json").read_text())
    assert summary["final_eval_loss"] is None and summary["initial_eval_loss"] > 0
    strict_json((out / "run.json").read_text())


def test_a_huge_lr_stuck_at_zero_gradient_norm_stops(tiny, tmp_path, capsys):
    """--lr 1e6 saturates the softmax: the loss sits at ln(vocab) and the gradient norm is 0.0 from step 2 on."""
    import math

    out = tmp_path / "out"
    code, err = run_cli(capsys, *train_args(tiny, out, "--max-steps", "8", "--lr", "1e6", "--save-every", "1"))
    assert_error(code, err, "training diverged at step 4", "zero for 3 logged steps in a row",
                 "no checkpoint was saved before it")
    train = [r for r in map(strict_json, (out / "metrics.jsonl").read_text().splitlines()) if r["type"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3, 4] and [r["grad_norm"] for r in train[1:]] == [0.0] * 3
    assert abs(train[-1]["loss"] - math.log(259)) < 1e-3  # the tiny tokenizer's 259 tokens: a uniform guess


def test_divergence_keeps_the_last_good_checkpoint(tiny, tmp_path, capsys, monkeypatch):
    """Zero norms from step 3: the weights of step 2 are the first measured bad (at step 3), so step 1's checkpoint
    is the last good one; it is kept past --keep-checkpoints 2 while steps 3 and 4 are saved, and named."""
    from leantune.train import loop

    out = tmp_path / "out"
    real_clip, calls = loop._clip, []

    def zero_from_step_3(params, max_norm):
        calls.append(real_clip(params, max_norm))
        return 0.0 if len(calls) >= 3 else calls[-1]

    monkeypatch.setattr(loop, "_clip", zero_from_step_3)
    code, err = run_cli(capsys, *train_args(tiny, out, "--max-steps", "8", "--save-every", "1"))
    assert_error(code, err, "training diverged at step 5", f"last good checkpoint is {out / 'checkpoints'}"
                 "/step-000001", "leantune export --adapter")
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000001", "step-000003", "step-000004"]


def test_divergence_guard_rules():
    from leantune.train.divergence import DivergenceGuard

    guard = DivergenceGuard(factor=4.0, zero_grad_steps=2, reference=2.0)
    assert guard.observe(1, 2.5, 1.0) is None and guard.observe(2, 7.9, 1.0) is None
    assert "above --divergence-factor 4 x the initial loss 2" in guard.observe(3, 8.1, 1.0)
    assert guard.last_healthy == 2 and guard.trusted(1) and not guard.trusted(2)
    guard = DivergenceGuard(factor=0.0, zero_grad_steps=2)
    assert guard.observe(1, 100.0, 0.0) is None and guard.observe(2, 1e9, 3.0) is None  # factor off; streak broken
    assert guard.observe(3, 1.0, 1e-39) is None and "zero for 2" in guard.observe(4, 1.0, 0.0)
    assert guard.last_healthy == 2
    assert "gradient norm is inf" in DivergenceGuard(4.0, 3).observe(1, 1.0, float("inf"))
    assert DivergenceGuard(4.0, 3).observe(1, 1.0, None) is None  # not measured (clipping off)
    assert DivergenceGuard(4.0, 0).observe(1, 1.0, 0.0) is None


def test_a_users_run_json_is_not_taken_for_a_leantune_run(tiny, tmp_path, capsys):
    out = tmp_path / "out"
    (out / "checkpoints" / "epoch-3").mkdir(parents=True)
    (out / "checkpoints" / "epoch-3" / "model.bin").write_bytes(b"W")
    (out / "run.json").write_text('{"tool": "other"}')
    (out / "metrics.jsonl").write_text("{}\n")
    before = files_of(out)
    code, err = run_cli(capsys, *train_args(tiny, out))
    assert_error(code, err, "not empty and holds no leantune run")
    code, err = run_cli(capsys, *train_args(tiny, out, "--overwrite"))
    assert_error(code, err, "have the names of its outputs", "checkpoints", "run.json")
    assert files_of(out) == before


def test_resume_reads_the_runs_settings_and_refuses_every_differing_flag_at_once(tiny, tmp_path, capsys,
                                                                                  monkeypatch):
    out = tmp_path / "out"
    stopped_run(capsys, monkeypatch, train_args(tiny, out, "--save-every", "1", "--max-steps", "3", "--lora-r", "4"))
    before = files_of(out)
    other = write_chat_jsonl(tmp_path / "other.jsonl", seed=1)
    code, err = run_cli(capsys, *train_args(tiny, out, "--resume", "--max-steps", "5", "--lora-r", "8",
                                            "--seq-len", "32", "--seed", "3", "--lr", "1e-2",
                                            "--target-modules", "q_proj,v_proj", data=other))
    assert_error(code, err, "--resume: --data ", "--seq-len 32 (saved: 64)", "--lora-r 8 (saved: 4)",
                 "--target-modules q_proj,v_proj (saved: all-linear)", "--seed 3 (saved: 0)",
                 "--lr 0.01 (saved: 0.0002)", "--max-steps 5 (saved: 3 steps)", "differ from the run being resumed",
                 "leave them out")
    code, err = run_cli(capsys, "train", "--output", out, "--resume", "--lora-alpha", "1.0")
    assert_error(code, err, "--resume: --lora-alpha 1.0 (saved: 32.0) differs from the run being resumed",
                 "leave it out")
    code, err = run_cli(capsys, "train", "--output", out, "--resume", "--quantize", "fp8")
    assert_error(code, err, "--resume: --quantize fp8 (saved: off) differs")  # as the CLI spells None
    assert files_of(out) == before  # nothing rewritten by a refused resume
    (out / "checkpoints" / ".tmp-step-000003").mkdir()  # a save cut short by a kill
    code, err = run_cli(capsys, "train", "--output", out, "--resume")  # every other setting from run.json
    assert code == 0, err
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000002", "step-000003"]
    assert not (out / ".leantune.lock").exists()
    config = json.loads((out / "run.json").read_text())["config"]
    assert (config["lora_r"], config["max_steps"], config["device"], config["patch"]) == (4, 3, "cpu", "off")
    train = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["type"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3]
    # --config RUN/run.json: a new run with that run's settings (flags still override)
    code, err = run_cli(capsys, "train", "--config", out / "run.json", "--output", tmp_path / "again",
                        "--max-steps", "1")
    assert code == 0, err
    again = json.loads((tmp_path / "again" / "run.json").read_text())["config"]
    assert {k: v for k, v in again.items() if k not in ("output", "max_steps", "resume")} == {
        k: v for k, v in config.items() if k not in ("output", "max_steps", "resume")} | {
        "model": str(tiny["model"].resolve()), "data": str(tiny["data"].resolve())}
    (tmp_path / "settings.json").write_text('{"lr": 1e-3}')
    code, err = run_cli(capsys, "train", "--config", tmp_path / "settings.json", "--output", tmp_path / "x")
    assert_error(code, err, "not the run.json of a leantune run")


def test_output_path_below_a_file_is_refused_before_any_work(tiny, tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    code, err = run_cli(capsys, *train_args(tiny, tmp_path / "afile" / "sub"))
    assert_error(code, err, "is a file, not a directory")
    code, err = run_cli(capsys, *train_args(tiny, ""))
    assert_error(code, err, "--output must name a directory")


def test_an_output_folder_in_use_by_a_live_run_is_refused(tiny, tmp_path, capsys):
    import os
    import subprocess
    import sys

    out = tmp_path / "out"
    out.mkdir()
    (out / ".leantune.lock").write_text(str(os.getppid()))  # a live process: pytest's parent
    code, err = run_cli(capsys, *train_args(tiny, out))
    assert_error(code, err, f"output dir {out} is in use by another leantune run (pid {os.getppid()})")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (out / ".leantune.lock").write_text(str(dead.pid))  # a run that died: its lock is stale
    code, err = run_cli(capsys, *train_args(tiny, out))
    assert code == 0, err
    assert (out / "adapter").is_dir() and not (out / ".leantune.lock").exists()


def test_a_replaced_run_is_kept_until_the_new_one_finishes(tiny, tmp_path, capsys, monkeypatch):
    """--overwrite keeps the finished run aside while the new one has nothing to resume (a crash or OOM of the new
    run would otherwise lose both), puts it back if the new one fails or is stopped then, and deletes it only when
    the new one finishes."""
    from leantune.train import loop

    out = tmp_path / "out"
    code, err = run_cli(capsys, *train_args(tiny, out))
    assert code == 0, err
    finished = files_of(out)
    real_evaluate = loop.evaluate
    seen = []

    def crash(*args, **kwargs):
        seen.extend((p / "adapter").is_dir() for p in out.glob(".replaced-*"))
        raise RuntimeError("simulated crash")

    monkeypatch.setattr(loop, "evaluate", crash)
    with pytest.raises(RuntimeError, match="simulated crash"):
        main([str(a) for a in train_args(tiny, out, "--overwrite", "--seed", "1")])
    assert seen == [True]  # kept aside while the new run ran
    assert files_of(out) == finished and "is back in" in capsys.readouterr().err
    monkeypatch.setattr(loop, "evaluate", real_evaluate)
    code, err = run_cli(capsys, *train_args(tiny, out, "--seed", "1"))  # the finished run is back: refused
    assert_error(code, err, "already holds a run")
    code, err = run_cli(capsys, *train_args(tiny, out, "--seed", "1", "--overwrite"))
    assert code == 0, err
    assert not list(out.glob(".replaced-*")) and files_of(out / "adapter") != {
        p: b for p, b in finished.items() if "adapter" in p.parts}


def test_a_plain_run_never_deletes_what_a_crashed_run_kept_aside(tiny, tmp_path, capsys, monkeypatch):
    """A run killed (no cleanup possible) after moving a finished run aside leaves it in .replaced-*; the next run
    without --overwrite replaces the crashed, incomplete run but keeps the finished one it had set aside."""
    from leantune.train import run_folder

    out = tmp_path / "out"
    code, err = run_cli(capsys, *train_args(tiny, out))
    assert code == 0, err
    kept = out / ".replaced-20260101-000000-x"
    kept.mkdir()
    for name in run_folder.RUN_FILES:
        if (out / name).exists():
            (out / name).rename(kept / name)
    assert run_folder.read_run_info(kept) is not None
    (out / "run.json").write_text((kept / "run.json").read_text())  # the killed run's run.json, no checkpoint
    assert not run_folder.holds_run(out)
    before = files_of(kept)
    code, err = run_cli(capsys, *train_args(tiny, out, "--seed", "2"))
    assert code == 0, err
    assert files_of(kept) == before


def test_resume_and_export_from_another_working_directory(tiny, tmp_path, capsys, monkeypatch):
    """run.json keeps absolute paths: the same files spelled relative to another directory are the same run."""
    monkeypatch.chdir(tiny["data"].parent)
    out = tmp_path / "out"
    args = ["--output", out, "--seq-len", "64", "--batch-size", "2", "--eval-size", "2", "--patch", "off",
            "--device", "cpu", "--save-every", "1"]
    code, err = run_cli(capsys, "train", "--model", "model/config.json", "--data", "chat.jsonl", *args,
                        "--max-steps", "1")
    assert code == 0, err
    monkeypatch.chdir(tmp_path)
    code, err = run_cli(capsys, "train", "--model", tiny["model"], "--data", tiny["data"], *args, "--resume",
                        "--max-steps", "1")
    assert code == 0, err
    assert main(["export", "--adapter", str(out), "--out", str(tmp_path / "merged")]) == 0


def test_a_users_own_replaced_folder_is_the_users_and_kept(tiny, tmp_path, capsys):
    """A .replaced-* folder without a leantune run.json is the user's: the folder counts as not empty, and a run
    written beside it with --overwrite keeps it."""
    out = tmp_path / "out"
    (out / ".replaced-mine").mkdir(parents=True)
    (out / ".replaced-mine" / "k.txt").write_text("precious")
    code, err = run_cli(capsys, *train_args(tiny, out))
    assert_error(code, err, "not empty and holds no leantune run")
    code, err = run_cli(capsys, *train_args(tiny, out, "--overwrite", "--save-every", "1"))
    assert code == 0, err
    assert (out / ".replaced-mine" / "k.txt").read_text() == "precious"


def test_resume_refuses_another_step_count(tiny, tmp_path, capsys, monkeypatch):
    """The warmup and cosine decay are laid out over the step count: resuming with a larger --max-steps used to
    make the learning rate jump back up at the resumed step, so another count is refused, naming the run's."""
    out = tmp_path / "out"
    stopped_run(capsys, monkeypatch, train_args(tiny, out, "--max-steps", "4", "--save-every", "1"))
    before = files_of(out)
    code, err = run_cli(capsys, *train_args(tiny, out, "--resume", "--max-steps", "8"))
    assert_error(code, err, "--resume: --max-steps 8 (saved: 4 steps) differs")
    assert files_of(out) == before
    code, err = run_cli(capsys, *train_args(tiny, out, "--resume", "--max-steps", "4"))
    assert code == 0, err
    lrs = [r["lr"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["type"] == "train"]
    assert len(lrs) == 4 and all(a >= b for a, b in zip(lrs[1:], lrs[2:])), lrs  # decays from the peak, no jump


def test_resume_refuses_data_changed_under_the_same_path(tiny, tmp_path, capsys, monkeypatch):
    """run.json keeps a digest of the data files: --resume on other contents at the same path is refused, before
    anything is written; the same contents (copied back) resume."""
    import shutil

    data = tmp_path / "data.jsonl"
    shutil.copy(tiny["data"], data)
    out = tmp_path / "out"
    stopped_run(capsys, monkeypatch, train_args(tiny, out, "--max-steps", "4", "--save-every", "1", data=data))
    original = data.read_bytes()
    data.write_bytes(original.replace(b"e", b"a", 1))  # same size, other contents
    before = files_of(out)
    code, err = run_cli(capsys, *train_args(tiny, out, "--resume", "--max-steps", "4", data=data))
    assert_error(code, err, f"--resume: the data at {data.resolve()} changed since the run started")
    assert files_of(out) == before
    data.write_bytes(original)
    code, err = run_cli(capsys, *train_args(tiny, out, "--resume", "--max-steps", "4", data=data))
    assert code == 0, err


def test_a_run_killed_while_replacing_another_says_where_that_one_is(tiny, tmp_path, capsys):
    """An --overwrite run killed (SIGKILL: no clean-up) before its first checkpoint leaves the previous run in
    .replaced-*: export and --resume name it instead of only saying there is nothing there."""
    import shutil

    out = tmp_path / "out"
    code, err = run_cli(capsys, *train_args(tiny, out))
    assert code == 0, err
    kept = out / ".replaced-1765000000-0"  # the state a kill leaves: the old run aside, the new one's run.json
    kept.mkdir()
    for entry in list(out.iterdir()):
        if entry != kept:
            shutil.move(str(entry), kept / entry.name)
    shutil.copy(kept / "run.json", out / "run.json")
    code, err = run_cli(capsys, "export", "--adapter", out, "--out", tmp_path / "merged")
    assert_error(code, err, "nothing to export", f"kept in {kept}")
    code, err = run_cli(capsys, *train_args(tiny, out, "--resume"))
    assert_error(code, err, "nothing to resume", f"kept in {kept}")


def test_a_dangling_symlink_as_output_is_one_error_line(tiny, tmp_path, capsys):
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    code, err = run_cli(capsys, *train_args(tiny, tmp_path / "dangling"))
    assert_error(code, err, "is a symlink to a missing target")


def test_a_run_that_finished_in_the_folder_while_this_one_loaded_is_not_replaced(tiny, tmp_path, capsys,
                                                                                  monkeypatch):
    """The output folder is checked again under the lock: a run that finished there meanwhile needs --overwrite."""
    import shutil

    from leantune.train import loop

    out = tmp_path / "out"
    code, err = run_cli(capsys, *train_args(tiny, out, "--save-every", "1"))
    assert code == 0, err
    race = tmp_path / "race"
    real_load = loop.load_model

    def load_while_another_run_finishes(*args, **kwargs):
        shutil.copytree(out, race, ignore=shutil.ignore_patterns(".replaced-*"))
        return real_load(*args, **kwargs)

    monkeypatch.setattr(loop, "load_model", load_while_another_run_finishes)
    code, err = run_cli(capsys, *train_args(tiny, race))
    assert_error(code, err, f"output dir {race} already holds a run")
    names = lambda folder: {p.name: b for p, b in files_of(folder / "adapter").items()}  # noqa: E731
    assert names(race) == names(out) and not (race / ".leantune.lock").exists()


def test_resume_of_an_older_run_json_with_a_relative_path_says_where_to_resume_from(tiny, tmp_path, capsys):
    out = tmp_path / "out"
    code, err = run_cli(capsys, *train_args(tiny, out, "--save-every", "1"))
    assert code == 0, err
    info = json.loads((out / "run.json").read_text())
    info.pop("tool")
    info["model_path"] = "model/config.json"  # as leantune wrote it before run.json held absolute paths
    (out / "run.json").write_text(json.dumps(info))
    code, err = run_cli(capsys, *train_args(tiny, out, "--resume", "--max-steps", "2"))
    assert_error(code, err, "--resume: --model", "relative to where that run started")


def test_a_stop_while_moving_the_replaced_run_aside_puts_all_of_it_back(tiny, tmp_path, capsys, monkeypatch):
    """A Ctrl-C between the moves of the replaced run's files puts all of them back (the part already moved, kept
    without its run.json, is still recognised) and deletes none of the files not moved yet."""
    import os

    out = tmp_path / "out"
    code, err = run_cli(capsys, *train_args(tiny, out))
    assert code == 0, err
    finished = files_of(out)
    real_replace, moves = os.replace, []

    def stopped_on_the_second_move(src, dst):
        if ".replaced-" in str(dst):
            moves.append(dst)
            if len(moves) == 2:
                raise KeyboardInterrupt
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", stopped_on_the_second_move)
    code, err = run_cli(capsys, *train_args(tiny, out, "--overwrite", "--seed", "1"))
    monkeypatch.setattr(os, "replace", real_replace)
    assert code == 130 and "is back in" in err, err
    assert files_of(out) == finished and not list(out.glob(".replaced-*"))


def test_a_damaged_checkpoint_is_one_line_naming_the_file_and_the_earlier_one(tiny, tmp_path, capsys, monkeypatch):
    """Truncated (half its bytes) or, for state.json, garbage: --resume refuses in one line that names the file
    and the checkpoint kept before it, leaves every file as it was, and the advice given works."""
    import hashlib
    import shutil

    stopped = tmp_path / "stopped"
    stopped_run(capsys, monkeypatch, train_args(tiny, stopped, "--save-every", "1", "--max-steps", "3"))
    for name in ("adapter_model.safetensors", "optimizer.pt", "state.json", "rng.pt"):
        out = tmp_path / name
        shutil.copytree(stopped, out)
        damaged = out / "checkpoints" / "step-000002" / name
        raw = damaged.read_bytes()
        damaged.write_bytes(b"\x00garbage{" if name == "state.json" else raw[:len(raw) // 2])
        digests = {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in out.rglob("*") if p.is_file()}
        code, err = run_cli(capsys, "train", "--output", out, "--resume")
        assert_error(code, err, f"checkpoint file {damaged} is truncated or corrupt", "(kept: step-000001)",
                     f"move {damaged.parent} out of", "nothing was deleted")
        assert {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in out.rglob("*") if p.is_file()} == digests
    shutil.move(damaged.parent, tmp_path / "moved-away")  # as the message says
    code, err = run_cli(capsys, "train", "--output", out, "--resume")
    assert code == 0 and "resuming from" in err and "step 1 of 3" in err, err
    # bytes changed inside a file that still decodes (same size): caught by state.json's SHA-256, for resume and
    # for export alike
    for name in ("optimizer.pt", "adapter_model.safetensors"):
        flipped = tmp_path / f"flipped-{name}"
        shutil.copytree(stopped, flipped)
        target = flipped / "checkpoints" / "step-000002" / name
        raw = bytearray(target.read_bytes())
        raw[-200] ^= 0x01  # a tensor byte near the end, past the headers
        target.write_bytes(bytes(raw))
        code, err = run_cli(capsys, "train", "--output", flipped, "--resume")
        assert_error(code, err, f"checkpoint file {target} is truncated or corrupt", "SHA-256 differs")
    code, err = run_cli(capsys, "export", "--adapter", target.parent, "--out", tmp_path / "merged")
    assert_error(code, err, f"checkpoint file {target} is truncated or corrupt", "SHA-256 differs")


def test_resume_and_export_refuse_a_base_model_changed_under_the_same_path(tiny, tmp_path, capsys, monkeypatch):
    """run.json keeps a digest of the base model's config, tokenizer and weight files: other weights of the same
    shapes, or an edited config, at the same path are refused by --resume (before anything is written) and by
    export (the adapter merged into another base would be another model); the original files resume and export."""
    import shutil

    from transformers import AutoTokenizer

    from leantune.train.model import load_model

    base = tmp_path / "base"
    load_model("config", tiny["model"], torch.float32, "cpu", 0).save_pretrained(base)
    AutoTokenizer.from_pretrained(tiny["model"].parent).save_pretrained(base)
    out = tmp_path / "out"
    stopped_run(capsys, monkeypatch, train_args(tiny, out, "--max-steps", "4", "--save-every", "1", model=base))
    weights = base / "model.safetensors"
    original = weights.read_bytes()
    shutil.copy(weights, tmp_path / "kept.safetensors")
    load_model("config", tiny["model"], torch.float32, "cpu", 1).save_pretrained(tmp_path / "other")
    other = (tmp_path / "other" / "model.safetensors").read_bytes()
    assert len(other) == len(original) and other != original  # another draw, the same shapes and header
    weights.write_bytes(other)
    before = files_of(out)
    code, err = run_cli(capsys, *train_args(tiny, out, "--resume", "--max-steps", "4", model=base))
    assert_error(code, err, f"--resume: the base model at {base.resolve()} changed", "(model.safetensors differ)")
    assert files_of(out) == before
    code, err = run_cli(capsys, "export", "--adapter", out, "--out", tmp_path / "merged")
    assert_error(code, err, "the base model of this run changed since it trained", "model.safetensors")
    assert not (tmp_path / "merged").exists()
    weights.write_bytes(original)
    config = (base / "config.json").read_text()
    (base / "config.json").write_text(json.dumps({**json.loads(config), "num_hidden_layers": 3}))
    code, err = run_cli(capsys, *train_args(tiny, out, "--resume", "--max-steps", "4", model=base))
    assert_error(code, err, "(config.json differ)")
    (base / "config.json").write_text(config)
    code, err = run_cli(capsys, *train_args(tiny, out, "--resume", "--max-steps", "4", model=base))
    assert code == 0, err
    code, err = run_cli(capsys, "export", "--adapter", out, "--out", tmp_path / "merged")
    assert code == 0, err
