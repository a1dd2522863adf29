"""The ``leantune`` command line: every user error is one stderr line, a non-zero exit, no traceback, nothing
overwritten; ``--help`` documents every option with its default; the demo subcommand carries its own defaults."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from test_train import write_chat_jsonl, write_tiny_model

from leantune.cli import DEMO_DEFAULTS, main
from leantune.train.config import FIELDS


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    return {"model": write_tiny_model(root / "model"), "data": write_chat_jsonl(root / "chat.jsonl", n=60)}


def run_cli(capsys, *argv):
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.err


def train_args(tiny, output, *extra, data=None, model=None):
    return ["train", "--model", model or tiny["model"], "--data", data or tiny["data"], "--output", output,
            "--seq-len", "64", "--batch-size", "2", "--max-steps", "1", "--eval-size", "2", "--patch", "off",
            "--device", "cpu", *extra]


def assert_error(code, err, *fragments):
    assert code == 1, err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("leantune: error: ")]
    assert len(lines) == 1, err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_missing_data_file_is_named(tiny, tmp_path, capsys):
    missing = tmp_path / "nope.jsonl"
    code, err = run_cli(capsys, *train_args(tiny, tmp_path / "out", data=missing))
    assert_error(code, err, "data file not found", str(missing))
    assert not (tmp_path / "out").exists()


def test_unreadable_data_file(tiny, tmp_path, capsys):
    code, err = run_cli(capsys, *train_args(tiny, tmp_path / "out", data=tmp_path))
    assert_error(code, err, "data file is a directory", str(tmp_path))


def test_malformed_json_line_names_file_and_line(tiny, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n\n{"text": "broken"\n')
    code, err = run_cli(capsys, *train_args(tiny, tmp_path / "out", data=bad))
    assert_error(code, err, "malformed JSON", f"{bad}:3")


def test_record_without_known_fields(tiny, tmp_path, capsys):
    bad = tmp_path / "odd.jsonl"
    bad.write_text('{"text": "fine"}\n{"question": "?"}\n')
    code, err = run_cli(capsys, *train_args(tiny, tmp_path / "out", data=bad))
    assert_error(code, err, f"{bad}:2", "'text', 'messages'")


def test_empty_dataset_after_filtering(tiny, tmp_path, capsys):
    only_users = tmp_path / "users.jsonl"
    only_users.write_text(json.dumps({"messages": [{"role": "user", "content": "hello"}]}) + "\n")
    code, err = run_cli(capsys, *train_args(tiny, tmp_path / "out", data=only_users))
    assert_error(code, err, "empty dataset after filtering", str(only_users))


def test_too_long_examples_are_truncated_and_counted(tiny, tmp_path, capsys):
    long = tmp_path / "long.jsonl"
    long.write_text("".join(json.dumps({"text": "word " * n}) + "\n" for n in (5, 40, 6, 50, 7, 8, 9, 4) * 3))
    code, err = run_cli(capsys, *train_args(tiny, tmp_path / "out", data=long))
    assert code == 0, err
    assert "6 of 24 examples were longer than --seq-len 64 and were truncated" in err
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["truncated"] == 6


@pytest.mark.parametrize("kind", ["missing", "folder-without-config", "other-suffix", "unknown-type"])
def test_unknown_or_unsupported_model(tiny, tmp_path, capsys, kind):
    if kind == "missing":
        model, expected = tmp_path / "no-such-model", "model not found"
    elif kind == "folder-without-config":
        (tmp_path / "empty").mkdir()
        model, expected = tmp_path / "empty", "no config.json"
    elif kind == "other-suffix":
        model, expected = tmp_path / "weights.bin", "unsupported model path"
        model.write_bytes(b"\0")
    else:
        model, expected = write_tiny_model(tmp_path / "weird", model_type="not-a-model"), "unsupported model type"
    code, err = run_cli(capsys, *train_args(tiny, tmp_path / "out", model=model))
    assert_error(code, err, expected, str(model))
    assert not (tmp_path / "out").exists()


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


def test_bad_option_values_and_config_file(tiny, tmp_path, capsys):
    code, err = run_cli(capsys, *train_args(tiny, tmp_path / "out", "--lora-dropout", "1.5"))
    assert_error(code, err, "--lora-dropout")
    code, err = run_cli(capsys, *train_args(tiny, tmp_path / "out", "--config", tmp_path / "missing.toml"))
    assert_error(code, err, "config file not found")
    toml = tmp_path / "run.toml"
    toml.write_text("learning_rate = 1\n")
    code, err = run_cli(capsys, *train_args(tiny, tmp_path / "out", "--config", toml))
    assert_error(code, err, "unknown key 'learning_rate'", str(toml))


def test_export_errors(tmp_path, capsys):
    code, err = run_cli(capsys, "export", "--adapter", tmp_path, "--out", tmp_path / "merged")
    assert_error(code, err, "no adapter in")


@pytest.mark.parametrize("command", ["train", "demo"])
def test_help_lists_every_option_with_default(capsys, command):
    from leantune.cli import build_parser

    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    sub = next(a for a in build_parser()._actions if a.dest == "command").choices[command]
    options = {a.option_strings[-1]: a for a in sub._actions if a.option_strings and a.dest != "help"}
    assert set(options) == {"--config"} | {"--" + name.replace("_", "-") for name in FIELDS}
    for flag, action in options.items():
        assert flag in text
        assert "(default: " in action.help, flag
        assert " ".join(action.help.replace("%%", "%").split()) in text, flag
    if command == "demo":
        assert f"output directory (default: {DEMO_DEFAULTS['output']})" in text
        assert f"(default: {DEMO_DEFAULTS['seq_len']})" in text


def test_export_help(capsys):
    with pytest.raises(SystemExit):
        main(["export", "--help"])
    out = capsys.readouterr().out
    assert "--adapter" in out and "--out" in out and "--overwrite" in out


# ---------------------------------------------------------------------------------------------------------------
# New-user test findings (issue 6): every bad value is refused up front, nothing of the user's is lost.


def files_of(folder):
    return {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def strict_json(text):
    def refuse(constant):
        raise ValueError(f"non-JSON constant {constant}")

    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize("line, fragments", [
    ('overwrite = "no"', ["config key 'overwrite'", "boolean", "'no'"]),
    ('resume = "yes"', ["config key 'resume'", "boolean", "'yes'"]),
    ('lr = "fast"', ["config key 'lr'", "must be a number", "'fast'"]),
    ('max_steps = "2"', ["config key 'max_steps'", "must be an integer", "'2'"]),
    ("max_steps = 2.7", ["config key 'max_steps'", "must be an integer", "2.7"]),
    ("seq_len = true", ["config key 'seq_len'", "must be an integer"]),
    ("data = 5", ["config key 'data'", "must be a string", "5"]),
    ('gradient_checkpointing = "maybe"', ["--gradient-checkpointing", "on or off", "'maybe'"]),
    ("target_modules = [1, 2]", ["config key 'target_modules'", "list of module names"]),
    ("lr = inf", ["--lr", "finite"]),
    ("weight-decay = nan", ["--weight-decay", "finite"]),
])
def test_toml_values_are_type_checked_before_anything_runs(tiny, tmp_path, capsys, line, fragments):
    """A TOML value of the wrong type (e.g. the truthy string overwrite = "no") is an error naming the key; an
    existing run is left as it was."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "run.json").write_text("{}")
    (out / "summary.json").write_text("{}")  # a finished run: --overwrite would be needed to replace it
    before = files_of(out)
    toml = tmp_path / "run.toml"
    toml.write_text(line + "\n")
    code, err = run_cli(capsys, *train_args(tiny, out, "--config", toml))
    assert_error(code, err, *fragments)
    assert files_of(out) == before


