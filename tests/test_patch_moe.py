"""leantune.patch on the mixture-of-experts families: patched vs unpatched PEFT model with LoRA on attention and on
the 3-D expert stacks (``target_parameters``), loss with the router aux loss and every LoRA gradient.

Each family is a tiny random model from its transformers config class (2 layers, hidden 32, E=4 experts, top-2,
router aux loss on), norms perturbed, non-zero B everywhere. gpt-oss (sinks) on eager, its default: the patched
attention runs ops.sink_attention (without a padding mask the causal-LM forward hands it none; with one, HF's mask
of each layer type) and HF's eager function must not run; under another implementation a spy attention function
checks that the patched forward hands HF's function the sinks and the layer's window. The unpatched HF+PEFT model
(fp32) is the reference: loss rel <= 1e-5, LoRA gradients rel <= 1e-4 plus three times HF's own fp32 error against
a float64 copy (some draws make a layer's q/k gradients ill-conditioned: at seed 20261202, Mixtral 1 x 5 tokens,
HF's fp32 layer-1 k_proj gradient is 1.7e-4 off float64 and leantune's 5.3e-4, through the experts' rounding, so
a fixed 1e-4 against HF fails a correct draw). The experts must run ``ops.moe_experts`` and PEFT's
parametrization (which forms W + BA for the stack) must never run.

The parity runs on ``conftest.DEVICE`` (the interpreter on the CPU, the card on CUDA). On CUDA the fp32 reference
keeps full fp32 products: TF32 is off for cuBLAS within the check (HF's default experts path, "grouped_mm", takes
torch's fallback there for fp32, one cuBLAS GEMM per expert).
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from conftest import DEVICE
from peft import LoraConfig, get_peft_model
from reference import fp32_products, rel_err
from test_patch_families import assert_grads_close
from test_patch_structures import model_from_config

import leantune
from leantune import ops
from leantune.patch import FAMILIES

VOCAB = 96
MOE = {
    "qwen3_moe": {"num_experts": 4, "moe_intermediate_size": 24, "norm_topk_prob": True},
    "qwen2_moe": {"num_experts": 4, "moe_intermediate_size": 24, "shared_expert_intermediate_size": 40},
    "mixtral": {"num_local_experts": 4, "sliding_window": 5},
    "olmoe": {"num_experts": 4, "clip_qkv": 1.0},  # q/k/v clamped to [-1, 1] (OLMoE's clip_qkv; some values are)
    # sliding then full attention, the window (4) shorter than the sequences (9): both masks matter; sinks, biases
    # on q/k/v/o and on the experts, clamped SwiGLU, yarn RoPE (gpt-oss's default) with cos/sin per frequency
    "gpt_oss": {"num_local_experts": 4, "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"]},
}
TRITON = ["qwen3_moe", "mixtral", "gpt_oss"]


def tiny_moe_model(model_type: str):
    return model_from_config(
        model_type, num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        vocab_size=VOCAB, intermediate_size=24, max_position_embeddings=64, initializer_range=0.2,
        num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.1, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, **MOE[model_type],
    )


def tiny_moe_peft(model_type: str, nf4: str | None = None, device: str | None = None):
    """The tiny model with LoRA on attention and both expert stacks; ``nf4``: ``"before"`` / ``"after"``
    ``get_peft_model``, ``leantune.quantize(model, "nf4")`` (linears and expert stacks in NF4). ``device``: where
    the base model goes before quantisation and PEFT (None: where from_config built it, the CPU)."""
    family = FAMILIES[model_type]
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=list(family.attention_projections), lora_dropout=0.0,
                      target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
                      init_lora_weights=False)
    model = tiny_moe_model(model_type)
    if device is not None:
        model = model.to(device)
    if nf4 == "before":
        assert leantune.quantize(model, "nf4")["experts"] == 2
    model = get_peft_model(model, lora)
    if nf4 == "after":
        assert leantune.quantize(model, "nf4")["experts"] == 2
    return model


def loss_and_grads(model, input_ids, labels):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=input_ids, labels=labels)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    assert grads and all(g is not None for g in grads.values())
    return out.loss.detach(), out.aux_loss.detach(), grads


def float64_grads(model, input_ids, labels):
    """The LoRA gradients of a float64 copy of the unpatched model, its experts through transformers' eager loop
    (grouped_mm takes no float64)."""
    copy64 = copy.deepcopy(model).double()
    for module in copy64.modules():
        if getattr(module, "config", None) is not None:
            module.config._experts_implementation = "eager"
    return loss_and_grads(copy64, input_ids, labels)[2]


def check_moe_parity(model_type, monkeypatch, rows=2, seq=9, nf4=None):
    with fp32_products():
        _check_moe_parity(model_type, monkeypatch, rows, seq, nf4)


def _check_moe_parity(model_type, monkeypatch, rows, seq, nf4):
    model = tiny_moe_peft(model_type, nf4, device=DEVICE).train()
    assert any("experts" in n and "lora_A" in n for n, _ in model.named_parameters())
    assert all(p.device.type == DEVICE for p in model.parameters())
    input_ids = torch.randint(3, VOCAB, (rows, seq), device=DEVICE)
    labels = input_ids.clone()
    labels[0, -2:] = -100
    ref_loss, ref_aux, ref_grads = loss_and_grads(model, input_ids, labels)
    assert ref_aux > 0
    f64_grads = float64_grads(model, input_ids, labels) if nf4 is None else ref_grads  # NF4 stays fp32: bar 1e-4

    leantune.patch(model)
    summary = model.leantune_summary
    assert summary["family"] == model_type and summary["unpatched"] == {}
    assert summary["counts"]["experts"] == 2 and summary["counts"]["experts_lora"] == 2
    assert any("ops.moe_experts" in part for part in summary["fused"])
    calls = []
    original = ops.moe_experts
    monkeypatch.setattr(ops, "moe_experts", lambda *a, **k: calls.append(1) or original(*a, **k))
    sink_calls = []
    if FAMILIES[model_type].attention_sinks_attr:  # gpt-oss on eager (its default): the sinks through SDPA
        assert model.config._attn_implementation == "eager"
        assert any("ops.sink_attention" in part for part in summary["fused"])
        assert "attention kernel" not in summary["kept"]
        sink_attention = ops.sink_attention
        monkeypatch.setattr(ops, "sink_attention", lambda *a, **k: sink_calls.append(
            (k["sliding_window"], k["attention_mask"])) or sink_attention(*a, **k))
        from transformers.models.gpt_oss import modeling_gpt_oss

        def refuse_eager(*args, **kwargs):
            raise AssertionError("HF's eager attention ran for gpt-oss")

        monkeypatch.setattr(modeling_gpt_oss, "eager_attention_forward", refuse_eager)
    from peft.tuners.lora import layer

    def refuse(*args, **kwargs):
        raise AssertionError("PEFT's parametrized forward (W + BA for the stack) ran")

    monkeypatch.setattr(layer.ParamWrapper, "_activate_lora", refuse)
    loss, aux, grads = loss_and_grads(model, input_ids, labels)
    assert len(calls) == 2
    if FAMILIES[model_type].attention_sinks_attr:
        # sliding layer (window 4) then full; no padding mask: the causal-LM forward hands no masks, the op applies
        # causality and the window itself (transformers' eager masks are not built)
        assert sink_calls == [(4, None), (None, None)], sink_calls
    assert rel_err(aux, ref_aux) <= 1e-5, f"{model_type}: aux loss {aux.item()} vs HF {ref_aux.item()}"
    err = rel_err(loss, ref_loss)
    assert err <= 1e-5, f"{model_type}: loss {loss.item()} vs HF {ref_loss.item()}: rel {err:.3g}"
    for name, ref in ref_grads.items():  # HF's own fp32 rounding sets part of the bar (module docstring)
        hf_err = rel_err(ref, f64_grads[name])
        err = rel_err(grads[name], ref)
        assert err <= 1e-4 + 3 * hf_err, f"{name}: rel {err:.3g} vs HF (HF vs float64: {hf_err:.3g})"
    assert any("experts" in n for n in grads)
    monkeypatch.undo()
    leantune.unpatch(model)
    loss_back, _, grads_back = loss_and_grads(model, input_ids, labels)
    assert torch.equal(loss_back, ref_loss), "unpatch must restore HF's exact loss"


@pytest.mark.parametrize("model_type", list(MOE))
def test_moe_matches_hf(model_type, monkeypatch):
    monkeypatch.setenv("LEANTUNE_BACKEND", "torch")
    check_moe_parity(model_type, monkeypatch)


@pytest.mark.parametrize("model_type", TRITON)
def test_moe_matches_hf_triton(model_type, monkeypatch):
    """Through the Triton backend (interpreter on the CPU, the card on CUDA): one row of 5 tokens."""
    monkeypatch.setenv("LEANTUNE_BACKEND", "triton")
    check_moe_parity(model_type, monkeypatch, rows=1, seq=5)


@pytest.mark.parametrize("order", ["before", "after"])
@pytest.mark.parametrize("model_type", TRITON)
def test_nf4_experts_match_peft(model_type, order, monkeypatch):
    """QLoRA on MoE: linears and expert stacks in NF4 (quantised before or after get_peft_model); patched (the
    stacks dequantised inside ops.moe_experts) vs unpatched PEFT over the same NF4-dequantised weights."""
    monkeypatch.setenv("LEANTUNE_BACKEND", "torch")
    check_moe_parity(model_type, monkeypatch, nf4=order)


def test_nf4_experts_triton(monkeypatch):
    monkeypatch.setenv("LEANTUNE_BACKEND", "triton")
    check_moe_parity("qwen3_moe", monkeypatch, rows=1, seq=5, nf4="before")


def test_nf4_experts_state_dict_and_memory():
    """Either order gives the same model; the state dict holds the experts' NF4 buffers (no placeholder) and loads
    into a model quantised from other weights, whose stacks (codes, scales, offset) then dequantise to the same
    values (NF4Linear's buffers are not persistent: the linears are not compared); the placeholders hold one
    element."""
    input_ids = torch.randint(3, VOCAB, (2, 7))
    losses, models = [], []
    for order in ("before", "after"):
        torch.manual_seed(5)
        model = tiny_moe_peft("mixtral", order)
        losses.append(model(input_ids=input_ids, labels=input_ids).loss.detach())
        models.append(model)
    assert torch.equal(losses[0], losses[1])
    experts = models[0].base_model.model.model.layers[0].mlp.experts
    while hasattr(experts, "base_layer"):
        experts = experts.base_layer
    assert experts.gate_up_proj.shape == (4, 48, 32) and experts.gate_up_proj.untyped_storage().nbytes() == 4
    state = models[0].state_dict()
    assert not any(k.endswith(("experts.base_layer.base_layer.gate_up_proj", "experts.base_layer.base_layer.down_proj"))
                   for k in state)
    assert any(k.endswith("gate_up_proj_nf4_codes") for k in state)
    torch.manual_seed(6)
    other = tiny_moe_peft("mixtral", "before")
    assert not torch.equal(other(input_ids=input_ids, labels=input_ids).loss, losses[0])
    other.load_state_dict(state, strict=True)

    def stacks(model):
        found = [m for m in model.modules() if hasattr(m, "nf4_stack")]
        assert len(found) == 2
        return [ops.dequantize_nf4(m.nf4_stack(n)) for m in found for n in ("gate_up_proj", "down_proj")]

    assert all(torch.equal(a, b) for a, b in zip(stacks(other), stacks(models[0])))
    found = [m for m in other.modules() if hasattr(m, "nf4_stack")]
    buffers = [{n: b.clone() for n, b in m.named_buffers()} for m in found]
    other.to(torch.float64)  # .to rebuilds the one-element placeholders in the new dtype
    base = other.base_model.model.model.layers[0].mlp.experts.base_layer.base_layer
    assert base.gate_up_proj.dtype == torch.float64 and base.gate_up_proj.untyped_storage().nbytes() == 8
    # the NF4 buffers (codes, fp32 scales and tables, offset) keep their dtypes and bits; the stacks dequantise to
    # the new dtype where it is one NF4 computes in (float64 is not: they stay fp32)
    for cast, dtype in ((torch.float64, torch.float32), (torch.bfloat16, torch.bfloat16)):
        other.to(cast)
        for m, before in zip(found, buffers):
            after = dict(m.named_buffers())
            assert all(after[n].dtype == b.dtype and torch.equal(after[n], b) for n, b in before.items())
            assert m.nf4_stack("gate_up_proj").dtype == dtype
    assert all(torch.equal(a.to(torch.bfloat16), b) for a, b in zip(stacks(models[0]), stacks(other)))


@pytest.mark.parametrize("model_type", TRITON)
def test_nf4_experts_module_is_hf_over_dequantised_stacks(model_type):
    """The NF4 experts module's own (unpatched) forward equals HF's experts class over the dequantised stacks, with
    no PEFT; a stack NF4 cannot hold raises naming it and leaves the model unchanged."""
    model = tiny_moe_model(model_type)
    experts = model.model.layers[1].mlp.experts
    leantune.quantize(model, "nf4")
    assert type(experts).__name__.startswith("NF4") and experts.gate_up_proj.stride() == (0, 0, 0)
    reference = experts._leantune_float_class(model.config)
    with torch.no_grad():
        for name in ("gate_up_proj", "down_proj"):
            getattr(reference, name).copy_(ops.dequantize_nf4(experts.nf4_stack(name)))
        for name, param in experts.named_parameters():  # the rest as they are (gpt-oss's expert biases)
            if name not in ("gate_up_proj", "down_proj"):
                getattr(reference, name).copy_(param)
    x = torch.randn(7, 32)
    index = torch.rand(7, 4).argsort(-1)[:, :2]
    weights = torch.rand(7, 2)
    assert torch.equal(experts(x, index, weights), reference(x, index, weights))
    for twin in (copy.deepcopy(experts), pickle.loads(pickle.dumps(experts))):  # placeholders stay one element
        assert type(twin) is type(experts) and twin.gate_up_proj.untyped_storage().nbytes() == 4
        assert torch.equal(twin(x, index, weights), reference(x, index, weights))

    model = tiny_moe_model(model_type)
    bad = model.model.layers[0].mlp.experts
    bad.down_proj = torch.nn.Parameter(torch.randn(4, 31, 23))  # 2852 weights
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts\.down_proj: NF4 needs .* multiple of 64"):
        leantune.quantize(model, "nf4")
    assert not any(type(m).__name__.startswith("NF4") for m in model.modules())


def test_olmoe_clip_qkv_through_hf_attention(monkeypatch):
    """OLMoE with LoRA on the router only: HF's attention runs over leantune's norms and clamps q_norm's output in
    place (clip_qkv); loss and LoRA gradients equal the unpatched model's."""
    monkeypatch.setenv("LEANTUNE_BACKEND", "torch")
    model = get_peft_model(tiny_moe_model("olmoe"), LoraConfig(r=4, lora_alpha=8, target_modules=["gate"],
                                                                init_lora_weights=False)).train()
    input_ids = torch.randint(3, VOCAB, (2, 9))
    ref_loss, _, ref_grads = loss_and_grads(model, input_ids, input_ids)
    leantune.patch(model)
    loss, _, grads = loss_and_grads(model, input_ids, input_ids)
    assert rel_err(loss, ref_loss) <= 1e-5
    for name, ref in ref_grads.items():
        assert rel_err(grads[name], ref) <= 1e-4, name


def test_qwen2_moe_without_shared_expert_keeps_hf_mlp(monkeypatch):
    """Qwen2-MoE with shared_expert_intermediate_size 0: its zero-width shared-expert MLP keeps HF's forward (the
    fused ops take no empty projection) and the summary says so; the rest is patched and matches HF+PEFT."""
    monkeypatch.setenv("LEANTUNE_BACKEND", "torch")
    model = model_from_config(
        "qwen2_moe", num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        vocab_size=VOCAB, intermediate_size=24, num_experts=4, moe_intermediate_size=24, num_experts_per_tok=2,
        shared_expert_intermediate_size=0, pad_token_id=0)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                             init_lora_weights=False)).train()
    input_ids = torch.randint(3, VOCAB, (2, 9))

    def run():  # the zero-width shared expert's LoRA gets no gradient, on both sides
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}

    ref_loss, ref_grads = run()
    leantune.patch(model)
    summary = model.leantune_summary
    kept = {**summary["kept"], **summary["unpatched"]}
    assert sum("no rows or columns" in str(reason) for reason in kept.values()) == 2, kept
    loss, grads = run()
    assert rel_err(loss, ref_loss) <= 1e-5
    assert sum(g is not None for g in ref_grads.values()) > 0
    for name, ref in ref_grads.items():
        assert (grads[name] is None) == (ref is None), name
        assert ref is None or rel_err(grads[name], ref) <= 1e-4, name


