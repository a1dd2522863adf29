"""FP8 frozen weights in runs: ``leantune train --quantize fp8`` (run.json, resume, export into the FP8-dequantised
base), and checkpoints that ship block-scaled FP8 (e4m3 weights beside 128 x 128 ``weight_scale_inv`` blocks and a
``quantization_config`` in config.json) loaded into leantune's FP8Linear, within the requantisation bound of
docs/design.md ("FP8 checkpoints"). The checkpoint is written by the test itself; all on the CPU."""

from __future__ import annotations

import copy
import json
import os
import signal

import pytest
import test_train
import torch
from reference import assert_close
from safetensors.torch import load_file, save_file
from test_train import tiny_config, write_chat_jsonl, write_tiny_model

from leantune import ops, unpatch
from leantune.errors import LeantuneError
from leantune.train.loop import train
from leantune.train.model import load_model

F64 = torch.float64
U = 2.0 ** -4  # e4m3 unit roundoff
BLOCK = 128
tiny = test_train.tiny  # the fixture: the tiny model and chat data of tests/test_train.py


def dense_reference(model):
    """A copy of a trained PEFT model whose FP8 bases (FP8Linear, or NF4Linear with FP8 compute) are ``nn.Linear``
    layers of their fp32 dequantisation, run by PEFT's unmerged forward: the weights the adapter trained against,
    without the activation quantisation."""
    from leantune.quantize import FP8Linear, NF4Linear

    ref = unpatch(copy.deepcopy(model))
    for parent in list(ref.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, (FP8Linear, NF4Linear)):
                linear = torch.nn.Linear(child.in_features, child.out_features, bias=False)
                codes = child.weight_fp8 if isinstance(child, FP8Linear) else ops.dequantize_nf4_fp8(child.weight_nf4)
                weight = codes.qweight.float() * codes.scale[:, None]
                linear.weight = torch.nn.Parameter(weight.to(child.compute_dtype), requires_grad=False)
                setattr(parent, name, linear)
    return ref


def check_export(run_dir, out, trained, dtype=torch.float32):
    """Export ``run_dir`` to ``out``; its logits equal the trained adapter over the FP8-dequantised base (fp32 bar),
    and the trained FP8 forward (activations quantised too) within e4m3's error."""
    from transformers import AutoModelForCausalLM

    from leantune.cli import main

    assert main(["export", "--adapter", str(run_dir), "--out", str(out)]) == 0
    ids = torch.randint(0, 250, (2, 20))
    with torch.no_grad():
        fp8_logits = trained.eval()(input_ids=ids, use_cache=False).logits
        dense_model = dense_reference(trained).eval()
        dense = dense_model(input_ids=ids, use_cache=False).logits
        dense64 = dense_model.double()(input_ids=ids, use_cache=False).logits
        merged_model = AutoModelForCausalLM.from_pretrained(out)
        merged = merged_model(input_ids=ids, use_cache=False).logits
    assert not any(t.dtype.itemsize == 1 for t in merged_model.state_dict().values())
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    assert merged_model.dtype == dtype  # the compute dtype
    # both in the compute dtype, against float64: the merged export within the unmerged forward's own rounding
    # error + the bar (in bf16 the two round differently: W + BA rounded once, or W and the LoRA path apart)
    assert_close("export vs trained adapter on the FP8-dequantised base", merged.double(), dense64, dtype,
                 eager=dense.double())
    fp8_err = ((merged.float() - fp8_logits.float()).norm() / fp8_logits.float().norm()).item()
    assert fp8_err < 0.1  # the trained forward quantises activations to e4m3 too: ~u / sqrt(3) per factor
    return merged_model