def test_toml_lists_and_booleans_that_are_natural_in_toml(tiny, tmp_path, capsys):
    """target_modules as a list; gradient_checkpointing / patch as true/false; "after 1 step" (singular)."""
    toml = tmp_path / "run.toml"
    toml.write_text('target_modules = ["q_proj", "v_proj"]\ngradient_checkpointing = true\npatch = false\n'
                    "lora_alpha = 16\n")
    out = tmp_path / "out"
    code = main([str(a) for a in train_args(tiny, out, "--config", toml)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "after 1 step;" in captured.out
    config = json.loads((out / "run.json").read_text())["config"]
    assert (config["target_modules"], config["gradient_checkpointing"], config["patch"]) == ("q_proj,v_proj", "on",
                                                                                             "off")
    assert config["lora_alpha"] == 16.0
    adapter = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert sorted(adapter["target_modules"]) == ["q_proj", "v_proj"]


@pytest.mark.parametrize("flag, value, fragment", [
    ("--lr", "inf", "--lr must be a finite number"),
    ("--lr", "nan", "--lr must be a finite number"),
    ("--lr", "0", "--lr must be > 0"),
    ("--weight-decay", "inf", "--weight-decay must be a finite number"),
    ("--weight-decay", "-1", "--weight-decay must be >= 0"),
    ("--lora-alpha", "inf", "--lora-alpha must be a finite number"),
    ("--lora-alpha", "0", "--lora-alpha must be > 0"),
    ("--lora-alpha", "-2", "--lora-alpha must be > 0"),
    ("--epochs", "inf", "--epochs must be a finite number"),
    ("--max-grad-norm", "nan", "--max-grad-norm must be a finite number"),
    ("--max-grad-norm", "-1", "--max-grad-norm must be >= 0"),
    ("--warmup-steps", "-1", "--warmup-steps must be >= 0"),
    ("--min-lr-ratio", "1.5", "--min-lr-ratio must be in [0, 1]"),
    ("--min-lr-ratio", "-0.1", "--min-lr-ratio must be in [0, 1]"),
    ("--seq-len", "1", "--seq-len must be >= 2"),
])
def test_out_of_range_and_non_finite_flags(tiny, tmp_path, capsys, flag, value, fragment):
    code, err = run_cli(capsys, *train_args(tiny, tmp_path / "out", flag, value))
    assert_error(code, err, fragment)
    assert not (tmp_path / "out").exists()


def test_command_line_syntax_errors_are_one_line(tiny, tmp_path, capsys):
    code, err = run_cli(capsys, *train_args(tiny, tmp_path / "out", "--max-steps", "2.7"))
    assert code == 2 and "Traceback" not in err and "usage:" not in err
    assert err.strip().splitlines() == [err.strip()] and err.startswith("leantune: error: ")
    assert "--max-steps" in err and "2.7" in err


def test_seq_len_too_short_for_any_target_names_seq_len(tiny, tmp_path, capsys):
    # a ChatML prompt alone is longer than 4 tokens: every example is cut before its first assistant token
    code, err = run_cli(capsys, *train_args(tiny, tmp_path / "out", "--seq-len", "4"))
    assert_error(code, err, "--seq-len 4 is too short", str(tiny["data"]))
    assert not (tmp_path / "out").exists()


def test_unknown_target_module_is_named(tiny, tmp_path, capsys):
    code, err = run_cli(capsys, *train_args(tiny, tmp_path / "out", "--target-modules", "q_proj,bogus"))
    assert_error(code, err, "'bogus' not found in the model", "q_proj")  # q_proj listed among the layers
    assert "'q_proj' not found" not in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("case", ["no-files", "empty-vocab"])
def test_model_folder_without_tokenizer(tiny, tmp_path, capsys, case):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(tiny["model"].read_text())
    if case == "empty-vocab":  # loads, but as a 1-token vocabulary (would surface as "empty dataset")
        from tokenizers import Tokenizer, models
        from transformers import PreTrainedTokenizerFast

        PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE(vocab={"a": 0}, merges=[]))).save_pretrained(
            folder)
    code, err = run_cli(capsys, *train_args(tiny, tmp_path / "out", model=folder))
    assert_error(code, err, f"no tokenizer in {folder}: expected tokenizer.json or "
                            "tokenizer.model/tokenizer_config.json")
    assert not (tmp_path / "out").exists()


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
    from leantune.train import loop

    out = tmp_path / "out"
    real_evaluate = loop.evaluate

    def crash(*args, **kwargs):
        raise RuntimeError("simulated crash")

    monkeypatch.setattr(loop, "evaluate", crash)
    with pytest.raises(RuntimeError, match="simulated crash"):
        main([str(a) for a in train_args(tiny, out)])
    assert (out / "run.json").is_file() and not loop.holds_run(out)
    monkeypatch.setattr(loop, "evaluate", real_evaluate)
    code, err = run_cli(capsys, *train_args(tiny, out))
    assert code == 0, err
    assert loop.holds_run(out)
    code, err = run_cli(capsys, *train_args(tiny, out))  # a finished run still needs --overwrite
    assert_error(code, err, "already holds a run")


