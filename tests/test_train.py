"""leantune train: data masking and packing, the packed attention mask, GA invariance, resume, adapter reload.

Every test uses a tiny random Llama (2 layers, hidden 64) and a byte-level tokenizer with a ChatML template written
into a temp folder, so nothing is downloaded and the file runs in seconds.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal

import pytest
import torch
from reference import assert_close
from safetensors.torch import load_file

from leantune import is_patched
from leantune.errors import LeantuneError
from leantune.train import data as data_mod
from leantune.train.config import TrainConfig, make_config
from leantune.train.data import IGNORE_INDEX, Document, pack
from leantune.train.loop import accumulate_gradients, train
from leantune.train.model import load_model, load_tokenizer, wrap_lora


def close(out, ref, name):
    assert_close(name, out, ref, torch.float32)  # fp32: relative error <= 1e-5

WORDS = ["the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "to", "big", "red", "house", "with", "blue",
         "door"]


def write_tiny_moe_model(folder, model_type="qwen3_moe"):
    """:func:`write_tiny_model`'s tokenizer beside a 2-layer mixture-of-experts config.json (4 experts, top-2):
    Qwen3-MoE, or ``model_type`` "gpt_oss" / "qwen2_moe"."""
    from transformers import GptOssConfig, Qwen2MoeConfig, Qwen3MoeConfig

    write_tiny_model(folder)
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    shape = dict(vocab_size=vocab, hidden_size=32, intermediate_size=32, num_experts_per_tok=2, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128)
    if model_type == "gpt_oss":
        config = GptOssConfig(num_local_experts=4, **shape)
    elif model_type == "qwen2_moe":
        config = Qwen2MoeConfig(num_experts=4, moe_intermediate_size=16, shared_expert_intermediate_size=16, **shape)
    else:
        config = Qwen3MoeConfig(num_experts=4, moe_intermediate_size=16, **shape)
    config.save_pretrained(folder)
    return folder / "config.json"


def write_tiny_model(folder, *, model_type=None):
    """A byte-level BPE tokenizer (259 tokens, ChatML template) and a 2-layer Llama config.json in ``folder``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   chat_template=template)
    fast.save_pretrained(folder)
    config = LlamaConfig(vocab_size=len(fast), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=True)
    config.save_pretrained(folder)
    if model_type is not None:
        raw = json.loads((folder / "config.json").read_text())
        raw["model_type"] = model_type
        (folder / "config.json").write_text(json.dumps(raw))
    return folder / "config.json"


def write_chat_jsonl(path, n=120, seed=0):
    rng = random.Random(seed)
    with path.open("w") as fh:
        for _ in range(n):
            messages = []
            for _ in range(rng.randint(1, 2)):
                messages.append({"role": "user", "content": " ".join(rng.choices(WORDS, k=rng.randint(2, 5)))})
                messages.append({"role": "assistant",
                                 "content": " ".join(sorted(rng.choices(WORDS, k=rng.randint(2, 5))))})
            fh.write(json.dumps({"messages": messages}) + "\n")
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {"model": write_tiny_model(root / "model"), "data": write_chat_jsonl(root / "chat.jsonl")}


@pytest.fixture(scope="module")
def tokenizer(tiny):
    return load_tokenizer("config", tiny["model"])


def tiny_config(tiny, output, **overrides):
    values = {"model": str(tiny["model"]), "data": str(tiny["data"]), "output": str(output), "seq_len": 64,
              "batch_size": 2, "max_steps": 4, "eval_every": 2, "eval_size": 4, "save_every": 2, "lr": 3e-3,
              "patch": "off", "device": "cpu"}
    values.update(overrides)
    return make_config(flag_values=values)


# ---------------------------------------------------------------------------------------------------------------
# Data


def test_messages_mask_only_assistant_turns(tokenizer):
    messages = [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "red cat"},
                {"role": "user", "content": "and?"}, {"role": "assistant", "content": "blue dög"}]
    doc = data_mod.tokenize_messages(tokenizer, messages)
    assert len(doc.input_ids) == len(doc.target)
    assert doc.input_ids == tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
    targets = tokenizer.decode([t for t, keep in zip(doc.input_ids, doc.target) if keep])
    assert targets == "red cat<|im_end|>\nblue dög<|im_end|>\n"
    prompt = tokenizer.decode([t for t, keep in zip(doc.input_ids, doc.target) if not keep])
    assert "hi there" in prompt and "and?" in prompt and "red" not in prompt


