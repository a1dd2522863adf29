"""leantune.graphs.CapturedStep: captured steps equal eager steps (losses, gradient norms, weights).

On the CPU a recorder stands in for CUDA graphs: "capture" keeps the function and "replay" calls it, so the step's
own logic (static input buffers, in-place gradient accumulation and zeroing, micro-batches then one update) is what
is tested; a buffer the replay forgot to refresh, or gradients left from the previous step, change the numbers. On
the GPU the same comparison runs through real CUDA graphs.
"""

from __future__ import annotations

import copy

import numpy
import pytest
import torch
from conftest import ON_GPU
from test_patch_families import batch, tiny_peft_model

import leantune
from leantune.graphs import CapturedStep, graphable_optimizer


def sdpa_peft_model():
    """The tiny Llama with LoRA, on SDPA: eager attention builds its float mask from a CPU scalar, a copy CUDA
    graphs cannot capture (transformers', not leantune's)."""
    from peft import get_peft_model
    from test_patch_families import lora_config, tiny_config
    from transformers import AutoModelForCausalLM

    config = tiny_config("llama")
    config._attn_implementation = "sdpa"
    return get_peft_model(AutoModelForCausalLM.from_config(config), lora_config())


def recorder(fn, stream):
    captured = []

    def replay():
        captured.append(1)
        fn()

    return replay


def _eager_reference(model, optimizer, batches, max_grad_norm):
    losses, norms = [], []
    params = [p for p in model.parameters() if p.requires_grad]
    for micro in batches:
        total = 0.0
        for ids, labels in micro:
            loss = model(input_ids=ids, labels=labels).loss
            loss.backward()
            total += float(loss.detach())
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, max_grad_norm)))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total)
    return losses, norms


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")])])
def test_captured_steps_equal_eager_steps(device, monkeypatch):
    monkeypatch.setenv("LEANTUNE_BACKEND", "torch" if device == "cpu" else "auto")
    torch.manual_seed(0)
    base = sdpa_peft_model().to(device)
    leantune.patch(base)
    ref = copy.deepcopy(base)
    draws = [[batch() for _ in range(2)] for _ in range(5)]  # 5 steps of 2 micro-batches, fresh tokens each
    draws = [[(ids.to(device), labels.to(device)) for ids, labels in micro] for micro in draws]

    opt_ref = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    ref_losses, ref_norms = _eager_reference(ref, opt_ref, draws, max_grad_norm=0.5)

    params = [p for p in base.parameters() if p.requires_grad]
    optimizer = graphable_optimizer(params, lr=1e-2)
    step = CapturedStep(base, optimizer, max_grad_norm=0.5, warmup=2, capture=None if device == "cuda" else recorder)
    losses, norms = [], []
    for micro in draws:
        loss, norm = step.step([{"input_ids": ids, "labels": labels} for ids, labels in micro])
        losses.append(float(loss))
        norms.append(float(norm))
    assert step.eager_reason is None
    assert step._micro is not None  # steps 3-5 were replayed
    tol = 1e-5 if device == "cpu" else 2e-3
    for a, b in zip(losses, ref_losses):
        assert abs(a - b) <= tol * abs(b)
    for a, b in zip(norms, ref_norms):
        assert abs(a - b) <= 10 * tol * abs(b)
    for (name, p), q in zip(base.named_parameters(), ref.parameters()):
        if p.requires_grad:
            assert (p - q).norm() <= 10 * tol * q.norm() + 1e-7, name


def test_replay_reads_each_new_batch(monkeypatch):
    """A replay that kept the first batch's tokens would repeat its loss: with lr 0 each step's loss must be the
    eager loss of that step's own tokens."""
    monkeypatch.setenv("LEANTUNE_BACKEND", "torch")
    model = tiny_peft_model("llama")
    leantune.patch(model)
    params = [p for p in model.parameters() if p.requires_grad]
    step = CapturedStep(model, torch.optim.SGD(params, lr=0.0), warmup=1, capture=recorder)
    for _ in range(4):
        ids, labels = batch()
        with torch.no_grad():
            expected = float(model(input_ids=ids, labels=labels).loss)
        loss, norm = step.step({"input_ids": ids, "labels": labels})
        assert norm is None
        assert abs(float(loss) - expected) <= 1e-6 * abs(expected)