def test_disabled_adapters_keep_peft(monkeypatch):
    """With adapters disabled (a DPO reference pass), PEFT's / HF's experts forward runs, as unpatched."""
    monkeypatch.setenv("LEANTUNE_BACKEND", "torch")
    model = tiny_moe_peft("qwen3_moe").eval()
    input_ids = torch.randint(3, VOCAB, (1, 7))
    with torch.no_grad(), model.disable_adapter():
        ref = model(input_ids=input_ids).logits
    leantune.patch(model)
    with torch.no_grad(), model.disable_adapter():
        out = model(input_ids=input_ids).logits
    assert rel_err(out, ref) <= 1e-5


def test_gpt_oss_attention_gets_sinks_and_windows(monkeypatch):
    """gpt-oss under an attention implementation other than eager/sdpa (here a spy's; flex, flash and hub kernels
    alike): HF's attention function runs (it applies the sinks); the patched forward (fused q/k/v/o LoRA) must
    pass it ``s_aux`` = the module's sinks and the layer's sliding window, as HF's forward does. The spy computes
    the attention with the sinks it is given (not ``module.sinks``), so a forward that dropped them would miss
    the parity; the sinks are made large so that they matter."""
    from transformers import AttentionInterface
    from transformers.models.gpt_oss import modeling_gpt_oss

    seen = []

    def attention_with_given_sinks(module, query, key, value, attention_mask, **kwargs):
        seen.append((module.layer_idx, kwargs.get("s_aux") is module.sinks, kwargs.get("sliding_window")))
        sinks = module.sinks
        try:
            del module.sinks  # eager reads module.sinks: make it read what it was handed
            module.sinks = kwargs.pop("s_aux", torch.zeros_like(sinks))
            return modeling_gpt_oss.eager_attention_forward(module, query, key, value, attention_mask, **kwargs)
        finally:
            del module.sinks
            module.register_parameter("sinks", sinks)

    AttentionInterface.register("leantune_spy_sinks", attention_with_given_sinks)
    monkeypatch.setenv("LEANTUNE_BACKEND", "torch")
    model = tiny_moe_peft("gpt_oss").train()
    model.base_model.model.config._attn_implementation = "leantune_spy_sinks"
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, modeling_gpt_oss.GptOssAttention):
                module.sinks.normal_(0.0, 2.0)
    input_ids = torch.randint(3, VOCAB, (2, 9))
    ref_loss, _, ref_grads = loss_and_grads(model, input_ids, input_ids)
    expected = [(0, True, 4), (1, True, None)]
    assert seen == expected, seen
    seen.clear()
    leantune.patch(model)
    assert "attention sinks" in model.leantune_summary["kept"]["attention kernel"]
    assert not any("ops.sink_attention" in part for part in model.leantune_summary["fused"])
    assert model.leantune_summary["counts"]["lora_qkv"] == 2  # the projections around HF's kernel are fused
    loss, _, grads = loss_and_grads(model, input_ids, input_ids)
    assert seen == expected, seen
    assert rel_err(loss, ref_loss) <= 1e-5
    assert_grads_close(grads, ref_grads)