def test_prompt_completion_and_text_masks(tokenizer):
    doc = data_mod.tokenize_record(tokenizer, {"prompt": "Q: 2+2?", "completion": " 4"})
    n_prompt = len(tokenizer("Q: 2+2?", add_special_tokens=False)["input_ids"])
    assert doc.target == [False] * n_prompt + [True] * (len(doc.input_ids) - n_prompt)
    assert tokenizer.decode(doc.input_ids[n_prompt:]) == " 4<|im_end|>"
    text = data_mod.tokenize_record(tokenizer, {"text": "abc"})
    assert all(text.target) and text.input_ids[-1] == tokenizer.eos_token_id


def test_pack_position_ids_labels_and_padding():
    docs = [Document([11, 12, 13], [False, True, True]), Document([21, 22, 23, 24], [True, False, True, True]),
            Document([31, 32, 33, 34, 35], [True] * 5)]
    packed = pack(docs, seq_len=8, pad_id=0)
    assert packed.input_ids.tolist() == [[11, 12, 13, 21, 22, 23, 24, 0], [31, 32, 33, 34, 35, 0, 0, 0]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 3, 0], [0, 1, 2, 3, 4, 0, 1, 2]]
    x = IGNORE_INDEX
    # first token of each document never a target; after HF's shift, each document's last position predicts -100
    assert packed.labels.tolist() == [[x, 12, 13, x, x, 23, 24, x], [x, 32, 33, 34, 35, x, x, x]]
    assert packed.num_targets() == 8


def test_chitchat_format_maps_senders_to_roles(tmp_path):
    raw = {"c1": {"messages": [[{"text": "Hello", "sender": "a"}, {"text": "how are you", "sender": "a"}],
                               [{"text": "fine", "sender": "b"}], [{"text": "good", "sender": "a"}]]}}
    path = tmp_path / "dataset.json"
    path.write_text(json.dumps(raw))
    assert data_mod.read_records(path) == [{"messages": [{"role": "user", "content": "Hello\nhow are you"},
                                                         {"role": "assistant", "content": "fine"},
                                                         {"role": "user", "content": "good"}]}]


def test_txt_is_cut_into_windows(tmp_path, tokenizer):
    path = tmp_path / "book.txt"
    path.write_text("x" * 150)
    docs, truncated = data_mod.build_documents(data_mod.read_records(path), tokenizer, seq_len=64)
    assert truncated == 0 and [len(d.input_ids) for d in docs] == [64, 64, 23]


def test_packed_rows_attend_only_within_documents(tiny, tokenizer):
    """transformers 5 builds a block-diagonal causal mask from restarting position ids (no attention_mask)."""
    torch.manual_seed(0)
    for attn in ("sdpa", "eager"):
        model = load_model("config", tiny["model"], torch.float32, "cpu", seed=0)
        model.config._attn_implementation = attn
        model.eval()
        a, b = torch.randint(0, 250, (1, 7)), torch.randint(0, 250, (1, 9))
        packed_ids = torch.cat([a, b], dim=1)
        position_ids = torch.cat([torch.arange(7), torch.arange(9)])[None]
        with torch.no_grad():
            packed = model(input_ids=packed_ids, position_ids=position_ids, use_cache=False).logits
            alone_a = model(input_ids=a, use_cache=False).logits
            alone_b = model(input_ids=b, use_cache=False).logits
            leaky = model(input_ids=packed_ids, use_cache=False).logits  # one sequence: b sees a
        close(packed[:, :7], alone_a, f"{attn} doc a")
        close(packed[:, 7:], alone_b, f"{attn} doc b")
        assert (leaky[:, 7:] - alone_b).abs().max() > 1e-3


# ---------------------------------------------------------------------------------------------------------------
# Training


