"""ops.linear_cross_entropy where rows x vocab exceeds 2^31 (int64 offsets), in bf16, against float64 (GPU).

The large cases hold 4.2-4.3e9 logits (Llama-3's vocabulary at 32k tokens, a 262k vocabulary at 16k tokens): they
run only on a CUDA GPU (marker ``gpu``; `pytest -m gpu` selects them). The small case runs the same check
everywhere, so the reference below is itself tested in CI. The float64 reference is written from the formula
loss = mean over labelled rows of (logsumexp(z) - z[label]), z = h W^T, dh = (softmax(z) - onehot(label)) W / count,
evaluated over row chunks so that it never holds all the logits. Bounds: bf16 logits and gradients
(docs/design.md, "Numerics"): loss within 1e-3 relative, dh within 2e-2 in relative Frobenius norm (measured on an
H200: 7e-8 and 1.2e-3); the small case in float32 within 1e-5 (docs/design.md, "Tests and tolerance").
"""

import pytest
import torch
from conftest import DEVICE, ON_GPU

from leantune import ops

LARGE = [(16384, 4096, 262144), (32768, 4096, 128256)]  # rows x V = 4.29e9, 4.20e9


def _reference(hidden, weight, labels, rows_per_chunk=1024):
    """(loss, d_hidden) in float64 from the formula, one chunk of rows at a time."""
    w = weight.double()
    valid = labels != -100
    count = int(valid.sum())
    loss = torch.zeros((), dtype=torch.float64, device=hidden.device)
    dh = torch.empty(hidden.shape, dtype=torch.float64, device=hidden.device)
    for start in range(0, hidden.shape[0], rows_per_chunk):
        h, y, keep = (t[start:start + rows_per_chunk] for t in (hidden, labels, valid))
        z = h.double() @ w.T
        lse = torch.logsumexp(z, dim=-1)
        picked = z.gather(1, y.clamp(min=0)[:, None])[:, 0]
        loss += ((lse - picked) * keep).sum()
        g = torch.softmax(z, dim=-1)
        g[torch.arange(len(y), device=z.device), y.clamp(min=0)] -= 1.0
        g *= keep[:, None] / count
        dh[start:start + rows_per_chunk] = g @ w
        del z, g
    return loss / count, dh


def _check(n, h, v, memory, dtype):
    torch.manual_seed(0)
    hidden = torch.randn(n, h, device=DEVICE).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, device=DEVICE) * h**-0.5).to(dtype)
    labels = torch.randint(0, v, (n,), device=DEVICE)
    labels[::7] = -100
    ref_loss, ref_dh = _reference(hidden.detach(), weight, labels)
    loss = ops.linear_cross_entropy(hidden, weight, labels, memory=memory)
    (dh,) = torch.autograd.grad(loss, [hidden])
    loss_err = abs(loss.double().item() - ref_loss.item()) / abs(ref_loss.item())
    dh_err = ((dh.double() - ref_dh).norm() / ref_dh.norm()).item()
    loss_tol, dh_tol = (1e-5, 1e-5) if dtype == torch.float32 else (1e-3, 2e-2)
    assert loss_err <= loss_tol and dh_err <= dh_tol, (n, h, v, memory, loss_err, dh_err)


@pytest.mark.parametrize("memory", ["fast", "low"])
def test_small_case_of_the_large_shape_check(memory):
    _check(67, 40, 1003, memory, torch.float32)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="4.2e9 logits: CUDA only")
@pytest.mark.parametrize("memory", ["fast", "low"])
@pytest.mark.parametrize("n, h, v", LARGE, ids=["V262144", "N32768"])
def test_rows_times_vocab_beyond_2_31(n, h, v, memory):
    _check(n, h, v, memory, torch.bfloat16)