@pytest.mark.parametrize("labels", [True, False])
@pytest.mark.parametrize("given", ["padding", "packed"])
def test_gpt_oss_sink_attention_with_hf_masks(given, labels, monkeypatch):
    """gpt-oss on eager with a padding mask (left padding on row 0, right on row 1) or packed documents (positions
    restarting mid-row, no mask: transformers' block-diagonal mask), with labels (leantune's causal-LM forward) and
    without (HF's, logits): transformers builds its eager masks (padding or documents, causality, the window) and
    ops.sink_attention takes them in place of HF's eager function; loss / logits and every LoRA gradient as
    unpatched HF's."""
    from transformers.models.gpt_oss import modeling_gpt_oss

    monkeypatch.setenv("LEANTUNE_BACKEND", "torch")
    model = tiny_moe_peft("gpt_oss").train()
    input_ids = torch.randint(3, VOCAB, (2, 9))
    mask = torch.ones(2, 9, dtype=torch.long)
    if given == "padding":
        mask[0, :3] = 0
        mask[1, -2:] = 0
        inputs = {"attention_mask": mask}
    else:
        inputs = {"position_ids": torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5, 0, 1, 2]])}
    inputs |= {"labels": input_ids.masked_fill(mask == 0, -100)} if labels else {}

    def run():
        model.zero_grad(set_to_none=True)
        out = model(input_ids=input_ids, **inputs)
        value = out.loss if labels else (out.logits * mask[..., None]).square().mean()
        value.backward()
        return value.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    ref, ref_grads = run()
    leantune.patch(model)
    seen = []
    sink_attention = ops.sink_attention
    monkeypatch.setattr(ops, "sink_attention", lambda *a, **k: seen.append(
        (k["sliding_window"], tuple(k["attention_mask"].shape))) or sink_attention(*a, **k))
    monkeypatch.setattr(modeling_gpt_oss, "eager_attention_forward", None)  # HF's eager must not run
    got, grads = run()
    assert seen == [(4, (2, 1, 9, 9)), (None, (2, 1, 9, 9))], seen
    assert rel_err(got, ref) <= 1e-5
    assert_grads_close(grads, ref_grads)