@pytest.mark.parametrize("patch", ["off", "on"])
def test_grad_accumulation_matches_one_big_batch(tiny, tokenizer, patch):
    """K=4 micro-batches of 1 row == 1 batch of 4 rows (loss and every LoRA gradient, fp32 <= 1e-5)."""
    config = tiny_config(tiny, "unused", patch=patch)
    train_data, _, _ = data_mod.load_dataset(tiny["data"], tokenizer, 64, 4, seed=0)
    rows = train_data.select(slice(0, 4))
    model = wrap_lora(load_model("config", tiny["model"], torch.float32, "cpu", 0), config)
    assert is_patched(model) == (patch == "on")
    for p in model.parameters():  # PEFT starts lora_B at zero: make every gradient non-trivial
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.05)
    results = []
    for k in (1, 4):
        size = 4 // k
        loss = accumulate_gradients(model, [rows.select(slice(i * size, (i + 1) * size)) for i in range(k)], "cpu")
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        model.zero_grad(set_to_none=True)
        results.append((loss, grads))
    (loss1, grads1), (loss4, grads4) = results
    assert abs(loss1 - loss4) <= 1e-5 * abs(loss1)
    assert len(grads1) == 2 * 7 * 2  # A and B of 7 linears per layer, 2 layers
    for name in grads1:
        assert grads1[name].abs().max() > 0
        close(grads4[name], grads1[name], name)


def test_train_writes_run_and_adapter_reloads(tiny, tmp_path):
    from peft import PeftModel

    result = train(tiny_config(tiny, tmp_path / "run", max_steps=6, eval_every=3, patch="on"), progress=False)
    assert result.summary["patched"]
    out = tmp_path / "run"
    for name in ("adapter/adapter_config.json", "adapter/adapter_model.safetensors", "tokenizer/tokenizer.json",
                 "metrics.jsonl", "loss.png", "summary.json", "run.json"):
        assert (out / name).is_file(), name
    summary = json.loads((out / "summary.json").read_text())
    for key in ("steps", "initial_eval_loss", "final_eval_loss", "tokens_per_s", "peak_memory_gib"):
        assert summary[key] is not None, key
    assert summary["steps"] == 6 and summary["final_eval_loss"] < summary["initial_eval_loss"]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["type"] == "eval"] == [0, 3, 6]
    assert [r["step"] for r in records if r["type"] == "train"] == list(range(1, 7))
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    ids = torch.randint(0, 250, (2, 20))
    with torch.no_grad():
        trained = result.model.eval()(input_ids=ids, use_cache=False).logits
        base = load_model("config", tiny["model"], torch.float32, "cpu", seed=0)
        plain = base(input_ids=ids, use_cache=False).logits
        reloaded = PeftModel.from_pretrained(base, out / "adapter").eval()(input_ids=ids, use_cache=False).logits
    close(reloaded, trained, "reloaded adapter")
    assert (plain - trained).abs().max() > 1e-4  # the adapter changed the model

    from leantune.cli import main

    assert main(["export", "--adapter", str(out), "--out", str(tmp_path / "merged")]) == 0
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    with torch.no_grad():
        close(merged(input_ids=ids, use_cache=False).logits, trained, "merged export")
    assert (tmp_path / "merged" / "tokenizer.json").is_file()


