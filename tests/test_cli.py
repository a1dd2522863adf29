"""The ``leantune`` command line: every user error is one stderr line, a non-zero exit, no traceback, nothing
overwritten; ``--help`` documents every option with its default; the demo subcommand carries its own defaults."""

from __future__ import annotations

import json

import pytest
import torch
from test_train import write_chat_jsonl, write_tiny_model

from leantune.cli import DEMO_DEFAULTS, main
from leantune.train.config import FIELDS


@pytest.fixture(autouse=True)
def one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


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
        assert flag == "--config" or "(default: " in action.help, flag
        assert " ".join(action.help.replace("%%", "%").split()) in text, flag
    if command == "demo":
        assert f"output directory (default: {DEMO_DEFAULTS['output']})" in text
        assert f"(default: {DEMO_DEFAULTS['seq_len']})" in text


def test_export_help(capsys):
    with pytest.raises(SystemExit):
        main(["export", "--help"])
    out = capsys.readouterr().out
    assert "--adapter" in out and "--out" in out and "--overwrite" in out