def test_gpt_oss_rope_dispatch_widens_per_frequency_cos(monkeypatch):
    """gpt-oss's cos/sin hold one column per frequency (head_dim / 2): inside a patched attention forward the
    dispatcher widens them for ops.rope (HF's rotation within fp32 rounding); inputs the op does not take (float64)
    or cos of another width (one broadcast column) reach HF's function exactly as given."""
    from transformers.models.gpt_oss import modeling_gpt_oss

    from leantune.patch import forwards
    from leantune.patch._common import reset_rope_active, set_rope_active

    monkeypatch.setenv("LEANTUNE_BACKEND", "torch")
    hf = modeling_gpt_oss.apply_rotary_pos_emb
    dispatch = forwards._make_rope_dispatch(hf)
    q, k = torch.randn(2, 4, 7, 8), torch.randn(2, 2, 7, 8)
    angles = torch.rand(1, 7, 4) * 6
    cos, sin = angles.cos(), angles.sin()
    calls = []
    original = ops.rope
    monkeypatch.setattr(ops, "rope", lambda *a, **kw: calls.append(a[2].shape) or original(*a, **kw))
    token = set_rope_active("half_freqs")
    try:
        out = dispatch(q, k, cos, sin)
        assert calls == [torch.Size([7, 8])]  # widened, one position row for the batch
        for got, ref in zip(out, hf(q.double(), k.double(), cos.double(), sin.double())):
            assert rel_err(got, ref) <= 1e-6
        q64, k64 = q.double(), k.double()
        for args in ((q64, k64, cos.double(), sin.double()), (q, k, cos[..., :1], sin[..., :1])):
            for got, ref in zip(dispatch(*args), hf(*args)):
                assert torch.equal(got, ref)
        assert len(calls) == 1
    finally:
        reset_rope_active(token)