def test_ctrl_c_then_resume_gives_the_same_weights(tiny, tmp_path):
    """Uninterrupted 6 steps == interrupted (SIGINT after step 3, checkpoint, exit) + --resume, bit for bit."""
    common = {"max_steps": 6, "eval_every": 2, "save_every": 2, "lora_dropout": 0.1}
    full = train(tiny_config(tiny, tmp_path / "full", **common), progress=False)
    assert not full.interrupted

    def interrupt(step):
        if step == 3:
            os.kill(os.getpid(), signal.SIGINT)

    stopped = train(tiny_config(tiny, tmp_path / "split", **common), progress=False, on_step=interrupt)
    assert stopped.interrupted and stopped.summary["steps"] == 3 and stopped.stop_signal == signal.SIGINT
    assert sorted(p.name for p in (tmp_path / "split" / "checkpoints").iterdir()) == ["step-000002", "step-000003"]
    assert not (tmp_path / "split" / "adapter").exists()
    resumed = train(tiny_config(tiny, tmp_path / "split", resume=True, **common), progress=False)
    assert not resumed.interrupted
    a = load_file(tmp_path / "full" / "adapter" / "adapter_model.safetensors")
    b = load_file(tmp_path / "split" / "adapter" / "adapter_model.safetensors")
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    lines = lambda run: [{k: v for k, v in json.loads(line).items() if k not in ("tokens_per_s", "step_seconds")}
                         for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
    assert lines("full") == lines("split")


def test_config_toml_then_flags(tmp_path):
    from leantune.train.config import load_toml

    path = tmp_path / "run.toml"
    path.write_text('seq-len = 128\nlr = 0.001\nlora_r = 8\n')
    config = make_config(load_toml(path), {"lr": 5e-4, "lora_r": None})
    assert (config.seq_len, config.lr, config.lora_r, config.batch_size) == (128, 5e-4, 8, TrainConfig().batch_size)


def test_make_config_checks_types_of_python_values_too():
    """The library entry point applies the same strict types as the CLI (flags) and the TOML file."""
    with pytest.raises(LeantuneError, match=r"--max-steps must be an integer, got 2\.7"):
        make_config(flag_values={"max_steps": 2.7})
    with pytest.raises(LeantuneError, match=r"config key 'overwrite' must be a boolean .*got 'no'"):
        make_config({"overwrite": "no"})
    with pytest.raises(LeantuneError, match="unknown option 'learning_rate'"):
        make_config({"learning_rate": 1.0})
    config = make_config({"target_modules": ["q_proj", " v_proj"], "patch": False, "epochs": 2})
    assert (config.target_modules, config.patch, config.epochs) == ("q_proj,v_proj", "off", 2.0)
    assert isinstance(config.epochs, float)


def test_metrics_are_strict_json_with_null_for_non_finite(tmp_path):
    from leantune.train.metrics import MetricsLog

    log = MetricsLog(tmp_path / "metrics.jsonl")
    log.log({"type": "train", "step": 1, "loss": float("nan"), "grad_norm": float("inf"), "lr": 1e-3})
    text = (tmp_path / "metrics.jsonl").read_text()
    assert "NaN" not in text and "Infinity" not in text
    assert log.read() == [{"type": "train", "step": 1, "loss": None, "grad_norm": None, "lr": 1e-3}]


def test_sigterm_stops_like_ctrl_c_with_a_checkpoint(tiny, tmp_path):
    """`docker stop` / a scheduler's preemption (SIGTERM) stops the run with a checkpoint, as Ctrl-C does."""
    def terminate(step):
        if step == 1:
            os.kill(os.getpid(), signal.SIGTERM)

    handler = signal.getsignal(signal.SIGTERM)
    stopped = train(tiny_config(tiny, tmp_path / "run", max_steps=3, save_every=0), progress=False,
                    on_step=terminate)
    assert stopped.interrupted and stopped.summary["steps"] == 1 and stopped.stop_signal == signal.SIGTERM
    assert [p.name for p in (tmp_path / "run" / "checkpoints").iterdir()] == ["step-000001"]
    assert signal.getsignal(signal.SIGTERM) is handler  # restored after the run


def test_a_run_on_the_users_data_needs_no_embedded_dataset(tiny, tmp_path, monkeypatch):
    """--data given: the chitchat package is never looked up (the card's first fsdp1 call, 2026-12-03, failed with
    "the embedded dataset is missing" on a run with its own --data). Without --data the same run names the package."""
    from leantune import assets

    def missing():
        raise FileNotFoundError("package 'chitchat_dataset' is not installed")

    monkeypatch.setattr(assets, "chitchat_path", missing)
    result = train(tiny_config(tiny, tmp_path / "run", max_steps=1, eval_every=0, save_every=0), progress=False)
    assert result.summary["steps"] == 1
    with pytest.raises(LeantuneError, match="the embedded dataset is missing: package 'chitchat_dataset'"):
        train(tiny_config(tiny, tmp_path / "default", data=None, max_steps=1, eval_every=0, save_every=0),
              progress=False)


def test_seq_len_default_on_cpu_is_said_recorded_and_resumed(tiny, tmp_path, capsys):
    """No --seq-len on the CPU: 256 (config.DEFAULT_SEQ_LEN), said in one line, in run.json, and what --resume
    continues with (its run.json is the resumed run's base)."""
    from leantune.train.config import DEFAULT_SEQ_LEN
    from leantune.train.run_folder import resume_base

    out = tmp_path / "run"
    stop = lambda step: step == 1 and os.kill(os.getpid(), signal.SIGTERM)
    stopped = train(tiny_config(tiny, out, seq_len=None, max_steps=2, eval_every=0, save_every=0), progress=False,
                    on_step=stop)
    assert stopped.interrupted and stopped.summary["steps"] == 1
    err = capsys.readouterr().err
    assert err.count("leantune: --seq-len 256 (the default on CPU; 1024 on CUDA)") == 1, err
    info = json.loads((out / "run.json").read_text())
    assert DEFAULT_SEQ_LEN["cpu"] == info["config"]["seq_len"] == 256 and info["seq_len_default"] is True
    config = make_config(flag_values={"output": str(out), "resume": True}, base=resume_base(out, TrainConfig()))
    assert config.seq_len == 256
    resumed = train(config, progress=False)
    assert not resumed.interrupted and resumed.summary["steps"] == 2
    assert "--seq-len 256 (the default" not in capsys.readouterr().err  # given by run.json: nothing to say
    info = json.loads((out / "run.json").read_text())
    assert info["config"]["seq_len"] == 256 and info["seq_len_default"] is True
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["tokens"] for r in records if r["type"] == "train"] == [2 * 256] * 2  # --batch-size 2 rows of 256