def test_train_quantize_fp8_runs_resumes_and_exports_into_the_dequantised_base(tiny, tmp_path, capsys):
    from leantune.quantize import FP8Linear

    common = {"max_steps": 3, "eval_every": 0, "save_every": 2, "patch": "on", "quantize": "fp8"}
    result = train(tiny_config(tiny, tmp_path / "q", **common), progress=False)
    assert "14 linear layers in FP8" in capsys.readouterr().err
    assert len([m for m in result.model.modules() if isinstance(m, FP8Linear)]) == 2 * 7
    assert result.summary["final_eval_loss"] < result.summary["initial_eval_loss"]
    assert json.loads((tmp_path / "q" / "run.json").read_text())["config"]["quantize"] == "fp8"
    merged = check_export(tmp_path / "q", tmp_path / "merged", result.model)  # a random init on the CPU: fp32
    plain = load_model("config", tiny["model"], torch.float32, "cpu", seed=0)
    ids = torch.randint(0, 250, (1, 8))
    with torch.no_grad():
        assert (plain(input_ids=ids).logits - merged(input_ids=ids).logits).abs().max() > 1e-4

    def interrupt(step):
        if step == 2:
            os.kill(os.getpid(), signal.SIGINT)

    stopped = train(tiny_config(tiny, tmp_path / "split", **common), progress=False, on_step=interrupt)
    assert stopped.interrupted and stopped.summary["steps"] == 2
    with pytest.raises(LeantuneError, match="quantize"):  # the base weights must be the ones resumed
        train(tiny_config(tiny, tmp_path / "split", resume=True, **{**common, "quantize": "nf4"}), progress=False)
    train(tiny_config(tiny, tmp_path / "split", resume=True, **common), progress=False)
    a = load_file(tmp_path / "q" / "adapter" / "adapter_model.safetensors")
    b = load_file(tmp_path / "split" / "adapter" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(LeantuneError, match="--quantize must be nf4, fp8, nf4-fp8 or off"):
        tiny_config(tiny, tmp_path / "x", quantize="fp4")
    assert tiny_config(tiny, tmp_path / "x", quantize="off").quantize is None  # --help's default, spelt out


def test_train_quantize_nf4_fp8_trains_and_exports_into_its_e4m3_base(tiny, tmp_path, capsys):
    """NF4 storage, FP8 compute: the NF4 layers carry e4m3 scales, the run learns, and the export merges the adapter
    into the e4m3 values its GEMMs read (dequantised), not into the NF4 values."""
    from leantune.quantize import NF4Linear

    result = train(tiny_config(tiny, tmp_path / "q", max_steps=3, eval_every=0, patch="on", quantize="nf4-fp8"),
                   progress=False)
    assert "14 linear layers in NF4 with FP8 compute (experimental)" in capsys.readouterr().err
    layers = [m for m in result.model.modules() if isinstance(m, NF4Linear)]
    assert len(layers) == 2 * 7 and all(m.fp8_scale is not None for m in layers)
    assert result.summary["final_eval_loss"] < result.summary["initial_eval_loss"]
    assert json.loads((tmp_path / "q" / "run.json").read_text())["config"]["quantize"] == "nf4-fp8"
    check_export(tmp_path / "q", tmp_path / "merged", result.model)


def test_cli_train_quantize_fp8_says_so_and_records_it(tiny, tmp_path, capsys):
    """The command line: a one-step unpatched run (PEFT's forward over FP8Linear), its startup line and run.json;
    an unknown quant type is one error line."""
    from cli_support import assert_error, run_cli, train_args

    code, err = run_cli(capsys, *train_args(tiny, tmp_path / "run", "--quantize", "fp8"))
    assert code == 0, err
    assert "leantune: 14 linear layers in FP8 (e4m3, one scale per output channel; experimental)" in err
    assert json.loads((tmp_path / "run" / "run.json").read_text())["config"]["quantize"] == "fp8"
    assert_error(*run_cli(capsys, *train_args(tiny, tmp_path / "bad", "--quantize", "fp4")),
                 "--quantize must be nf4, fp8, nf4-fp8 or off")


# ------------------------------------------------------------------------------------------ FP8 checkpoints
def quantize_blocks64(w, block=BLOCK):
    """(e4m3 codes, fp32 scale_inv [ceil(out/b), ceil(in/b)]) of ``w`` per block x block tile, as the FP8 releases
    store them: scale_inv = absmax / 448 per tile, codes = e4m3(w / scale_inv) (partial tiles at the ends)."""
    rows, cols = w.shape
    grid = (-(-rows // block), -(-cols // block))
    scale = torch.zeros(grid)
    for i in range(grid[0]):
        for j in range(grid[1]):
            tile = w[i * block:(i + 1) * block, j * block:(j + 1) * block]
            scale[i, j] = tile.abs().max().clamp(min=1e-12) / 448.0
    full = scale.repeat_interleave(block, 0)[:rows].repeat_interleave(block, 1)[:, :cols]
    return (w / full).to(torch.float8_e4m3fn), scale


def blocks64(q, scale, block=BLOCK):
    """float64 block dequantisation, element by element from the tile index."""
    rows, cols = q.shape
    i = torch.arange(rows)[:, None] // block
    j = torch.arange(cols)[None, :] // block
    return q.to(F64) * scale.to(F64)[i, j]


def requant_bound(v64):
    """|requantised - v| <= u |v| + 2^-10 s_row (docs/design.md, "FP8 checkpoints")."""
    s_row = (v64.abs().amax(dim=1, keepdim=True) / 448.0)
    return U * v64.abs() + 2.0 ** -10 * s_row


def test_dequantize_blocks_with_partial_tiles_and_the_requantisation_bound():
    w = torch.randn(200, 300) * torch.logspace(-2, 1, 300)[None, :]  # tiles of different scales along a row
    q, scale = quantize_blocks64(w)
    assert scale.shape == (2, 3)
    deq = ops.dequantize_blocks(q, scale, (128, 128))
    assert deq.dtype == torch.float32 and torch.equal(deq, blocks64(q, scale).float())  # one fp32 rounding
    fp8w = ops.requantize_blocks(q, scale, [128, 128], dtype=torch.bfloat16, name="layer")
    assert isinstance(fp8w, ops.FP8Weight) and fp8w.dtype == torch.bfloat16 and fp8w.shape == (200, 300)
    v64 = blocks64(q, scale)
    err = (ops.dequantize_fp8(fp8w, torch.float32).to(F64) - v64).abs()
    assert (err <= requant_bound(v64)).all()
    assert err.max() > 0  # a second rounding does happen (the row's grid is not the tiles')
    per_tensor = ops.dequantize_blocks(q, torch.tensor(0.5), None)
    assert torch.equal(per_tensor, q.float() * 0.5)
    with pytest.raises(ValueError, match=r"layer: block size \(128, 128\) of a 200 x 300 weight needs a scale grid "
                                         r"of \(2, 3\)"):
        ops.dequantize_blocks(q, scale[:1], (128, 128), name="layer")
    with pytest.raises(ValueError, match="layer: a block-scaled FP8 weight must be a 2-D float8 tensor"):
        ops.dequantize_blocks(w, scale, (128, 128), name="layer")


def write_fp8_checkpoint(folder, hidden=256, heads=4):
    """A 2-layer Llama (hidden 256, MLP 384: whole 128-blocks) saved as a block-FP8 release: e4m3 projection
    weights + fp32 ``weight_scale_inv``, the rest bf16, config.json's quantization_config; with the tiny tokenizer.
    Returns {projection weight key: (codes, scale_inv)}."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    write_tiny_model(folder)
    config = LlamaConfig(vocab_size=259 + 3, hidden_size=hidden, intermediate_size=384, num_hidden_layers=2,
                         num_attention_heads=heads, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False)
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(config)
    tensors, blocks = {}, {}
    for key, value in model.state_dict().items():
        if key.endswith("_proj.weight"):
            q, scale = quantize_blocks64(value.detach())
            tensors[key], tensors[key.removesuffix("weight") + "weight_scale_inv"] = q, scale
            blocks[key] = (q, scale)
        else:
            tensors[key] = value.detach().to(torch.bfloat16)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config.quantization_config = {"quant_method": "fp8", "weight_block_size": [BLOCK, BLOCK],
                                  "activation_scheme": "dynamic", "fmt": "e4m3"}
    config.save_pretrained(folder)
    return blocks


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fp8") / "model"
    return folder, write_fp8_checkpoint(folder)


def test_fp8_checkpoint_loads_into_fp8linear_within_the_requantisation_bound(fp8_checkpoint):
    """leantune's loader: transformers (on a CPU host) dequantises the blocks into fp32, leantune.quantize
    requantises per output channel; on a CUDA host transformers keeps its own FP8Linear, which quantize converts
    from the blocks: the same codes (simulated here with transformers' module filled from the checkpoint)."""
    from transformers import AutoModelForCausalLM
    from transformers.integrations.finegrained_fp8 import FP8Linear as HFFP8Linear

    import leantune
    from leantune.quantize import FP8Linear

    folder, blocks = fp8_checkpoint
    model = load_model("hf", folder, torch.bfloat16, "cpu", 0)
    layers = {name + ".weight": m for name, m in model.named_modules() if isinstance(m, FP8Linear)}
    assert layers.keys() == blocks.keys()
    for key, layer in layers.items():
        v64 = blocks64(*blocks[key])
        assert layer.compute_dtype == torch.bfloat16
        err = (layer.weight.to(F64) * layer.weight_scale.to(F64)[:, None] - v64).abs()
        assert (err <= requant_bound(v64)).all(), key
    assert model.get_input_embeddings().weight.dtype == torch.bfloat16 and model.lm_head.weight.dtype == torch.bfloat16
    assert getattr(model.config, "quantization_config", None) is None and not model.is_quantized

    host = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)  # the CUDA host's module layout
    for key in blocks:
        name = key.removesuffix(".weight")
        old = host.get_submodule(name)
        hf = HFFP8Linear(old.in_features, old.out_features, block_size=(BLOCK, BLOCK))
        hf.weight.data, hf.weight_scale_inv.data = blocks[key][0].clone(), blocks[key][1].clone()
        host.set_submodule(name, hf)
    done = leantune.quantize(host, "fp8", dtype=torch.bfloat16)
    assert done["layers"] == len(blocks)
    for key, layer in layers.items():
        converted = host.get_submodule(key.removesuffix(".weight"))
        assert isinstance(converted, FP8Linear) and converted.compute_dtype == torch.bfloat16
        assert torch.equal(converted.weight.view(torch.uint8), layer.weight.view(torch.uint8)), key
        assert torch.equal(converted.weight_scale, layer.weight_scale), key


def test_fp8_checkpoint_with_partial_tiles_is_refused_on_a_cpu_host(tmp_path, monkeypatch):
    """hidden 192: 2 scale rows per 192-row weight, which transformers' CPU dequantisation would cut into 96-row
    tiles; the loader refuses it, naming a weight, instead of training on mis-scaled weights."""
    write_fp8_checkpoint(tmp_path / "model", hidden=192, heads=3)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(LeantuneError, match=r"without a CUDA device: model\.layers\.0\..*_proj\.weight is \d+ x "
                                            r"\d+, not a multiple of the 128 x 128 blocks"):
        load_model("hf", tmp_path / "model", torch.float32, "cpu", 0)


def test_fp8_checkpoint_loads_the_same_on_a_cuda_host(fp8_checkpoint, monkeypatch):
    """With a CUDA device transformers keeps its own FP8Linear modules (and its quantizer); here its environment
    check is bypassed so that the CPU builds them too: leantune's loader gives the same codes, scales and
    parameters as on a CPU host, and a model transformers no longer counts as quantised."""
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    folder, _ = fp8_checkpoint
    cpu_host = load_model("hf", folder, torch.bfloat16, "cpu", 0)
    monkeypatch.setattr(FineGrainedFP8HfQuantizer, "validate_environment", lambda self, *args, **kwargs: None)
    cuda_host = load_model("hf", folder, torch.bfloat16, "cpu", 0)
    assert not cuda_host.is_quantized and getattr(cuda_host, "hf_quantizer", None) is None
    assert not getattr(cuda_host.config, "_is_quantized", False)
    assert getattr(cuda_host.config, "quantization_config", None) is None
    bits = lambda t: t.view(torch.uint8) if t.dtype.itemsize == 1 else t  # noqa: E731
    for ours, theirs in ((cpu_host.named_buffers(), cuda_host.named_buffers()),
                         (cpu_host.named_parameters(), cuda_host.named_parameters())):
        ours, theirs = dict(ours), dict(theirs)
        assert ours.keys() == theirs.keys()
        for key in ours:
            assert ours[key].dtype == theirs[key].dtype and torch.equal(bits(ours[key]), bits(theirs[key])), key


def test_fp8_checkpoint_trains_with_lora_and_exports(fp8_checkpoint, tmp_path):
    folder, _ = fp8_checkpoint
    data = write_chat_jsonl(tmp_path / "chat.jsonl", n=40)
    fake = {"model": folder, "data": data}
    with pytest.raises(LeantuneError, match="ships FP8 weights .* train it with --quantize fp8"):
        train(tiny_config(fake, tmp_path / "x", max_steps=1), progress=False)
    result = train(tiny_config(fake, tmp_path / "run", max_steps=2, eval_every=0, eval_size=2, patch="on",
                               quantize="fp8", lr=1e-2, dtype="bf16"), progress=False)
    lora_b = [p for n, p in result.model.named_parameters() if "lora_B" in n]
    assert lora_b and all(p.abs().max() > 0 for p in lora_b)  # the adapters stepped (lora_B starts at zero)
    assert all(p.isfinite().all() for p in lora_b)
    check_export(tmp_path / "run", tmp_path / "merged", result.model, torch.bfloat16)  # the checkpoint's dtype


def test_train_quantize_nf4_on_a_moe_checkpoints_resumes_and_exports(tmp_path, capsys, monkeypatch):
    """A Qwen3-MoE config with --quantize nf4: the expert stacks are NF4 with frozen one-element placeholders that
    have no state-dict entry; the checkpoint's state-dict gathering (which pops every frozen parameter's key) must
    not trip on them: the run checkpoints, resumes after Ctrl-C and exports."""
    from cli_support import run_cli, stopped_run
    from test_train import write_tiny_moe_model

    folder = tmp_path / "moe"
    write_tiny_moe_model(folder)
    data = write_chat_jsonl(tmp_path / "chat.jsonl", n=40)
    out = tmp_path / "run"
    argv = ["train", "--model", folder / "config.json", "--data", data, "--output", out, "--seq-len", "48",
            "--batch-size", "2", "--max-steps", "3", "--eval-size", "2", "--save-every", "1", "--quantize", "nf4",
            "--device", "cpu"]
    stopped_run(capsys, monkeypatch, argv, step=2)
    assert (out / "checkpoints" / "step-000002").is_dir()
    code, err = run_cli(capsys, "train", "--output", out, "--resume")
    assert code == 0 and "resuming from" in err, err
    code, err = run_cli(capsys, "export", "--adapter", out, "--out", tmp_path / "merged")
    assert code == 0 and (tmp_path / "merged" / "config.json").is_file(), err
