"""ops.linear_distillation_loss vs the float64 divergence of the two heads' softmaxes, and vs TRL 1.16's
GKDTrainer.generalized_jsd_loss on materialised logits."""

import pytest
import torch
from conftest import DEVICE
from reference import assert_close, distillation_ref, grads64, recording_sizes

from leantune import ops

N, H, HT, V = 13, 16, 12, 150


def _inputs(dtype=torch.float32, rows=N, vocab=V, bias=True, ignored=2):
    h = torch.randn(rows, H, device=DEVICE).to(dtype).requires_grad_()
    w = (torch.randn(vocab, H, device=DEVICE) * 0.5).to(dtype).requires_grad_()
    b = torch.randn(vocab, device=DEVICE).to(dtype).requires_grad_() if bias else None
    th = torch.randn(rows, HT, device=DEVICE).to(dtype)
    tw = (torch.randn(vocab, HT, device=DEVICE) * 0.5).to(dtype)
    labels = torch.randint(0, vocab, (rows,), device=DEVICE)
    labels[torch.randperm(rows, device=DEVICE)[:ignored]] = -100
    return h, w, b, th, tw, labels


def _check(h, w, b, th, tw, labels, grad_output=1.0, chunks=3, **kwargs):
    rows, vocab = h.shape[0], w.shape[0]
    chunk = -(-rows // chunks) * vocab * 2 * h.element_size()
    loss = ops.linear_distillation_loss(h, w, th, tw, labels, bias=b, chunk_bytes=chunk, **kwargs)
    leaves = [t for t in (h, w, b) if t is not None]
    ref, ref_grads = grads64(lambda *x: distillation_ref(x[0], x[1], th, tw, labels, x[2] if b is not None else None,
                                                         **kwargs), leaves, torch.tensor(grad_output))
    assert loss.dtype == torch.float32
    assert_close("loss", loss, ref, torch.float32)
    grads = torch.autograd.grad(loss * grad_output, leaves)
    for name, g, r in zip(["dhidden", "dweight", "dbias"], grads, ref_grads):
        assert_close(name, g, r, torch.float32)


@pytest.mark.parametrize("beta", [0.0, 0.4, 1.0], ids=["forward-kl", "jsd", "reverse-kl"])
def test_matches_reference(backend, beta):
    """Both backends, 3 chunks, bias, ignored rows, a temperature, a grad_output != 1."""
    rows = 7 if backend == "triton" else N
    _check(*_inputs(rows=rows), beta=beta, temperature=0.8, grad_output=1.7)


def test_options_torch(monkeypatch):
    """Without labels or bias, "sum", num_items (gradient accumulation), frozen student head (LoRA)."""
    monkeypatch.setenv("LEANTUNE_BACKEND", "torch")
    h, w, _, th, tw, _ = _inputs(bias=False)
    _check(h, w, None, th, tw, None, beta=0.5, reduction="sum")
    h, w, b, th, tw, labels = _inputs()
    loss = ops.linear_distillation_loss(h, w, th, tw, labels, bias=b, num_items=40)
    ref = distillation_ref(h, w, th, tw, labels, b, reduction="sum") / 40
    assert_close("num_items", loss, ref, torch.float32)
    w.requires_grad_(False)
    (dh,) = torch.autograd.grad(ops.linear_distillation_loss(h, w, th, tw, labels, bias=b, beta=0.2), [h])
    ref_dh = grads64(lambda x: distillation_ref(x, w, th, tw, labels, b, beta=0.2), [h], torch.tensor(1.0))[1][0]
    assert_close("dhidden (frozen head)", dh, ref_dh, torch.float32)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_matches_trl_generalized_jsd(monkeypatch, beta):
    """TRL 1.16's GKDTrainer.generalized_jsd_loss (batchmean over labels != -100) on the materialised logits."""
    pytest.importorskip("trl")
    from trl.experimental.gkd import GKDTrainer

    monkeypatch.setenv("LEANTUNE_BACKEND", "torch")
    h, w, b, th, tw, labels = _inputs()
    loss = ops.linear_distillation_loss(h, w, th, tw, labels, bias=b, beta=beta, temperature=1.5)
    grads = torch.autograd.grad(loss, [h, w, b])
    leaves = [t.detach().clone().requires_grad_() for t in (h, w, b)]
    trl = GKDTrainer.generalized_jsd_loss((leaves[0] @ leaves[1].T + leaves[2])[None], (th @ tw.T)[None],
                                          labels[None], beta=beta, temperature=1.5)
    assert_close("loss vs TRL", loss, trl, torch.float32)
    for name, g, r in zip(["dhidden", "dweight", "dbias"], grads, torch.autograd.grad(trl, leaves)):
        assert_close(f"{name} vs TRL", g, r, torch.float32)


def test_bf16_within_eager_error(monkeypatch):
    monkeypatch.setenv("LEANTUNE_BACKEND", "torch")
    h, w, b, th, tw, labels = _inputs(torch.bfloat16, rows=40, bias=False)
    loss = ops.linear_distillation_loss(h, w, th, tw, labels, beta=0.5, chunk_bytes=9 * V * 4)
    dh, dw = torch.autograd.grad(loss, [h, w])
    ref, (ref_dh, ref_dw) = grads64(lambda a, c: distillation_ref(a, c, th, tw, labels, beta=0.5), [h, w],
                                    torch.tensor(1.0))
    he, we = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    lp, lq = torch.log_softmax(he @ we.T, -1), torch.log_softmax(th @ tw.T, -1)
    lm = torch.logsumexp(torch.stack([lp + torch.log(torch.tensor(0.5)), lq + torch.log(torch.tensor(0.5))]), 0)
    rows = 0.5 * (lq.exp() * (lq - lm)).sum(-1) + 0.5 * (lp.exp() * (lp - lm)).sum(-1)
    eager = (rows * (labels != -100)).sum() / (labels != -100).sum()
    eager_dh, eager_dw = torch.autograd.grad(eager, [he, we])
    assert_close("loss", loss, ref, torch.bfloat16, eager)
    assert_close("dhidden", dh, ref_dh, torch.bfloat16, eager_dh)
    assert_close("dweight", dw, ref_dw, torch.bfloat16, eager_dw)


def test_never_an_n_by_v_tensor(backend):
    """No op output or leantune buffer holds N*V elements (N*V above every weight-sized tensor here)."""
    rows, vocab = 40, 50
    h, w, b, th, tw, labels = _inputs(rows=rows, vocab=vocab)


    with recording_sizes() as sizes:
        ops.linear_distillation_loss(h, w, th, tw, labels, bias=b, chunk_bytes=6 * vocab * 8).backward()
    assert max(sizes) < rows * vocab, max(sizes)
    assert_close("dweight", w.grad, grads64(lambda x: distillation_ref(h, x, th, tw, labels, b), [w],
                                            torch.tensor(1.0))[1][0], torch.float32)


def test_error_cases():
    h, w, b, th, tw, labels = _inputs(rows=5, vocab=30)
    with pytest.raises(ValueError, match="beta must be in"):
        ops.linear_distillation_loss(h, w, th, tw, beta=1.5)
    with pytest.raises(ValueError, match="teacher_weight must have the student's vocabulary"):
        ops.linear_distillation_loss(h, w, th, tw[:-1])
    with pytest.raises(ValueError, match="teacher_hidden must have shape"):
        ops.linear_distillation_loss(h, w, th[:-1], tw)
    with pytest.raises(ValueError, match="reduction must be one of"):
        ops.linear_distillation_loss(h, w, th, tw, reduction="mean")
    with pytest.raises(ValueError, match="temperature must be"):
        ops.linear_distillation_loss(h, w, th, tw, temperature=0)
    with pytest.raises(ValueError, match="inverse is finite"):
        ops.linear_distillation_loss(h, w, th, tw, temperature=1e-320)
    with pytest.raises(ValueError, match="num_items is 0 but all 5 rows are scored"):
        ops.linear_distillation_loss(h, w, th, tw, num_items=0)
    with pytest.raises(ValueError, match="num_items is 0 but 5 labels are valid"):
        ops.linear_distillation_loss(h, w, th, tw, num_items=torch.tensor(0, device=h.device))
    with pytest.raises(ValueError, match="labels must have shape"):
        ops.linear_distillation_loss(h, w, th, tw, labels[:-1])
    with pytest.raises(ValueError, match="num_items is only valid with reduction='batchmean', got reduction='sum'"):
        ops.linear_distillation_loss(h, w, th, tw, labels, reduction="sum", num_items=3)
    with pytest.raises(ValueError, match="share one dtype"):
        ops.linear_distillation_loss(h, w.half(), th, tw)