def test_cuda_graphs_loop_drives_captured_step_as_the_eager_loop(tiny, tmp_path, monkeypatch, capsys):
    """--cuda-graphs through the CPU recorder of tests/test_graphs.py (capture keeps the step, replay calls it):
    the losses, gradient norms, evals and adapter of the eager loop (grad accumulation 2, clipping, the cosine
    schedule), the flag in run.json, and Ctrl-C + --resume giving the uninterrupted graph run's weights."""
    from leantune.train import loop

    replays = []

    def recorder(fn, stream):
        return lambda: replays.append(1) or fn()

    common = {"max_steps": 6, "grad_accum": 2, "max_grad_norm": 0.05, "eval_every": 3, "save_every": 2,
              "patch": "on", "warmup_steps": 2}
    train(tiny_config(tiny, tmp_path / "eager", **common), progress=False)
    monkeypatch.setattr(loop, "STEP_CAPTURE", recorder)
    monkeypatch.setattr(loop, "GRAPH_WARMUP", 2)
    train(tiny_config(tiny, tmp_path / "graphs", cuda_graphs=True, **common), progress=False)
    assert len(replays) == 4 * (2 + 1)  # steps 3-6 replayed: 2 micro-batches and the update each
    assert json.loads((tmp_path / "graphs" / "run.json").read_text())["config"]["cuda_graphs"] is True
    records = lambda run: [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
    for a, b in zip(records("eager"), records("graphs"), strict=True):
        assert (a["type"], a["step"], a.get("lr")) == (b["type"], b["step"], b.get("lr"))
        for key in ("loss", "eval_loss", "grad_norm"):
            if key in a:
                assert abs(a[key] - b[key]) <= 1e-5 * abs(a[key]), (key, a, b)
    assert max(r["grad_norm"] for r in records("eager") if r["type"] == "train") > 0.05  # clipping was active
    a = load_file(tmp_path / "eager" / "adapter" / "adapter_model.safetensors")
    b = load_file(tmp_path / "graphs" / "adapter" / "adapter_model.safetensors")
    for key in a:
        close(b[key], a[key], key)

    stop = lambda step: step == 3 and os.kill(os.getpid(), signal.SIGINT)
    stopped = train(tiny_config(tiny, tmp_path / "split", cuda_graphs=True, **common), progress=False, on_step=stop)
    assert stopped.interrupted and stopped.summary["steps"] == 3
    resumed = train(tiny_config(tiny, tmp_path / "split", cuda_graphs=True, resume=True, **common), progress=False)
    assert not resumed.interrupted
    c = load_file(tmp_path / "split" / "adapter" / "adapter_model.safetensors")
    for key in b:
        assert torch.equal(b[key], c[key]), key
    strip = lambda run: [{k: v for k, v in r.items() if k not in ("tokens_per_s", "step_seconds")}
                         for r in records(run)]
    assert strip("graphs") == strip("split")

    monkeypatch.setattr(loop, "STEP_CAPTURE", None)  # no recorder: on the CPU the flag warns and runs eagerly
    capsys.readouterr()
    train(tiny_config(tiny, tmp_path / "cpu", cuda_graphs=True, max_steps=1, eval_every=0), progress=False)
    assert "--cuda-graphs needs CUDA (this run is on cpu): the steps run eagerly" in capsys.readouterr().err


@pytest.mark.parametrize("line, match", [
    ('{"messages": [{"role": "assistant", "content": "hi"}]}', "starts with an assistant turn"),
    ('{"messages": [{"role": "robot", "content": "beep"}, {"role": "assistant", "content": "hi"}]}',
     "unknown role(s) 'robot'"),
    ('{"text": "bad \\ud800 surrogate"}', "unpaired UTF-16 surrogate"),
    ('{"prompt": "a", "completion": "\\udfff"}', "unpaired UTF-16 surrogate"),
])
def test_bad_data_lines_are_refused_with_file_and_line(tmp_path, line, match):
    """Each of these is refused while reading (it would otherwise reach the tokenizer or the chat template and raise
    from there)."""
    from leantune.train.data import read_records

    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "fine"}\n' + line + "\n")
    with pytest.raises(LeantuneError, match=re.escape(f"{path}:2: ") + ".*" + re.escape(match)):
        read_records(path)