def test_bad_input_is_named():
    model = tiny_peft_model("llama")
    params = [p for p in model.parameters() if p.requires_grad]
    with pytest.raises(ValueError, match="warmup"):
        CapturedStep(model, torch.optim.SGD(params, lr=0.1), warmup=0)
    with pytest.raises(ValueError, match="max_grad_norm"):
        CapturedStep(model, torch.optim.SGD(params, lr=0.1), max_grad_norm=-1.0)
    step = CapturedStep(model, torch.optim.SGD(params, lr=0.1), warmup=1, capture=recorder)
    ids, labels = batch(seq=11)
    step.step({"input_ids": ids, "labels": labels})
    ids2, labels2 = batch(seq=12)
    with pytest.raises(ValueError, match=r"batch\['input_ids'\] is \(2, 12\)"):
        step.step({"input_ids": ids2, "labels": labels2})
    with pytest.raises(ValueError, match="non-tensor"):
        step.step({"input_ids": ids, "labels": labels, "use_cache": True})
    with pytest.raises(ValueError, match="mapping"):
        step.step([(ids, labels)])
    with pytest.raises(ValueError, match="at least one"):
        step.step([])
    sgd = torch.optim.SGD(params, lr=0.1)
    for kwargs, name in (({"max_grad_norm": "1"}, "max_grad_norm"), ({"max_grad_norm": True}, "max_grad_norm"),
                         ({"max_grad_norm": float("inf")}, "max_grad_norm"), ({"warmup": True}, "warmup"),
                         ({"loss_scale": float("nan")}, "loss_scale")):
        with pytest.raises(ValueError, match=name):
            CapturedStep(model, sgd, **kwargs)
    with pytest.raises(ValueError, match="model must be a callable"):
        CapturedStep(None, sgd)
    with pytest.raises(ValueError, match="needs labels"):
        CapturedStep(model, sgd, warmup=1, capture=recorder).step({"input_ids": ids})
    with pytest.raises(ValueError, match="no parameters"):
        graphable_optimizer([], lr=0.1)
    with pytest.warns(RuntimeWarning, match="no CUDA graphs on cpu; the steps run eagerly"):
        CapturedStep(model, sgd)


def test_array_valued_batch_argument_is_compared_as_an_object():
    """A non-tensor value that is an array: the same object is the same argument; an equal copy counts as changed
    (its == has no single truth value), named instead of an ambiguous-truth error."""
    model = tiny_peft_model("llama")
    params = [p for p in model.parameters() if p.requires_grad]
    seen = []
    forward = model.forward
    model.forward = lambda *a, extra=None, **k: seen.append(extra) or forward(*a, **k)
    step = CapturedStep(model, torch.optim.SGD(params, lr=0.0), warmup=1, capture=recorder)
    ids, labels = batch()
    flags = numpy.array([1, 2])
    for _ in range(2):
        step.step({"input_ids": ids, "labels": labels, "extra": flags})
    assert len(seen) == 2 and all(s is flags for s in seen)
    with pytest.raises(ValueError, match=r"batch\['extra'\] changed"):
        step.step({"input_ids": ids, "labels": labels, "extra": flags.copy()})


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_uncapturable_optimizer_is_refused():
    model = tiny_peft_model("llama").cuda()
    params = [p for p in model.parameters() if p.requires_grad]
    with pytest.raises(ValueError, match="capturable=True"):
        CapturedStep(model, torch.optim.AdamW(params, lr=1e-3))


