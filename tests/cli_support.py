"""Shared pieces of the command-line tests: a tiny model and chat data, ``main()`` run with captured stderr, the
arguments of a one-step CPU run, and the check that an error is one ``leantune: error:`` line."""

from __future__ import annotations

import json
import os

import pytest
import torch
from test_train import write_chat_jsonl, write_tiny_model

from leantune.cli import main


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


def files_of(folder):
    return {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def strict_json(text):
    def refuse(constant):
        raise ValueError(f"non-JSON constant {constant}")

    return json.loads(text, parse_constant=refuse)


def weights_folder(tiny, folder, weights_dtype=torch.float32, **config_changes):
    """The tiny model saved with weights (and its tokenizer); ``config_changes`` edit config.json afterwards."""
    from leantune.train.model import load_model

    load_model("config", tiny["model"], weights_dtype, "cpu", 0).save_pretrained(folder)
    for path in tiny["model"].parent.iterdir():  # the tokenizer's files
        if path.is_file() and path.name != "config.json":
            (folder / path.name).write_bytes(path.read_bytes())
    if config_changes:
        config = json.loads((folder / "config.json").read_text())
        config.update(config_changes)
        (folder / "config.json").write_text(json.dumps(config))
    return folder


def umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


def signal_after_step(monkeypatch, step, signum=None):
    """Make ``leantune train`` (as the CLI calls it) receive ``signum`` (SIGINT by default) after optimizer step
    ``step``, as a user's Ctrl-C would arrive; undone by ``monkeypatch.undo()``."""
    import signal

    import leantune.train as train_package

    real_train = train_package.train
    signum = signal.SIGINT if signum is None else signum

    def train_then_signal(config):
        return real_train(config, progress=False,
                          on_step=lambda done: os.kill(os.getpid(), signum) if done == step else None)

    monkeypatch.setattr(train_package, "train", train_then_signal)


def stopped_run(capsys, monkeypatch, argv, step=2):
    """Run the CLI with ``argv`` and Ctrl-C after ``step``: a run with a checkpoint at ``step`` and no adapter."""
    signal_after_step(monkeypatch, step)
    code, err = run_cli(capsys, *argv)
    monkeypatch.undo()
    assert code == 130, err
