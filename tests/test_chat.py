"""``leantune chat``: the streamed answer is greedy generation of the adapter model on the chat template, the same
for the run, its HF export and its GGUF export; the stdin loop keeps the conversation and /reset clears it."""

from __future__ import annotations

import io
import json
import sys

import cli_support
import pytest
import torch
from cli_support import assert_error, run_cli, train_args

from leantune.cli import main

tiny = cli_support.tiny  # the fixture: a tiny model and chat data
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def trained(tiny, tmp_path_factory):
    run = tmp_path_factory.mktemp("chat") / "run"
    assert main([str(a) for a in train_args(tiny, run, "--lr", "1e-2")]) == 0
    return run


def _reference(tiny, run, conversation):
    """Greedy decoding written token by token (the argmax of the last position's logits, without a cache, until
    an end token or NEW_TOKENS) of PEFT's merge of the adapter into the base rebuilt from config.json with the
    run's seed. End tokens: the tokenizer's eos and the config's (2 here, a byte of this tiny vocabulary)."""
    from peft import PeftModel
    from transformers import AutoTokenizer

    from leantune.train.model import load_model

    seed = json.loads((run / "run.json").read_text())["config"]["seed"]
    model = PeftModel.from_pretrained(load_model("config", tiny["model"], torch.float32, "cpu", seed),
                                      run / "adapter").merge_and_unload().eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny["model"].parent)
    ends = {tokenizer.eos_token_id, model.config.eos_token_id}
    ids = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, return_tensors="pt",
                                        return_dict=True)["input_ids"]
    new = []
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            token = model(input_ids=ids).logits[0, -1].argmax().item()
            if token in ends:
                break
            new.append(token)
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return tokenizer.decode(new, skip_special_tokens=True)


def _chat(capsys, *argv):
    code = main(["chat", *map(str, argv), "--max-new-tokens", str(NEW_TOKENS), "--device", "cpu"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return captured.out


def test_one_shot_answer_is_greedy_and_the_same_from_the_run_and_its_exports(tiny, trained, tmp_path, capsys):
    expected = _reference(tiny, trained, [{"role": "user", "content": "hello there"}])
    assert expected, "the reference answer is empty: nothing would be compared"
    assert _chat(capsys, "--adapter", trained, "--prompt", "hello there") == expected + "\n"
    assert main(["export", "--adapter", str(trained), "--out", str(tmp_path / "hf")]) == 0
    assert main(["export", "--adapter", str(trained), "--out", str(tmp_path / "m.gguf"), "--format", "gguf",
                 "--dtype", "f32"]) == 0
    capsys.readouterr()
    assert _chat(capsys, "--model", tmp_path / "hf", "--prompt", "hello there") == expected + "\n"
    assert _chat(capsys, "--model", tmp_path / "m.gguf", "--prompt", "hello there") == expected + "\n"


def test_interactive_loop_keeps_the_conversation_and_resets(tiny, trained, capsys, monkeypatch):
    first = _reference(tiny, trained, [{"role": "user", "content": "red"}])
    second = _reference(tiny, trained, [{"role": "user", "content": "red"}, {"role": "assistant", "content": first},
                                        {"role": "user", "content": "blue"}])
    fresh = _reference(tiny, trained, [{"role": "user", "content": "green"}])
    monkeypatch.setattr(sys, "stdin", io.StringIO("red\n\nblue\n/reset\ngreen\n/exit\nnever read\n"))
    assert _chat(capsys, "--adapter", trained) == f"{first}\n{second}\n{fresh}\n"


def test_chat_errors(trained, capsys):
    code, err = run_cli(capsys, "chat", "--prompt", "hi")
    assert_error(code, err, "exactly one of --adapter", "--model")
    code, err = run_cli(capsys, "chat", "--adapter", trained, "--model", trained, "--prompt", "hi")
    assert_error(code, err, "exactly one of")
    code, err = run_cli(capsys, "chat", "--adapter", trained, "--prompt", "hi", "--max-new-tokens", "0")
    assert_error(code, err, "--max-new-tokens", "0")
    code, err = run_cli(capsys, "chat", "--adapter", trained, "--prompt", "hi", "--temperature", "nan")
    assert_error(code, err, "--temperature")
