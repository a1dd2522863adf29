"""``--model`` through ``leantune train``: paths of no known kind, configs that are not causal LMs, weights that do
not fit config.json, missing tokenizers and LoRA targets are one error line each, before anything is written."""

from __future__ import annotations

import json
import shutil

import cli_support
import pytest
from cli_support import assert_error, run_cli, train_args, weights_folder
from test_train import write_tiny_model

tiny = cli_support.tiny  # the fixture: a tiny model and chat data


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


def test_corrupt_or_mismatched_weights_are_one_error_line(tiny, tmp_path, capsys):
    """A truncated model.safetensors and weights of another shape than config.json are one error line each (not a
    SafetensorError or RuntimeError traceback)."""

    good = weights_folder(tiny, tmp_path / "good")
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


def test_weights_missing_from_or_extra_to_config_json(tiny, tmp_path, capsys):
    """A config.json asking for weights the checkpoint lacks (a third layer, an untied lm_head) or of other sizes is
    an error line, not a random init under transformers' load table; weights it has no place for are a warning."""
    for name, changes, fragment in (("three", {"num_hidden_layers": 3}, "model.layers.2."),
                                    ("untied", {"tie_word_embeddings": False}, "lm_head.weight")):
        folder = weights_folder(tiny, tmp_path / name, **changes)
        code, err = run_cli(capsys, *train_args(tiny, tmp_path / f"o-{name}", model=folder))
        assert_error(code, err, "cannot load model", "lacks", fragment, "at random")
        assert "LOAD REPORT" not in err and not (tmp_path / f"o-{name}").exists()
    folder = weights_folder(tiny, tmp_path / "inter", intermediate_size=96)
    code, err = run_cli(capsys, *train_args(tiny, tmp_path / "o-inter", model=folder))
    assert_error(code, err, "do not match its config.json", "(64, 128) in the checkpoint, (64, 96) in the model")
    assert "LOAD REPORT" not in err
    folder = weights_folder(tiny, tmp_path / "one", num_hidden_layers=1)
    code, err = run_cli(capsys, *train_args(tiny, tmp_path / "o-one", model=folder))
    assert code == 0 and "has no place for, ignored: model.layers.1." in err


@pytest.mark.parametrize("architectures", [["BertForMaskedLM"], ["T5ForConditionalGeneration"]])
def test_a_model_that_is_not_a_causal_lm_is_named_so(tiny, tmp_path, capsys, architectures):
    """A BERT folder (or any config whose architectures are not causal LMs) is "not a causal LM", named by its type
    and architectures, before any weight is read (it was reported as missing weights)."""
    from transformers import BertConfig, T5Config

    folder = tmp_path / "encoder"
    config_class = BertConfig if architectures[0].startswith("Bert") else T5Config
    config = config_class(vocab_size=300, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                          intermediate_size=64, architectures=architectures)
    config.save_pretrained(folder)
    (folder / "model.safetensors").write_bytes(b"not read")  # reading it would fail with another message
    for path in tiny["model"].parent.iterdir():  # the tokenizer's files
        if path.is_file() and path.name != "config.json":
            (folder / path.name).write_bytes(path.read_bytes())
    code, err = run_cli(capsys, *train_args(tiny, tmp_path / "out", model=folder))
    assert_error(code, err, f"{folder} is not a causal LM", f"model type {config.model_type!r}", architectures[0])
    assert not (tmp_path / "out").exists()


def test_a_sequence_length_whose_packed_mask_is_large_attends_per_document(capsys):
    """Rows of packed documents would get transformers' dense [B, 1, S, S] mask: above 1 GiB the run attends per
    document instead, and says so; a model that cannot (not sdpa) keeps the mask with a warning saying why."""
    from types import SimpleNamespace

    from transformers import LlamaConfig, LlamaForCausalLM

    from leantune.patch.document_attention import NAME
    from leantune.train.loop import _attend_per_document

    tiny_config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                              num_attention_heads=2, num_key_value_heads=1)
    model = LlamaForCausalLM._from_config(tiny_config, attn_implementation="sdpa")
    # a 64 KiB mask: transformers' path
    _attend_per_document(model, SimpleNamespace(batch_size=1, cuda_graphs=False, seq_len=256))
    assert model.config._attn_implementation == "sdpa" and capsys.readouterr().err == ""
    _attend_per_document(model, SimpleNamespace(batch_size=1, cuda_graphs=False, seq_len=40000))
    assert model.config._attn_implementation == NAME
    assert "attention runs per document (one causal SDPA each) instead of through transformers' dense 1.5 GiB" in (
        capsys.readouterr().err)
    eager = LlamaForCausalLM._from_config(tiny_config, attn_implementation="eager")
    _attend_per_document(eager, SimpleNamespace(batch_size=1, cuda_graphs=False, seq_len=40000))
    assert eager.config._attn_implementation == "eager"
    assert "dense attention mask of 1.5 GiB per micro-batch (leantune's per-document attention does not apply: the " \
           "model attends with 'eager', not sdpa)" in capsys.readouterr().err

