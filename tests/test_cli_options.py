"""The ``leantune`` command line itself: ``--help`` documents every option with its default, ``--version``, option
syntax and values (flags and TOML) checked before anything runs, the demo's own defaults."""

from __future__ import annotations

import json

import cli_support
import pytest
import torch
from cli_support import assert_error, files_of, run_cli, train_args

from leantune.cli import DEMO_DEFAULTS, main
from leantune.train.config import FIELDS

tiny = cli_support.tiny  # the fixture: a tiny model and chat data


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


def test_top_level_help_has_no_rst_markup(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "train (LoRA fine-tuning)" in out and "``" not in out


def test_bad_option_values_and_config_file(tiny, tmp_path, capsys):
    code, err = run_cli(capsys, *train_args(tiny, tmp_path / "out", "--lora-dropout", "1.5"))
    assert_error(code, err, "--lora-dropout")
    code, err = run_cli(capsys, *train_args(tiny, tmp_path / "out", "--config", tmp_path / "missing.toml"))
    assert_error(code, err, "config file not found")
    toml = tmp_path / "run.toml"
    toml.write_text("learning_rate = 1\n")
    code, err = run_cli(capsys, *train_args(tiny, tmp_path / "out", "--config", toml))
    assert_error(code, err, "unknown key 'learning_rate'", str(toml))


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


def test_options_are_not_abbreviated(tiny, tmp_path, capsys):
    code, err = run_cli(capsys, "train", "--out", tmp_path / "x", "--max-steps", "1")
    assert code == 2 and "unrecognized arguments: --out" in err, err


def test_demo_resume_overrides_the_demos_overwrite_default(tmp_path):
    """An asked --resume wins over the demo's overwrite default (an interrupted demo says "continue with --resume",
    which that default would refuse as "--resume and --overwrite exclude each other")."""
    from leantune.cli import _config_from_args, build_parser
    from leantune.errors import LeantuneError

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


def test_a_toml_file_that_sets_an_option_twice_is_refused(tiny, tmp_path, capsys):
    """seq_len and seq-len in one file are one option set twice, not "the last one wins"."""
    toml = tmp_path / "c.toml"
    toml.write_text("seq_len = 64\nseq-len = 128\n")
    code, err = run_cli(capsys, *train_args(tiny, tmp_path / "o2"), "--config", toml)
    assert_error(code, err, "'seq-len'", "repeats", "seq-len")
    assert not (tmp_path / "o2").exists()


def test_version_prints_the_package_version(capsys):
    import leantune

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"leantune {leantune.__version__}" == "leantune 0.1.0"


@pytest.mark.parametrize("argv", [["--help"], ["train", "--help"], ["--version"]])
def test_help_and_version_do_not_import_transformers_or_peft(argv):
    """--help and --version answer without loading transformers or peft (seconds of imports before any output)."""
    import subprocess
    import sys

    code = ("import sys\nfrom leantune.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
            "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('transformers', 'peft'))\n"
            "print('HEAVY', heavy, file=sys.stderr)\n")
    done = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120)
    assert "HEAVY []" in done.stderr, done.stderr[-2000:]
    assert "leantune" in done.stdout


def test_dora_and_rslora_flags_reach_peft_and_are_kept_for_resume(tiny, tmp_path, capsys):
    """--dora / --rslora: PEFT's use_dora / use_rslora in the saved adapter config; fixed for --resume (a run.json
    without them, from before they existed, resumes as plain LoRA); --dora with --quantize trains (PEFT's DoRA
    over the dequantised weight) and exports."""
    out = tmp_path / "out"
    code, err = run_cli(capsys, *train_args(tiny, out, "--dora", "--rslora"))
    assert code == 0, err
    adapter = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert adapter["use_dora"] is True and adapter["use_rslora"] is True
    code, err = run_cli(capsys, *train_args(tiny, out, "--resume"))  # the run's own settings: DoRA again
    assert code == 0 and "resuming from" in err, err
    assert json.loads((out / "run.json").read_text())["config"]["dora"] is True
    plain = tmp_path / "plain"  # a run.json of before the flags: resumes as plain LoRA
    code, err = run_cli(capsys, *train_args(tiny, plain, "--max-steps", "2", "--save-every", "1"))
    assert code == 0, err
    info = json.loads((plain / "run.json").read_text())
    del info["config"]["dora"], info["config"]["rslora"]
    (plain / "run.json").write_text(json.dumps(info))
    code, err = run_cli(capsys, *train_args(tiny, plain, "--resume", "--max-steps", "2"))
    assert code == 0 and "resuming from" in err, err
    code, err = run_cli(capsys, *train_args(tiny, tmp_path / "q", "--dora", "--quantize", "nf4", "--patch", "on"))
    assert code == 0, err
    code, err = run_cli(capsys, "export", "--adapter", tmp_path / "q", "--out", tmp_path / "q-merged")
    assert code == 0 and (tmp_path / "q-merged" / "config.json").is_file(), err


