"""Liger's options on ops.cross_entropy / ops.linear_cross_entropy (per-class weights, token scaling, token accuracy)
against float64 references written from the formulas of leantune.ops._loss_options, both backends (the Triton one
through the interpreter on tiny shapes), NaN-poisoned buffers (conftest), and no host sync under deferred checks.

Tensors live on ``conftest.DEVICE`` (the CPU here; the card on CUDA, where TF32 is off for cuBLAS in every test: the
torch backend's fp32 logits must stay fp32 for the 1e-5 bar)."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE
from reference import F64, assert_close, fp32_products
from test_no_sync import SyncCalls

from leantune import ops

N, H, V, IGNORE = 13, 8, 37, -100


@pytest.fixture(autouse=True)
def _fp32_products():
    with fp32_products():
        yield


def _draw(softcap=None):
    """hidden [N, H], weight [V, H], bias [V] (fp32, requiring grad), labels [N] (3 ignored), class weights [V]; all
    on DEVICE."""
    hidden = torch.randn(N, H, device=DEVICE, requires_grad=True)
    weight = (torch.randn(V, H, device=DEVICE) / H**0.5).requires_grad_()
    bias = (0.1 * torch.randn(V, device=DEVICE)).requires_grad_()
    labels = torch.randint(0, V, (N,), device=DEVICE)
    labels[torch.randperm(N, device=DEVICE)[:3]] = IGNORE
    class_weight = torch.rand(V, device=DEVICE) + 0.2
    return hidden, weight, bias, labels, class_weight


def _reference(logits, labels, class_weight, scaling, reduction, softcap=None, num_items=None):
    """float64: l_i = lse(z_i) - z_i[y_i] for z = c tanh(x / c) (or x), r_i = w[y_i] p_i l_i (terms off: 1)."""
    z = logits.to(F64)
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    valid = labels != IGNORE
    safe = torch.where(valid, labels, 0)
    rows = torch.where(valid, torch.logsumexp(z, -1) - z.gather(1, safe[:, None])[:, 0], 0.0)
    w = torch.where(valid, class_weight.to(F64)[safe], 0.0) if class_weight is not None else valid.to(F64)
    scaled = rows * (w if class_weight is not None else 1.0)
    if scaling:
        scaled = scaled * torch.exp(-rows).detach()
    if reduction == "none":
        return scaled
    if reduction == "sum":
        return scaled.sum()
    return scaled.sum() / (num_items if num_items is not None else w.sum().clamp_min(1e-300))


CASES = {  # (class weights, token scaling, reduction, softcap, num_items)
    "weight_mean": (True, False, "mean", None, None),
    "weight_sum_softcap": (True, False, "sum", 3.0, None),
    "scaling_mean": (False, True, "mean", None, None),
    "both_none": (True, True, "none", None, None),
    "scaling_num_items": (False, True, "mean", 2.0, 17),
}


@pytest.mark.parametrize("case", list(CASES))
def test_options_match_reference(backend, case):
    use_weight, scaling, reduction, softcap, num_items = CASES[case]
    hidden, weight, bias, labels, class_weight = _draw()
    cw = class_weight if use_weight else None
    ref_leaves = [t.detach().to(F64).requires_grad_() for t in (hidden, weight, bias)]
    ref = _reference(ref_leaves[0] @ ref_leaves[1].T + ref_leaves[2], labels, cw, scaling, reduction, softcap,
                     num_items)
    probe = torch.randn(ref.shape, dtype=F64, device=DEVICE)
    ref_grads = torch.autograd.grad((ref * probe).sum(), ref_leaves)

    out, accuracy = ops.linear_cross_entropy(hidden, weight, labels, bias, softcap=softcap, reduction=reduction,
                                             num_items=num_items, ce_weight=cw, use_token_scaling=scaling,
                                             return_token_accuracy=True)
    assert_close(f"{case} loss", out, ref, torch.float32)
    for name, got, want in zip(("hidden", "weight", "bias"), torch.autograd.grad((out * probe.float()).sum(),
                                                                               (hidden, weight, bias)), ref_grads):
        assert_close(f"{case} d{name}", got, want, torch.float32)
    z = ref_leaves[0].detach() @ ref_leaves[1].detach().T + ref_leaves[2].detach()
    valid = labels != IGNORE
    expected_accuracy = ((z.argmax(-1) == labels) & valid).sum() / valid.sum()
    assert accuracy.dtype == torch.float32 and not accuracy.requires_grad
    assert_close(f"{case} accuracy", accuracy, expected_accuracy, torch.float32)

    logits = (hidden.detach() @ weight.detach().T + bias.detach()).requires_grad_()
    out = ops.cross_entropy(logits, labels, softcap=softcap, reduction=reduction, num_items=num_items, weight=cw,
                            use_token_scaling=scaling)
    ref_logits = z.clone().requires_grad_()
    ref = _reference(ref_logits, labels, cw, scaling, reduction, softcap, num_items)
    assert_close(f"{case} cross_entropy loss", out, ref, torch.float32)
    (got,), (want,) = (torch.autograd.grad((o * probe.to(o.dtype)).sum(), (x,)) for o, x in ((out, logits),
                                                                                         (ref, ref_logits)))
    assert_close(f"{case} cross_entropy dlogits", got, want, torch.float32)


def test_token_accuracy_beside_statistics_and_all_ignored(backend):
    hidden, weight, bias, labels, _ = _draw()
    loss, stats, accuracy = ops.linear_cross_entropy(hidden, weight, labels, bias, statistics=("entropy",),
                                                     return_token_accuracy=True)
    assert set(stats) == {"entropy"} and torch.equal(loss, ops.linear_cross_entropy(hidden, weight, labels, bias))
    logits = hidden.detach() @ weight.detach().T + bias.detach()
    _, from_logits = ops.cross_entropy(logits, labels, return_token_accuracy=True)
    assert torch.equal(accuracy, from_logits)
    none = torch.full((N,), IGNORE, device=DEVICE)  # nothing valid: loss 0.0 with zero gradients, accuracy 0
    loss, accuracy = ops.linear_cross_entropy(hidden, weight, none, bias, ce_weight=torch.rand(V, device=DEVICE),
                                              return_token_accuracy=True)
    (grad,) = torch.autograd.grad(loss, (hidden,))
    assert loss.item() == 0.0 and accuracy.item() == 0.0 and not grad.any()


def test_options_are_checked():
    hidden, weight, bias, labels, class_weight = _draw()
    with pytest.raises(ValueError, match=r"ce_weight must have shape \(37,\)"):
        ops.linear_cross_entropy(hidden, weight, labels, ce_weight=torch.rand(V + 1, device=DEVICE))
    with pytest.raises(ValueError, match="ce_weight is not supported with label_smoothing"):
        ops.linear_cross_entropy(hidden, weight, labels, ce_weight=class_weight, label_smoothing=0.1)
    with pytest.raises(ValueError, match="use_token_scaling is not supported with label_smoothing or z_loss"):
        ops.cross_entropy(hidden @ weight.T, labels, use_token_scaling=True, z_loss=1e-4)
    with pytest.raises(ValueError, match="use_token_scaling must be a bool"):
        ops.cross_entropy(hidden @ weight.T, labels, use_token_scaling=1)
    with pytest.raises(ValueError, match="num_items is only valid with reduction='mean'"):
        ops.cross_entropy(hidden @ weight.T, labels, weight=class_weight, reduction="sum", num_items=3)
    with pytest.raises(ValueError, match="reduction must be one of"):
        ops.linear_cross_entropy(hidden, weight, labels, return_token_accuracy=True, reduction="avg")


def test_options_add_no_host_sync_when_deferred(monkeypatch, backend):
    hidden, weight, bias, labels, class_weight = _draw()
    watch = SyncCalls(monkeypatch)
    num_items = torch.tensor(7, device=DEVICE)  # made here: creating a CUDA tensor from a host value copies
    with watch:
        loss, accuracy = ops.linear_cross_entropy(hidden, weight, labels, bias, ce_weight=class_weight,
                                                  use_token_scaling=True, return_token_accuracy=True,
                                                  num_items=num_items, checks="deferred")
        loss.backward()
        rows = ops.cross_entropy(hidden.detach() @ weight.detach().T, labels, weight=class_weight,
                                 reduction="none", return_token_accuracy=True, checks="deferred")[0]
    assert watch.calls == [], watch.calls
    assert torch.isfinite(loss) and rows.shape == (N,)


@pytest.mark.parametrize("reduction,num_items", [("mean", None), ("sum", None), ("mean", 20)])
def test_return_z_loss_matches_reference(backend, reduction, num_items):
    """return_z_loss: the loss (with its z-loss term) unchanged, and the term z_loss * lse^2 reduced as the loss."""
    hidden, weight, bias, labels, _ = _draw()
    z_coef, softcap = 0.3, 4.0
    leaves = [t.detach().to(F64).requires_grad_() for t in (hidden, weight, bias)]
    z = softcap * torch.tanh((leaves[0] @ leaves[1].T + leaves[2]) / softcap)
    valid = labels != IGNORE
    lse = torch.logsumexp(z, -1)
    nll = torch.where(valid, lse - z.gather(1, torch.where(valid, labels, 0)[:, None])[:, 0], 0.0)
    term = torch.where(valid, z_coef * lse**2, 0.0)
    divisor = 1.0 if reduction == "sum" else (num_items or valid.sum())
    ref_loss, ref_term = (nll + term).sum() / divisor, term.sum() / divisor
    ref_grads = torch.autograd.grad(ref_loss, leaves)

    loss, term_out, accuracy = ops.linear_cross_entropy(hidden, weight, labels, bias, z_loss=z_coef, softcap=softcap,
                                                        reduction=reduction, num_items=num_items,
                                                        return_z_loss=True, return_token_accuracy=True)
    plain = ops.linear_cross_entropy(hidden, weight, labels, bias, z_loss=z_coef, softcap=softcap,
                                     reduction=reduction, num_items=num_items)
    assert_close("loss", loss, ref_loss, torch.float32)
    assert_close("loss vs the op without options", loss, plain, torch.float32)
    assert_close("z-loss term", term_out, ref_term, torch.float32)
    assert not term_out.requires_grad and accuracy.shape == ()
    for name, got, want in zip("hwb", torch.autograd.grad(loss, (hidden, weight, bias)), ref_grads):
        assert_close(f"d{name}", got, want, torch.float32)

    logits = (hidden.detach() @ weight.detach().T + bias.detach()).requires_grad_()
    loss, term_out = ops.cross_entropy(logits, labels, z_loss=z_coef, softcap=softcap, reduction=reduction,
                                       num_items=num_items, return_z_loss=True)
    assert_close("cross_entropy loss", loss, ref_loss, torch.float32)
    assert_close("cross_entropy z-loss term", term_out, ref_term, torch.float32)
    (grad,) = torch.autograd.grad(loss, (logits,))
    ref_logits = logits.detach().to(F64).requires_grad_()
    zr = softcap * torch.tanh(ref_logits / softcap)
    lse_r = torch.logsumexp(zr, -1)
    rows = torch.where(valid, lse_r - zr.gather(1, torch.where(valid, labels, 0)[:, None])[:, 0] + z_coef * lse_r**2,
                       0.0)
    (want,) = torch.autograd.grad(rows.sum() / divisor, (ref_logits,))
    assert_close("cross_entropy dlogits", grad, want, torch.float32)


def test_accum_dtype(monkeypatch):
    """accum_dtype: dweight's sum over token chunks (fast path, bf16, 256-row chunks). None and float32 sum in
    fp32 (the same bits); bfloat16 sums in bf16, within bf16 tolerance of the float64 reference and no closer (7
    chunks: over 40 draws the fp32 sum's error was at most 0.68 of the bf16 sum's)."""
    monkeypatch.setenv("LEANTUNE_BACKEND", "torch")  # the sum is torch's mm; the kernels are unchanged
    n = 1600
    hidden = torch.randn(n, H, dtype=torch.bfloat16, device=DEVICE)
    weight = (torch.randn(V, H, device=DEVICE) / H**0.5).to(torch.bfloat16).requires_grad_()
    labels = torch.randint(0, V, (n,), device=DEVICE)
    small = 256 * V * 2  # 256-row chunks
    grads = {}
    for accum in (None, torch.float32, torch.bfloat16):
        loss = ops.linear_cross_entropy(hidden, weight, labels, chunk_bytes=small, accum_dtype=accum, reduction="sum")
        (grads[accum],) = torch.autograd.grad(loss, (weight,))
    ref_w = weight.detach().to(F64).requires_grad_()
    z = hidden.to(F64) @ ref_w.T
    (ref,) = torch.autograd.grad((torch.logsumexp(z, -1) - z.gather(1, labels[:, None])[:, 0]).sum(), (ref_w,))
    assert torch.equal(grads[None], grads[torch.float32]) and grads[torch.bfloat16].dtype == torch.bfloat16
    wide, narrow = (assert_close(f"dweight {a}", grads[a], ref, torch.bfloat16) for a in (None, torch.bfloat16))
    assert wide <= narrow
    with pytest.raises(ValueError, match="accum_dtype must be None, torch.float32 or the compute dtype"):
        ops.linear_cross_entropy(hidden, weight, labels, accum_dtype=torch.float16)