def test_export_rounds_expert_stacks_through_nf4():
    """``leantune export`` of a QLoRA run merges into the base as the run saw it: the float model's expert stacks
    replaced by their NF4 values, equal to what ``leantune.quantize`` dequantises to."""
    from leantune.train.merge import _dequantised_base

    torch.manual_seed(3)
    base = tiny_moe_model("mixtral")
    torch.manual_seed(3)
    quantised = tiny_moe_model("mixtral")
    leantune.quantize(quantised, "nf4")
    _dequantised_base(base, torch.float32)
    for layer, q_layer in zip(base.model.layers, quantised.model.layers):
        for name in ("gate_up_proj", "down_proj"):
            expected = ops.dequantize_nf4(q_layer.mlp.experts.nf4_stack(name))
            assert torch.equal(getattr(layer.mlp.experts, name), expected)


def test_gpt_oss_config_output_attentions_keeps_hf_attention(monkeypatch):
    """config.output_attentions asks for the weights, which ops.sink_attention does not form: HF's eager runs and
    returns them, with HF's loss."""
    monkeypatch.setenv("LEANTUNE_BACKEND", "torch")
    model = tiny_moe_peft("gpt_oss").train()
    model.config.output_attentions = True
    input_ids = torch.randint(3, VOCAB, (2, 7))
    ref = model(input_ids=input_ids, labels=input_ids)
    leantune.patch(model)
    out = model(input_ids=input_ids, labels=input_ids)
    assert len(out.attentions) == 2 and all(a.shape == (2, 4, 7, 7) for a in out.attentions)
    assert rel_err(out.loss, ref.loss) <= 1e-5