def test_chitchat_turns_must_be_lists_of_objects_and_a_bom_is_not_data(tmp_path, tokenizer):
    from leantune.train.data import build_documents, read_records

    bad = tmp_path / "chat.json"
    bad.write_text(json.dumps({"a": {"messages": [["hi", "there"]]}}))
    with pytest.raises(LeantuneError, match="conversation 'a': a turn must be a list of {sender, text} objects"):
        read_records(bad)
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + b'{"text": "the cat"}\n{"messages": []}\n')
    records = read_records(bom)
    assert records == [{"text": "the cat"}, {"messages": []}]
    documents, _ = build_documents(records, tokenizer, 64)
    assert len(documents) == 1  # the empty conversation has nothing to learn: dropped, not a template error


def test_a_chitchat_conversation_opened_by_an_empty_turn_starts_with_the_user(tmp_path, tokenizer):
    """The first speaker with words is the user: an empty opening turn used to make the other speaker the
    "assistant" of the first kept turn, and rendering the prompt before it crashed the chat template ("Cannot apply
    chat template to an empty conversation"; the embedded data holds such a conversation)."""
    from leantune.train.data import build_documents, read_records

    path = tmp_path / "chat.json"
    path.write_text(json.dumps({"c": {"messages": [
        [{"text": " ", "sender": "a"}], [{"text": "Hi!", "sender": "b"}, {"text": "Anyone?", "sender": "b"}],
        [{"text": "hello", "sender": "a"}], [{"text": "", "sender": "b"}], [{"text": "bye", "sender": "a"}]]}}))
    records = read_records(path)
    assert records == [{"messages": [{"role": "user", "content": "Hi!\nAnyone?"},
                                     {"role": "assistant", "content": "hello\nbye"}]}]
    documents, _ = build_documents(records, tokenizer, 256)
    targets = tokenizer.decode([t for t, keep in zip(documents[0].input_ids, documents[0].target) if keep])
    assert targets == "hello\nbye<|im_end|>\n"

    embedded = [r for r in read_records(data_mod.chitchat_path()) if r["messages"]]
    assert all(r["messages"][0]["role"] == "user" for r in embedded)
    documents, _ = build_documents(embedded[:: max(1, len(embedded) // 200)], tokenizer, 256)
    assert documents


def test_offloaded_checkpoints_and_tiled_mlp_train_as_plain_checkpointing(tiny, tmp_path, monkeypatch):
    """--offload-checkpoints (bit-identical) and --tile-mlp (tiles of 16 tokens: summation order only) give the
    weights of plain checkpointing; the options are refused where they cannot apply."""
    import functools
    import sys

    from leantune.patch.offload import enable_offloaded_checkpoints, offloader_of

    patch_module = sys.modules["leantune.patch"]  # the package (leantune.patch is the function)
    # these layer inputs are 32 KiB, under the 1 MiB default below which inputs stay put: offload them all
    monkeypatch.setattr(patch_module, "enable_offloaded_checkpoints",
                        functools.partial(enable_offloaded_checkpoints, min_bytes=0))
    common = {"max_steps": 3, "eval_every": 0, "patch": "on", "gradient_checkpointing": "on"}
    plain = train(tiny_config(tiny, tmp_path / "plain", **common), progress=False)
    lean = train(tiny_config(tiny, tmp_path / "lean", offload_checkpoints=True, tile_mlp=16, **common),
                 progress=False)
    assert offloader_of(lean.model).packed > 0
    ref = load_file(str(tmp_path / "plain" / "adapter" / "adapter_model.safetensors"))
    ours = load_file(str(tmp_path / "lean" / "adapter" / "adapter_model.safetensors"))
    assert ref.keys() == ours.keys() and ref
    for name in ref:
        close(ours[name], ref[name], name)
    assert lean.summary["final_eval_loss"] == pytest.approx(plain.summary["final_eval_loss"], rel=1e-5)
    with pytest.raises(LeantuneError, match="needs --gradient-checkpointing on"):
        tiny_config(tiny, tmp_path / "x", offload_checkpoints=True)
    with pytest.raises(LeantuneError, match="--tile-mlp must be >= 1"):
        tiny_config(tiny, tmp_path / "x", tile_mlp=0)
    with pytest.raises(LeantuneError, match="need --patch on"):
        tiny_config(tiny, tmp_path / "x", tile_mlp=8, patch="off")


def test_qlora_run_trains_on_nf4_and_exports_the_dequantised_base_plus_adapter(tiny, tmp_path):
    """--quantize nf4: the decoder's frozen linears train in NF4 (the fused ops dequantise them); export merges the
    adapter into the dequantised base, so the exported model computes what the trained one does."""
    from transformers import AutoModelForCausalLM

    from leantune.cli import main
    from leantune.quantize import NF4Linear

    result = train(tiny_config(tiny, tmp_path / "q", max_steps=3, eval_every=0, patch="on", quantize="nf4"),
                   progress=False)
    nf4 = [m for m in result.model.modules() if isinstance(m, NF4Linear)]
    assert len(nf4) == 2 * 7 and result.summary["final_eval_loss"] < result.summary["initial_eval_loss"]
    assert main(["export", "--adapter", str(tmp_path / "q"), "--out", str(tmp_path / "merged")]) == 0
    ids = torch.randint(0, 250, (2, 20))
    with torch.no_grad():
        trained = result.model.eval()(input_ids=ids, use_cache=False).logits
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")(input_ids=ids, use_cache=False).logits
        plain = load_model("config", tiny["model"], torch.float32, "cpu", seed=0)(input_ids=ids, use_cache=False)
    close(merged, trained, "merged QLoRA export")
    assert (plain.logits - trained).abs().max() > 1e-4
    with pytest.raises(LeantuneError, match="--quantize must be nf4"):
        tiny_config(tiny, tmp_path / "x", quantize="fp4")


@pytest.mark.parametrize("quant_type", ["nf4", "fp8"])
def test_dora_with_quantize_starts_at_the_quantized_base(tiny, quant_type):
    """``--dora --quantize``: the base is quantised before PEFT builds the adapters, so each DoRA magnitude is the
    row norm of the weight the layer computes with and the run starts at the quantised model's outputs (quantised
    after PEFT, the magnitudes kept the float rows' norms: a per-channel rescale of every projection)."""
    from leantune.quantize import quantize

    config = tiny_config(tiny, "unused", patch="off", dora=True, quantize=quant_type)
    model = wrap_lora(load_model("config", tiny["model"], torch.float32, "cpu", 0), config)
    reference = load_model("config", tiny["model"], torch.float32, "cpu", 0)
    quantize(reference, quant_type)
    q_proj = model.base_model.model.model.layers[0].self_attn.q_proj
    dense = q_proj.base_layer.dequantize(torch.float32)
    torch.testing.assert_close(q_proj.lora_magnitude_vector["default"].weight, dense.norm(dim=1), rtol=1e-6, atol=0)
    ids = torch.randint(0, reference.config.vocab_size, (2, 11))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, reference(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