def test_dora_on_moe_experts_names_the_way_out(tmp_path, capsys):
    """PEFT's LoRA on MoE expert stacks (target_parameters) takes no DoRA: the error says which flags to drop or
    how to leave the experts out, and that way trains."""
    from test_train import write_chat_jsonl, write_tiny_moe_model

    model = write_tiny_moe_model(tmp_path / "moe")
    data = write_chat_jsonl(tmp_path / "chat.jsonl", n=30)
    args = ["train", "--model", model, "--data", data, "--seq-len", "48", "--batch-size", "2", "--max-steps", "1",
            "--eval-size", "2", "--device", "cpu", "--dora"]
    code, err = run_cli(capsys, *args, "--output", tmp_path / "a")
    assert_error(code, err, "cannot apply LoRA", "takes no DoRA and no lora_dropout", "--target-modules")
    code, err = run_cli(capsys, *args, "--output", tmp_path / "b", "--target-modules", "q_proj,k_proj,v_proj,o_proj")
    assert code == 0, err


@pytest.mark.parametrize("model_type", ["gpt_oss", "qwen2_moe"])
def test_all_linear_and_named_targets_reach_the_expert_stacks(tmp_path, capsys, model_type):
    """``--target-modules all-linear`` puts LoRA on a MoE model's expert stacks too (PEFT's own all-linear leaves
    gpt-oss's and Qwen2-MoE's out), ``gate_up_proj`` names them, the patched run trains them, and the export's merged
    model gives the adapter model's logits."""
    from peft import PeftModel
    from test_train import write_chat_jsonl, write_tiny_moe_model
    from transformers import AutoModelForCausalLM

    from leantune.train.model import load_model

    model = write_tiny_moe_model(tmp_path / "moe", model_type)
    data = write_chat_jsonl(tmp_path / "chat.jsonl", n=30)
    args = ["train", "--model", model, "--data", data, "--seq-len", "48", "--batch-size", "2", "--max-steps", "2",
            "--eval-size", "2", "--device", "cpu", "--lr", "5e-2"]
    run = tmp_path / "run"
    code, err = run_cli(capsys, *args, "--output", run)
    assert code == 0, err
    adapter = json.loads((run / "adapter" / "adapter_config.json").read_text())
    assert sorted(adapter["target_parameters"]) == ["experts.down_proj", "experts.gate_up_proj"], adapter
    code, err = run_cli(capsys, *args, "--output", tmp_path / "named", "--target-modules", "q_proj,gate_up_proj")
    assert code == 0, err
    adapter = json.loads((tmp_path / "named" / "adapter" / "adapter_config.json").read_text())
    assert adapter["target_parameters"] == ["experts.gate_up_proj"] and adapter["target_modules"] == ["q_proj"]
    code, err = run_cli(capsys, *args, "--output", tmp_path / "typo", "--target-modules", "q_proj,gate_up")
    assert_error(code, err, "'gate_up' not found", "expert stacks are down_proj, gate_up_proj")

    code, err = run_cli(capsys, "export", "--adapter", run, "--out", tmp_path / "merged")
    assert code == 0, err
    seed = json.loads((run / "run.json").read_text())["config"]["seed"]
    base = load_model("config", model, torch.float32, "cpu", seed)
    adapted = PeftModel.from_pretrained(base, run / "adapter").eval()
    factors = [p for n, p in adapted.named_parameters() if "experts" in n and "lora_" in n]
    assert len(factors) == 8 and all(p.abs().max() > 0 for p in factors)  # A, B of 2 layers x 2 stacks; B trained off 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    ids = torch.randint(0, base.config.vocab_size, (2, 17))
    with torch.no_grad():
        diff = (adapted(input_ids=ids).logits - merged(input_ids=ids).logits).abs().max().item()
    assert diff < 1e-4, diff


def test_the_context_warning_needs_a_document_past_the_context(tiny, tmp_path, capsys):
    """--seq-len past max_position_embeddings (256 here) warns only when a document reaches a position past it:
    positions restart at each packed document, so short documents never do."""
    short = ["--seq-len", "512", "--batch-size", "1", "--max-steps", "1", "--eval-size", "1"]
    code, err = run_cli(capsys, *train_args(tiny, tmp_path / "short"), *short)
    assert code == 0 and "longer than the model's context" not in err, err
    long = tmp_path / "long.jsonl"
    long.write_text("".join(json.dumps({"text": "word " * 400 + str(i)}) + "\n" for i in range(6)))
    code, err = run_cli(capsys, *train_args(tiny, tmp_path / "long", data=long), *short)
    assert code == 0, err
    assert "--seq-len 512 is longer than the model's context (max_position_embeddings = 256) and a document " \
           "reaches position 511" in err, err