def test_return_dict_false_keeps_hf_positions():
    """A MoE causal LM's tuple (loss, aux_loss, logits, cache, router logits): the logits slot stays (None in
    training, where leantune forms no logits) so every later field keeps HF's index."""
    model = tiny_moe_model("qwen3_moe").train()
    input_ids = torch.randint(3, VOCAB, (2, 9))
    with torch.no_grad():
        ref = model(input_ids=input_ids, labels=input_ids, return_dict=False, use_cache=True)
        leantune.patch(model)
        out = model(input_ids=input_ids, labels=input_ids, return_dict=False, use_cache=True)
    assert len(out) == len(ref) == 5 and out[2] is None and ref[2] is not None
    assert [type(v) for i, v in enumerate(out) if i != 2] == [type(v) for i, v in enumerate(ref) if i != 2]
    assert rel_err(out[0], ref[0]) <= 1e-5 and rel_err(out[1], ref[1]) <= 1e-5


def test_tile_mlp_says_experts_blocks_are_not_tiled():
    model = tiny_moe_model("mixtral")
    with pytest.warns(UserWarning, match="does not tile mixtral's MoE experts blocks"):
        leantune.patch(model, tile_mlp=4)
    assert "not tiled" in model.leantune_summary["unpatched"]["<experts blocks>"]