def test_diverged_run_writes_strict_json_and_warns(tiny, tmp_path, capsys):
    out = tmp_path / "out"
    code, err = run_cli(capsys, *train_args(tiny, out, "--max-steps", "2", "--lr", "1e308"))
    assert code == 0, err
    assert "leantune: warning: the training loss became non-finite" in err
    records = [strict_json(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in records if r["type"] == "train"][-1] is None
    summary = strict_json((out / "summary.json").read_text())
    assert summary["final_eval_loss"] is None and summary["initial_eval_loss"] > 0
    strict_json((out / "run.json").read_text())


def test_export_target_checks(tiny, tmp_path, capsys):
    run = tmp_path / "run"
    code, err = run_cli(capsys, *train_args(tiny, run))
    assert code == 0, err
    afile = tmp_path / "a-file"
    afile.write_text("keep")
    code, err = run_cli(capsys, "export", "--adapter", run, "--out", afile)
    assert_error(code, err, str(afile), "not a directory")
    code, err = run_cli(capsys, "export", "--adapter", run, "--out", afile / "sub")
    assert_error(code, err, "not a directory")
    assert afile.read_text() == "keep"
    user = tmp_path / "user"
    user.mkdir()
    (user / "thesis.tex").write_text("precious")
    code, err = run_cli(capsys, "export", "--adapter", run, "--out", user)
    assert_error(code, err, "not empty", "--overwrite")
    code, err = run_cli(capsys, "export", "--adapter", run, "--out", user, "--overwrite")
    assert_error(code, err, str(user), "not a leantune export")
    assert files_of(user) == {user / "thesis.tex": b"precious"}
    merged = tmp_path / "merged"
    code, err = run_cli(capsys, "export", "--adapter", run, "--out", merged)
    assert code == 0, err
    assert (merged / "leantune_export.json").is_file() and (merged / "config.json").is_file()
    weights = (merged / "model.safetensors").read_bytes()
    code, err = run_cli(capsys, "export", "--adapter", run, "--out", merged)
    assert_error(code, err, "not empty")
    code, err = run_cli(capsys, "export", "--adapter", run, "--out", merged, "--overwrite")  # a previous export
    assert code == 0, err
    assert (merged / "model.safetensors").read_bytes() == weights
    assert not list(tmp_path.glob(".*tmp*"))


def test_top_level_help_has_no_rst_markup(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "train (LoRA fine-tuning)" in out and "``" not in out


# ---------------------------------------------------------------------------------------------------------------
# From a new-user pass on the output folder: nothing of the user's lost, resume only of the same run


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


def test_resume_refuses_other_settings_and_a_step_count_below_the_checkpoint(tiny, tmp_path, capsys):
    out = tmp_path / "out"
    code, err = run_cli(capsys, *train_args(tiny, out, "--save-every", "1", "--max-steps", "2"))
    assert code == 0, err
    before = files_of(out)
    for flag, value in (("--lora-r", "8"), ("--lora-alpha", "1.0"), ("--seq-len", "32"), ("--seed", "3"),
                        ("--target-modules", "q_proj,v_proj")):
        code, err = run_cli(capsys, *train_args(tiny, out, "--resume", "--max-steps", "3", flag, value))
        assert_error(code, err, f"--resume: {flag} {value} differs from the run being resumed", "run.json")
    other = write_chat_jsonl(tmp_path / "other.jsonl", seed=1)
    code, err = run_cli(capsys, *train_args(tiny, out, "--resume", "--max-steps", "3", data=other))
    assert_error(code, err, "--resume: --data", "differs")
    code, err = run_cli(capsys, *train_args(tiny, out, "--resume", "--max-steps", "1"))
    assert_error(code, err, "step-000002 is at step 2, past this run's 1 steps")
    assert files_of(out) == before  # nothing rewritten by a refused resume
    (out / "checkpoints" / ".tmp-step-000003").mkdir()  # a save cut short by a kill
    code, err = run_cli(capsys, *train_args(tiny, out, "--resume", "--max-steps", "3", "--save-every", "1"))
    assert code == 0, err
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000003"]
    assert not (out / ".leantune.lock").exists()


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


def test_options_are_not_abbreviated(tiny, tmp_path, capsys):
    code, err = run_cli(capsys, "train", "--out", tmp_path / "x", "--max-steps", "1")
    assert code == 2 and "unrecognized arguments: --out" in err, err


def test_a_replaced_run_is_kept_until_the_new_one_finishes(tiny, tmp_path, capsys, monkeypatch):
    """From new-user passes: --overwrite deleted the finished run before the new one had produced anything, so a
    crash (or OOM) of the new run lost both. Later, a crash before the first checkpoint left the old run hidden in
    .replaced-* and the next plain run into the folder deleted it. Now the old run is kept aside while the new one
    has nothing to resume, put back if the new one fails or is stopped then, and deleted when the new one finishes."""
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
    from leantune.train import loop

    out = tmp_path / "out"
    code, err = run_cli(capsys, *train_args(tiny, out))
    assert code == 0, err
    kept = out / ".replaced-20260101-000000-x"
    kept.mkdir()
    for name in loop.RUN_FILES:
        if (out / name).exists():
            (out / name).rename(kept / name)
    assert loop.read_run_info(kept) is not None
    (out / "run.json").write_text((kept / "run.json").read_text())  # the killed run's run.json, no checkpoint
    assert not loop.holds_run(out)
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
                        "--max-steps", "2")
    assert code == 0, err
    assert main(["export", "--adapter", str(out), "--out", str(tmp_path / "merged")]) == 0


def test_second_pass_findings_on_the_output_folder(tiny, tmp_path, capsys, monkeypatch):
    """From a second new-user pass: a user's own .replaced-* folder was ignored and then deleted; --resume --lr was
    accepted but the checkpoint's optimizer kept the old lr; a dangling symlink gave a traceback; a run that
    finished in the folder while another loaded was replaced without --overwrite."""
    import shutil

    from leantune.train import loop

    out = tmp_path / "out"
    (out / ".replaced-mine").mkdir(parents=True)
    (out / ".replaced-mine" / "k.txt").write_text("precious")
    code, err = run_cli(capsys, *train_args(tiny, out))
    assert_error(code, err, "not empty and holds no leantune run")
    code, err = run_cli(capsys, *train_args(tiny, out, "--overwrite", "--save-every", "1"))
    assert code == 0, err
    assert (out / ".replaced-mine" / "k.txt").read_text() == "precious"
    code, err = run_cli(capsys, *train_args(tiny, out, "--resume", "--max-steps", "2", "--lr", "1e-2"))
    assert_error(code, err, "--resume: --lr 0.01 differs from the run being resumed")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    code, err = run_cli(capsys, *train_args(tiny, tmp_path / "dangling"))
    assert_error(code, err, "is a symlink to a missing target")

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


@pytest.mark.parametrize("signum, status", [("SIGINT", 130), ("SIGTERM", 143)])
def test_interrupted_train_exits_with_128_plus_the_signal(tiny, tmp_path, monkeypatch, signum, status):
    """Ctrl-C and SIGTERM both checkpoint and stop; the exit status says which, as a shell reports a signal (SIGTERM
    used to exit with 130 too)."""
    import os
    import signal

    import leantune.train as train_package

    real_train = train_package.train

    def train_then_signal(config):
        return real_train(config, progress=False,
                          on_step=lambda step: os.kill(os.getpid(), getattr(signal, signum)) if step == 1 else None)

    monkeypatch.setattr(train_package, "train", train_then_signal)
    out = tmp_path / "run"
    assert main([str(a) for a in train_args(tiny, out, "--max-steps", "2")]) == status
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-000001"]


def test_second_signal_aborts_with_128_plus_that_signal(tiny, tmp_path, monkeypatch, capsys):
    """A second SIGTERM aborts at once; the status names the signal as for the first (review: it exited 130)."""
    import os
    import signal

    import leantune.train as train_package

    real_train = train_package.train

    def twice(step):
        if step == 1:
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(train_package, "train", lambda config: real_train(config, progress=False, on_step=twice))
    code, err = run_cli(capsys, *train_args(tiny, tmp_path / "run", "--max-steps", "2"))
    assert code == 143 and "leantune: aborted" in err


@pytest.mark.parametrize("targets, unchanged", [("q_proj,v_proj,lm_head", "input"), ("embed_tokens,q_proj", "output")])
def test_export_of_a_tied_embedding_adapter_unties_and_matches_the_adapter(tiny, tmp_path, capsys, targets,
                                                                             unchanged):
    """From new-user passes: LoRA on lm_head (or embed_tokens) of a model with tied embeddings was merged into the
    shared matrix, so the export's other embedding changed too (max logit difference 17.9, and 58.8 for
    embed_tokens, against the adapter model)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from leantune.train import loop

    run = tmp_path / "run"
    code, err = run_cli(capsys, *train_args(tiny, run, "--target-modules", targets, "--lr", "5e-2"), "--max-steps", "3")
    assert code == 0, err
    code, err = run_cli(capsys, "export", "--adapter", run, "--out", tmp_path / "merged")
    assert code == 0, err
    seed = json.loads((run / "run.json").read_text())["config"]["seed"]
    base = loop.load_model("config", tiny["model"], torch.float32, "cpu", seed)
    embeddings = getattr(base, f"get_{unchanged}_embeddings")().weight.detach().clone()
    adapted = PeftModel.from_pretrained(base, run / "adapter").eval()
    adapted_name = "lm_head" if unchanged == "input" else "embed_tokens"
    factors = [p for n, p in adapted.named_parameters() if adapted_name in n and "lora_" in n]
    assert len(factors) == 2 and all(p.abs().max() > 0 for p in factors)  # trained: PEFT starts one factor at 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert torch.equal(getattr(merged, f"get_{unchanged}_embeddings")().weight, embeddings)
    ids = torch.randint(0, embeddings.shape[0], (2, 17))
    with torch.no_grad():
        diff = (adapted(input_ids=ids).logits - merged(input_ids=ids).logits).abs().max().item()
    assert diff < 1e-4, diff


def test_export_never_replaces_a_model_folder_or_the_base_and_takes_dot(tiny, tmp_path, capsys, monkeypatch):
    """From a new-user pass: a folder of save_pretrained files counted as a previous export, so --overwrite replaced
    a user's model (the run's own base among them); --out . crashed with a traceback; --out "" meant the cwd."""
    from transformers import AutoModelForCausalLM

    from leantune.train import loop

    run = tmp_path / "run"
    code, err = run_cli(capsys, *train_args(tiny, run))
    assert code == 0, err
    users_model = tmp_path / "users-model"
    AutoModelForCausalLM.from_config(loop.load_model("config", tiny["model"], torch.float32, "cpu", 0).config) \
        .save_pretrained(users_model)
    before = files_of(users_model)
    code, err = run_cli(capsys, "export", "--adapter", run, "--out", users_model, "--overwrite")
    assert_error(code, err, str(users_model), "not a leantune export")
    assert files_of(users_model) == before
    base_folder = tiny["model"].parent
    before = files_of(base_folder)
    code, err = run_cli(capsys, "export", "--adapter", run, "--out", base_folder, "--overwrite")
    assert_error(code, err, "base model")
    assert files_of(base_folder) == before
    code, err = run_cli(capsys, "export", "--adapter", run, "--out", "")
    assert_error(code, err, "--out", "empty")
    here = tmp_path / "empty-cwd"
    here.mkdir()
    monkeypatch.chdir(here)
    code, err = run_cli(capsys, "export", "--adapter", run, "--out", ".")
    assert code == 0, err
    assert (here / "leantune_export.json").is_file() and not list(tmp_path.glob(".*tmp*"))


def test_corrupt_or_mismatched_weights_are_one_error_line(tiny, tmp_path, capsys):
    """From a new-user pass: a truncated model.safetensors and weights of another shape than config.json ended in
    tracebacks (SafetensorError, RuntimeError)."""

    good = _weights_folder(tiny, tmp_path / "good")
    corrupt = tmp_path / "corrupt"
    shutil.copytree(good, corrupt)
    (corrupt / "model.safetensors").write_bytes((good / "model.safetensors").read_bytes()[:1000])
    code, err = run_cli(capsys, *train_args(tiny, tmp_path / "o1", model=corrupt))
    assert_error(code, err, "cannot load model", str(corrupt))
    mismatched = tmp_path / "mismatched"
    shutil.copytree(good, mismatched)
    config = json.loads((mismatched / "config.json").read_text())
    config["intermediate_size"] = 96
    (mismatched / "config.json").write_text(json.dumps(config))
    code, err = run_cli(capsys, *train_args(tiny, tmp_path / "o2", model=mismatched))
    assert_error(code, err, "cannot load model", str(mismatched))
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()


def test_demo_resume_overrides_the_demos_overwrite_default(tmp_path):
    """From a new-user pass: an interrupted demo said "continue with --resume", which the demo's own overwrite
    default then refused ("--resume and --overwrite exclude each other")."""
    from leantune.cli import _config_from_args, build_parser
    from leantune.train.config import LeantuneError

    def config(*argv):
        args = build_parser().parse_args(["demo", *argv])
        return _config_from_args(args, args.defaults)

    assert config().overwrite and not config().resume
    resumed = config("--resume")
    assert resumed.resume and not resumed.overwrite
    toml = tmp_path / "c.toml"
    toml.write_text("resume = true\n")
    assert not config("--config", str(toml)).overwrite
    with pytest.raises(LeantuneError, match="exclude each other"):
        config("--resume", "--overwrite")


def test_export_keeps_a_16_bit_base_in_its_dtype_and_odd_data_or_toml_is_refused(tiny, tmp_path, capsys):
    """From a new-user pass: a bf16 base was exported in fp32 (twice the disk), a .csv failed as "malformed JSON",
    and a TOML file with both seq_len and seq-len silently took the last."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM


    base16 = _weights_folder(tiny, tmp_path / "base16", torch.bfloat16)
    run = tmp_path / "run"
    code, err = run_cli(capsys, *train_args(tiny, run, "--lr", "1e-2", model=base16))
    assert code == 0, err
    code, err = run_cli(capsys, "export", "--adapter", run, "--out", tmp_path / "merged")
    assert code == 0, err
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert {p.dtype for p in merged.parameters()} == {torch.bfloat16}
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base16, dtype=torch.float32),
                                        run / "adapter").merge_and_unload()
    for name, param in adapted.named_parameters():  # the fp32 merge, rounded once to bf16
        assert torch.equal(merged.get_parameter(name), param.to(torch.bfloat16)), name

    csv = tmp_path / "chats.csv"
    csv.write_text("a,b\n")
    code, err = run_cli(capsys, *train_args(tiny, tmp_path / "o1", data=csv))
    assert_error(code, err, str(csv), "unsupported extension '.csv'", ".jsonl")
    toml = tmp_path / "c.toml"
    toml.write_text("seq_len = 64\nseq-len = 128\n")
    code, err = run_cli(capsys, *train_args(tiny, tmp_path / "o2"), "--config", toml)
    assert_error(code, err, "'seq-len'", "repeats", "seq-len")
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()


