"""Data errors through ``leantune train``: each is one line naming the file (and line), before anything is written."""

from __future__ import annotations

import json

import cli_support
from cli_support import assert_error, run_cli, train_args

tiny = cli_support.tiny  # the fixture: a tiny model and chat data


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
    args = train_args(tiny, tmp_path / "out", data=long)
    at = args.index("--max-steps")
    del args[at:at + 2]  # an epoch: every example is tokenised
    code, err = run_cli(capsys, *args)
    assert code == 0, err
    assert "6 of 24 examples were longer than --seq-len 64 and were truncated" in err
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["truncated"] == 6


def test_seq_len_too_short_for_any_target_names_seq_len(tiny, tmp_path, capsys):
    # a ChatML prompt alone is longer than 4 tokens: every example is cut before its first assistant token
    code, err = run_cli(capsys, *train_args(tiny, tmp_path / "out", "--seq-len", "4"))
    assert_error(code, err, "--seq-len 4 is too short", str(tiny["data"]))
    assert not (tmp_path / "out").exists()


def test_a_data_file_of_another_extension_is_refused_by_name(tiny, tmp_path, capsys):
    """An .xml is refused for its extension, not reported as "malformed JSON" on its first line."""
    xml = tmp_path / "chats.xml"
    xml.write_text("<a/>\n")
    code, err = run_cli(capsys, *train_args(tiny, tmp_path / "o1", data=xml))
    assert_error(code, err, str(xml), "unsupported extension '.xml'", ".jsonl", ".parquet", ".csv")
    assert not (tmp_path / "o1").exists()


def test_data_whose_assistant_turns_are_all_empty_warns(tiny, tmp_path, capsys):
    """Only the end-of-turn markers would be learned: one warning line, and the run still trains."""
    empty = tmp_path / "empty-answers.jsonl"
    empty.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"question {i}"},
                                                      {"role": "assistant", "content": " "}]}) + "\n"
                             for i in range(40)))
    code, err = run_cli(capsys, *train_args(tiny, tmp_path / "out", data=empty))
    assert code == 0, err
    warnings = [line for line in err.splitlines() if "leantune: warning: every assistant turn" in line]
    assert len(warnings) == 1 and str(empty) in warnings[0] and "end-of-turn" in warnings[0], err
    code, err = run_cli(capsys, *train_args(tiny, tmp_path / "out2"))
    assert code == 0 and "every assistant turn" not in err, err


def test_a_csv_without_the_named_column_lists_the_columns_found(tiny, tmp_path, capsys):
    csv = tmp_path / "notes.csv"
    csv.write_text("title,body\nx,the cat sat\ny,a dog ran\n")
    code, err = run_cli(capsys, *train_args(tiny, tmp_path / "o1", "--text-column", "content", data=csv))
    assert_error(code, err, str(csv), "no column 'content' (--text-column)", "columns found: title, body")
    code, err = run_cli(capsys, *train_args(tiny, tmp_path / "o1", data=csv))
    assert_error(code, err, str(csv), "expected a column 'text', 'messages'", "columns found: title, body")
    assert not (tmp_path / "o1").exists()


def test_a_run_on_a_weighted_mix_with_eval_data_a_chat_template_and_bf16(tiny, tmp_path, capsys, monkeypatch):
    """ShareGPT Parquet and CSV text mixed by weight, a separate eval file, a Jinja template for a tokenizer without
    one (saved with the run), --dtype bf16 on the CPU: one short run, each part visible in the run's files."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    bare = tmp_path / "bare"
    bare.mkdir()
    for path in tiny["model"].parent.iterdir():
        if path.is_file() and path.name != "chat_template.jinja":
            (bare / path.name).write_bytes(path.read_bytes())
    config = json.loads((bare / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (bare / "tokenizer_config.json").write_text(json.dumps(config))
    template = tmp_path / "chatml.jinja"
    template.write_text("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    share = [{"conversations": [{"from": "human", "value": f"say {i}"}, {"from": "gpt", "value": f"{i} {i}"}]}
             for i in range(40)]
    datasets.Dataset.from_list(share).to_parquet(str(tmp_path / "share.parquet"))
    (tmp_path / "text.csv").write_text("text\n" + "".join(f"the cat sat on mat {i}\n" for i in range(40)))
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps({"text": f"held out {i}"}) + "\n" for i in range(6)))
    data = f"{tmp_path / 'share.parquet'}:0.6,{tmp_path / 'text.csv'}:0.4"
    args = train_args(tiny, tmp_path / "out", "--eval-data", tmp_path / "eval.jsonl", "--chat-template", template,
                      "--dtype", "bf16", data=data, model=bare / "config.json")
    code, err = run_cli(capsys, *args)
    assert code == 0, err
    assert "data mix: " in err and "share.parquet" in err and "text.csv" in err
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["dtype"] == "bfloat16" and summary["eval_rows"] == 2 and summary["train_rows"] == 2
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(tmp_path / "out" / "tokenizer").chat_template == template.read_text()
    run = json.loads((tmp_path / "out" / "run.json").read_text())
    assert run["config"]["eval_data"] == str(tmp_path / "eval.jsonl") and run["data"]["sources"]


def test_json_lines_in_a_json_file_read_as_jsonl(tmp_path):
    """datasets' to_json writes JSON Lines into .json files: read like .jsonl; real malformed JSON names its line;
    an object of splits says what a .json file may hold."""
    import pytest

    from leantune.errors import LeantuneError
    from leantune.train.records import read_records

    rows = [{"text": "one"}, {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}]
    lines = "".join(json.dumps(r) + "\n" for r in rows)
    (tmp_path / "a.json").write_text(lines)
    (tmp_path / "a.jsonl").write_text(lines)
    assert read_records(tmp_path / "a.json") == read_records(tmp_path / "a.jsonl") == rows
    (tmp_path / "bad.json").write_text('[\n{"text": "one"},\n{"text": }\n]\n')
    with pytest.raises(LeantuneError, match=r"malformed JSON at .*bad\.json: .*line 3"):
        read_records(tmp_path / "bad.json")
    (tmp_path / "splits.json").write_text(json.dumps({"train": rows}))
    with pytest.raises(LeantuneError, match=r"'train' holds a list without a 'messages' list.*JSON Lines"):
        read_records(tmp_path / "splits.json")


def test_warmup_as_long_as_the_run_is_refused(tiny, tmp_path, capsys):
    args = train_args(tiny, tmp_path / "out", "--warmup-steps", "3")
    args[args.index("--max-steps") + 1] = "3"
    code, err = run_cli(capsys, *args)
    assert_error(code, err, "--warmup-steps 3 is not below the run's 3 steps")
    assert not (tmp_path / "out" / "checkpoints").exists()


def test_target_modules_naming_a_block_is_refused_by_name(tiny, tmp_path, capsys):
    """self_attn exists but is a block of layers: one error line naming it and the linear layers, not PEFT's
    message cut at its first line."""
    code, err = run_cli(capsys, *train_args(tiny, tmp_path / "out", "--target-modules", "self_attn"))
    assert_error(code, err, "--target-modules: 'self_attn' names LlamaAttention blocks", "q_proj")
    code, err = run_cli(capsys, *train_args(tiny, tmp_path / "out", "--target-modules", "q_proj,nope"))
    assert_error(code, err, "'nope' not found in the model")