def test_capture_keeps_the_mask_free_causal_path(monkeypatch):
    """Under CUDA-graph capture transformers counts as tracing and builds a dense causal mask (SDPA then has no flash
    kernel); for rows leantune made the positions of, the captured forward gets no mask, as an eager one does."""
    monkeypatch.setenv("LEANTUNE_BACKEND", "torch")
    from test_patch_families import lora_config, tiny_config
    from transformers import AutoModelForCausalLM
    from transformers.models.llama import modeling_llama

    config = tiny_config("llama")
    config._attn_implementation = "sdpa"
    from peft import get_peft_model

    model = leantune.patch(get_peft_model(AutoModelForCausalLM.from_config(config), lora_config())).train()
    masks = []
    make = modeling_llama.create_causal_mask
    monkeypatch.setattr(modeling_llama, "create_causal_mask", lambda **kw: masks.append(make(**kw)) or masks[-1])
    ids, labels = batch()
    model(input_ids=ids, labels=labels)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)  # what transformers reads
    model(input_ids=ids, labels=labels)
    assert masks == [None, None]


def test_a_failed_step_leaves_no_gradient_and_fixes_no_layout(monkeypatch):
    """A first step without labels raises and leaves the batch layout open (the corrected batch then runs); a step
    that raises after a micro-batch's backward leaves no gradient for the next step to add to (it doubled the next
    step's gradient norm)."""
    monkeypatch.setenv("LEANTUNE_BACKEND", "torch")
    model = tiny_peft_model("llama")
    params = [p for p in model.parameters() if p.requires_grad]
    step = CapturedStep(model, torch.optim.SGD(params, lr=0.0), max_grad_norm=100.0, warmup=1, capture=recorder)
    ids, labels = batch()
    with pytest.raises(ValueError, match="needs labels"):
        step.step({"input_ids": ids})
    _, norm = step.step({"input_ids": ids, "labels": labels})  # not refused as "built for missing"
    bad = ids.clone()
    bad[0, 0] = 10**6  # past the vocabulary: the embedding raises in the second micro-batch's forward
    with pytest.raises(IndexError):
        step.step([{"input_ids": ids, "labels": labels}, {"input_ids": bad, "labels": labels}])
    assert all(not p.grad.any() for p in params)
    _, again = step.step({"input_ids": ids, "labels": labels})
    assert abs(float(again) - float(norm)) <= 1e-6 * float(norm), (float(again), float(norm))


def test_eval_mode_warns_and_non_tensor_numbers_compare_by_value():
    """A model left in eval mode (from_pretrained's) warns at the first step; 30 and 30.0, NaN and NaN are the same
    argument; capture / prepare that are not callable are refused at construction."""
    model = tiny_peft_model("llama")
    params = [p for p in model.parameters() if p.requires_grad]
    sgd = torch.optim.SGD(params, lr=0.0)
    for name in ("capture", "prepare"):
        with pytest.raises(ValueError, match=f"{name} must be None or a callable, got int"):
            CapturedStep(model, sgd, **{name: 5})
    model.get_base_model().eval()
    step = CapturedStep(model, sgd, warmup=1, capture=recorder)
    ids, labels = batch()
    with pytest.warns(RuntimeWarning, match="modules of the model are in eval mode .* call model.train"):
        step.step({"input_ids": ids, "labels": labels, "num_items_in_batch": 30, "scale": float("nan")})
    model.train()
    step.step({"input_ids": ids, "labels": labels, "num_items_in_batch": 30.0, "scale": float("nan")})
    with pytest.raises(ValueError, match=r"batch\['num_items_in_batch'\] changed from 30 to 31"):
        step.step({"input_ids": ids, "labels": labels, "num_items_in_batch": 31, "scale": float("nan")})


def test_graphable_optimizer_takes_param_groups():
    model = tiny_peft_model("llama")
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = graphable_optimizer([{"params": params[:4]}, {"params": params[4:], "lr": 1e-4}], lr=1e-3)
    assert [float(g["lr"]) for g in optimizer.param_groups] == [1e-3, 1e-4]
    assert sum(len(g["params"]) for g in optimizer.param_groups) == len(params)
    with pytest.raises(ValueError, match="all tensors or all param groups"):
        graphable_optimizer([{"params": params[:4]}, *params[4:]], lr=1e-3)
    for lr, name in (("1e-3", "lr"), (float("nan"), "lr"), (-1.0, "lr")):
        with pytest.raises(ValueError, match=name):
            graphable_optimizer(params, lr=lr)
    with pytest.raises(ValueError, match="param group 0's lr"):
        graphable_optimizer([{"params": params, "lr": "x"}], lr=1e-3)