def test_seq_len_beyond_the_models_context_warns(tiny, tmp_path, capsys):
    code, err = run_cli(capsys, *train_args(tiny, tmp_path / "out", "--seq-len", "300"))
    assert code == 0, err
    assert "--seq-len 300 is longer than the model's context (max_position_embeddings = 256)" in err


def _weights_folder(tiny, folder, weights_dtype=torch.float32, **config_changes):
    """The tiny model saved with weights (and its tokenizer); ``config_changes`` edit config.json afterwards."""
    from leantune.train import loop

    loop.load_model("config", tiny["model"], weights_dtype, "cpu", 0).save_pretrained(folder)
    for path in tiny["model"].parent.iterdir():  # the tokenizer's files
        if path.is_file() and path.name != "config.json":
            (folder / path.name).write_bytes(path.read_bytes())
    if config_changes:
        config = json.loads((folder / "config.json").read_text())
        config.update(config_changes)
        (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_weights_missing_from_or_extra_to_config_json(tiny, tmp_path, capsys):
    """From a second new-user pass: a config.json asking for a third layer (or an untied lm_head) trained on a
    randomly initialised layer with only transformers' table printed; a size mismatch printed that table too."""
    for name, changes, fragment in (("three", {"num_hidden_layers": 3}, "model.layers.2."),
                                    ("untied", {"tie_word_embeddings": False}, "lm_head.weight")):
        folder = _weights_folder(tiny, tmp_path / name, **changes)
        code, err = run_cli(capsys, *train_args(tiny, tmp_path / f"o-{name}", model=folder))
        assert_error(code, err, "cannot load model", "lacks", fragment, "at random")
        assert "LOAD REPORT" not in err and not (tmp_path / f"o-{name}").exists()
    folder = _weights_folder(tiny, tmp_path / "inter", intermediate_size=96)
    code, err = run_cli(capsys, *train_args(tiny, tmp_path / "o-inter", model=folder))
    assert_error(code, err, "do not match its config.json", "(64, 128) in the checkpoint, (64, 96) in the model")
    assert "LOAD REPORT" not in err
    folder = _weights_folder(tiny, tmp_path / "one", num_hidden_layers=1)
    code, err = run_cli(capsys, *train_args(tiny, tmp_path / "o-one", model=folder))
    assert code == 0 and "has no place for, ignored: model.layers.1." in err


def test_export_dtype_follows_the_stored_weights(tiny, tmp_path, capsys):
    """From a second new-user pass: the export dtype followed config.json's "dtype" rather than the stored weights
    (bf16 weights without a declared dtype were exported in fp32, fp32 weights declared bf16 were rounded)."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    undeclared = _weights_folder(tiny, tmp_path / "bf16-undeclared", torch.bfloat16)
    config = json.loads((undeclared / "config.json").read_text())
    config.pop("dtype", None), config.pop("torch_dtype", None)
    (undeclared / "config.json").write_text(json.dumps(config))
    declared = _weights_folder(tiny, tmp_path / "fp32-declared-bf16", dtype="bfloat16")
    for folder, expected in ((undeclared, torch.bfloat16), (declared, torch.float32)):
        run = tmp_path / f"run-{folder.name}"
        code, err = run_cli(capsys, *train_args(tiny, run, model=folder))
        assert code == 0, err
        code, err = run_cli(capsys, "export", "--adapter", run, "--out", tmp_path / f"merged-{folder.name}")
        assert code == 0, err
        out = AutoModelForCausalLM.from_pretrained(tmp_path / f"merged-{folder.name}", dtype="auto")
        assert {p.dtype for p in out.parameters()} == {expected}, folder.name
        with safe_open(str(tmp_path / f"merged-{folder.name}" / "model.safetensors"), framework="pt") as fh:
            assert {fh.get_tensor(k).dtype for k in fh.keys()} == {expected}, folder.name


def test_sigterm_before_the_first_checkpoint_puts_the_replaced_run_back(tiny, tmp_path, capsys, monkeypatch):
    """From a second new-user pass: SIGTERM outside the training loop (loading, the first eval) killed the process
    with the finished run hidden in .replaced-* and a stale lock; it now stops like Ctrl-C, exit 143."""
    import os
    import signal

    from leantune.train import loop

    out = tmp_path / "out"
    code, err = run_cli(capsys, *train_args(tiny, out))
    assert code == 0, err
    finished = files_of(out)
    real_evaluate = loop.evaluate

    def terminated(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return real_evaluate(*args, **kwargs)

    def outside(signum, frame):  # what the old code let happen: the signal reached the process's own handler
        raise RuntimeError("SIGTERM was not handled by leantune")

    monkeypatch.setattr(loop, "evaluate", terminated)
    previous = signal.signal(signal.SIGTERM, outside)
    try:
        code, err = run_cli(capsys, *train_args(tiny, out, "--overwrite", "--seed", "1"))
        assert signal.getsignal(signal.SIGTERM) is outside  # restored after the run
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert code == 143 and "aborted" in err and "is back in" in err, err
    assert files_of(out) == finished and not (out / loop.LOCK).exists()


def test_export_stopped_or_failing_keeps_the_previous_export_and_cwd(tiny, tmp_path, capsys, monkeypatch):
    """From a second new-user pass: SIGTERM during an export left a full-size .tmp folder (or hid the previous
    export in .old-PID); a full disk (SafetensorError) was a traceback; --out . replaced the shell's cwd."""
    import os
    import signal

    from safetensors import SafetensorError

    run = tmp_path / "run"
    code, err = run_cli(capsys, *train_args(tiny, run))
    assert code == 0, err
    merged = tmp_path / "merged"
    code, err = run_cli(capsys, "export", "--adapter", run, "--out", merged)
    assert code == 0, err
    previous = files_of(merged)
    real_replace = os.replace

    def terminated_between_renames(src, dst):
        real_replace(src, dst)
        if ".old-" in str(dst):
            os.kill(os.getpid(), signal.SIGTERM)

    def outside(signum, frame):
        raise RuntimeError("SIGTERM was not handled by leantune")

    monkeypatch.setattr(os, "replace", terminated_between_renames)
    previous_handler = signal.signal(signal.SIGTERM, outside)
    try:
        code, err = run_cli(capsys, "export", "--adapter", run, "--out", merged, "--overwrite")
    finally:
        signal.signal(signal.SIGTERM, previous_handler)
        monkeypatch.setattr(os, "replace", real_replace)
    assert code == 143, err
    assert files_of(merged) == previous and sorted(p.name for p in tmp_path.iterdir()) == ["merged", "run"]

    from transformers import PreTrainedModel

    def disk_full(self, *args, **kwargs):
        raise SafetensorError("No space left on device")

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", disk_full)
    code, err = run_cli(capsys, "export", "--adapter", run, "--out", merged, "--overwrite")
    assert_error(code, err, "cannot write the export", "No space left")
    monkeypatch.undo()
    assert files_of(merged) == previous and sorted(p.name for p in tmp_path.iterdir()) == ["merged", "run"]

    here = tmp_path / "cwd"
    here.mkdir()
    inode = here.stat().st_ino
    monkeypatch.chdir(here)
    code, err = run_cli(capsys, "export", "--adapter", run, "--out", ".")
    assert code == 0, err
    assert here.stat().st_ino == inode and (Path.cwd() / "leantune_export.json").is_file()


def test_a_stop_while_moving_the_replaced_run_aside_puts_all_of_it_back(tiny, tmp_path, capsys, monkeypatch):
    """From a review: a Ctrl-C between the moves of the replaced run's files left part of it in a .replaced-*
    folder without its run.json (so never put back or recognised), and the put-back deleted files never moved."""
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


def test_export_through_a_symlink_and_beside_stale_temporary_folders(tiny, tmp_path, capsys):
    """From a review: --out as a symlink to an export replaced the link and left the old export behind it; temporary
    names from the pid collided with a killed export's leftovers (its stray files were shipped)."""
    import os

    run = tmp_path / "run"
    code, err = run_cli(capsys, *train_args(tiny, run))
    assert code == 0, err
    real = tmp_path / "exports" / "v1"
    code, err = run_cli(capsys, "export", "--adapter", run, "--out", real)
    assert code == 0, err
    link = tmp_path / "current"
    link.symlink_to(real, target_is_directory=True)
    stale = tmp_path / f".current.tmp-{os.getpid()}"  # what a killed export of the old naming left
    stale.mkdir()
    (stale / "junk.bin").write_bytes(b"x")
    (real / "extra.txt").write_text("from the previous export")
    code, err = run_cli(capsys, "export", "--adapter", run, "--out", link, "--overwrite")
    assert code == 0, err
    assert link.is_symlink() and link.resolve() == real.resolve()
    assert not (real / "extra.txt").exists() and not (real / "junk.bin").exists()
    assert sorted(p.name for p in real.parent.iterdir()) == ["v1"]


def test_third_pass_on_export_and_replaced_runs(tiny, tmp_path, capsys, monkeypatch):
    """From a third break-it pass: --out missing/../folder replaced the folder without --overwrite (Path.absolute
    keeps ".."); a second signal during a cleanup cut it short (a signal mask covers one thread, and torch runs
    several); a signal between a move and its bookkeeping left files in an empty --out; a Ctrl-C during the final
    tidy-up left a full copy of the old export; export folders were created 0700; a read-only parent failed with a
    traceback after the merge; SIGTERM during the last checkpoint aborted instead of finishing the run."""
    import os
    import shutil as shutil_module
    import signal
    import stat
    import threading

    from leantune.train import checkpoint, loop

    run = tmp_path / "run"
    code, err = run_cli(capsys, *train_args(tiny, run))
    assert code == 0, err
    monkeypatch.chdir(tmp_path)
    user = tmp_path / "userdata"
    user.mkdir()
    (user / "notes.txt").write_text("precious")
    code, err = run_cli(capsys, "export", "--adapter", run, "--out", "nosuch/../userdata")
    assert_error(code, err, "not empty")
    assert files_of(user) == {user / "notes.txt": b"precious"} and not (tmp_path / "nosuch").exists()

    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, **k: False if "locked" in str(path) else
                        real_access(path, mode, **k))
    (tmp_path / "locked").mkdir()
    monkeypatch.setattr(loop, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    code, err = run_cli(capsys, "export", "--adapter", run, "--out", tmp_path / "locked" / "new")
    assert_error(code, err, "cannot write in", "locked")
    monkeypatch.undo()
    monkeypatch.chdir(tmp_path)

    stop = threading.Event()  # an idle thread, as torch keeps: signals may be delivered to it
    threading.Thread(target=stop.wait, daemon=True).start()
    empty = tmp_path / "empty"
    empty.mkdir()
    real_replace = os.replace

    def signalled_after_the_first_move(src, dst):
        real_replace(src, dst)
        if ".leantune-export-" in str(src):
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(os, "replace", signalled_after_the_first_move)
    code, err = run_cli(capsys, "export", "--adapter", run, "--out", empty)
    monkeypatch.setattr(os, "replace", real_replace)
    assert code == 130 and list(empty.iterdir()) == [], err
    merged = tmp_path / "merged"
    code, err = run_cli(capsys, "export", "--adapter", run, "--out", merged)
    assert code == 0, err
    assert stat.S_IMODE(merged.stat().st_mode) & 0o055 == stat.S_IMODE(0o777 & ~_umask()) & 0o055
    real_rmtree = shutil_module.rmtree

    def signalled_while_tidying(path, *args, **kwargs):
        if ".old-" in str(path):
            os.kill(os.getpid(), signal.SIGINT)  # noted, not acted on: the new export is already in place
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(shutil_module, "rmtree", signalled_while_tidying)
    code, err = run_cli(capsys, "export", "--adapter", run, "--out", merged, "--overwrite")
    monkeypatch.setattr(shutil_module, "rmtree", real_rmtree)
    assert code == 0, err
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []

    out = tmp_path / "out"
    code, err = run_cli(capsys, *train_args(tiny, out))
    assert code == 0, err
    finished = files_of(out)
    real_put_back = loop._put_back

    def second_signal_in_cleanup(*args):
        os.kill(os.getpid(), signal.SIGINT)
        return real_put_back(*args)

    def first_signal(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(loop, "evaluate", first_signal)
    monkeypatch.setattr(loop, "_put_back", second_signal_in_cleanup)
    code, err = run_cli(capsys, *train_args(tiny, out, "--overwrite", "--seed", "1"))
    monkeypatch.undo()
    monkeypatch.chdir(tmp_path)
    assert code == 130 and files_of(out) == finished and not list(out.glob(".replaced-*")), err

    real_save = checkpoint.save_checkpoint

    def terminated_in_the_last_save(output, step, *args):
        if step == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return real_save(output, step, *args)

    monkeypatch.setattr(checkpoint, "save_checkpoint", terminated_in_the_last_save)
    code, err = run_cli(capsys, *train_args(tiny, tmp_path / "last", "--save-every", "0"))
    assert code == 0 and (tmp_path / "last" / "summary.json").is_file(), err
    stop.set()


def _umask():
    import os

    mask = os.umask(0)
    os.umask(mask)
    return mask
