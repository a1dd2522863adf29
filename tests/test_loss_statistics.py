"""ops.linear_cross_entropy(statistics=...): entropy, log sum p^2, mean logit and top-1 agreement of softmax(z), read
from the op's own logits chunks, against float64 formulas; the loss and gradients beside them are unchanged."""

import pytest
import torch
from conftest import DEVICE
from reference import assert_close

from leantune import ops

NAMES = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
N, H, V = 29, 40, 230  # V crosses the interpreter's 128-wide vocab blocks; none a multiple of a block


def _inputs(dtype, rows=N, vocab=V, ignored=4):
    h = torch.randn(rows, H, device=DEVICE).to(dtype).requires_grad_()
    w = (torch.randn(vocab, H, device=DEVICE) * 0.4).to(dtype).requires_grad_()
    b = torch.randn(vocab, device=DEVICE).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (rows,), device=DEVICE)
    with torch.no_grad():  # half the rows labelled with their argmax, so both outcomes of is_top1 occur
        top = (h.double() @ w.double().T + b.double()).argmax(-1)
    labels[::2] = top[::2]
    labels[torch.randperm(rows, device=DEVICE)[:ignored]] = -100
    return h, w, b, labels


def _reference(h, w, b, labels, softcap):
    """The statistics from their definitions, in float64 on the rounded logits the op multiplies out."""
    x = h.detach().double() @ w.detach().double().T + b.detach().double()
    z = x if softcap is None else softcap * torch.tanh(x / softcap)
    log_p = torch.log_softmax(z, -1)
    p = log_p.exp()
    return {"entropy": -(p * log_p).sum(-1), "log_sum_sq_probs": torch.logsumexp(2 * log_p, -1),
            "mean_logits": z.mean(-1), "is_top1": z.argmax(-1) == labels}, z


def _check_statistics(stats, ref, dtype):
    assert set(stats) == set(NAMES)
    for name in NAMES[:3]:
        assert stats[name].dtype == torch.float32 and stats[name].shape == (N,) and not stats[name].requires_grad
        assert_close(name, stats[name], ref[name], dtype)
    assert stats["is_top1"].dtype == torch.bool
    assert torch.equal(stats["is_top1"], ref["is_top1"])
    assert 0 < int(ref["is_top1"].sum()) < N  # both outcomes checked


@pytest.mark.parametrize("softcap", [None, 4.0])
@pytest.mark.parametrize("memory", ["fast", "low"])
def test_statistics_match_float64(backend, softcap, memory):
    """fp32, several token chunks: each statistic against its formula; loss and gradients bit-identical to the
    statistics-free call on the path it runs (the low one)."""
    h, w, b, labels = _inputs(torch.float32)
    chunk_bytes = 10 * V * 4  # 3 token chunks of 10, 10 and 9 rows
    loss, stats = ops.linear_cross_entropy(h, w, labels, b, memory=memory, softcap=softcap, chunk_bytes=chunk_bytes,
                                           statistics=NAMES)
    ref, _ = _reference(h, w, b, labels, softcap)
    _check_statistics(stats, ref, torch.float32)
    grads = torch.autograd.grad(loss, (h, w, b))
    plain = ops.linear_cross_entropy(h, w, labels, b, memory="low", softcap=softcap, chunk_bytes=chunk_bytes)
    assert torch.equal(loss, plain)
    for g, p in zip(grads, torch.autograd.grad(plain, (h, w, b))):
        assert torch.equal(g, p)


def test_statistics_bf16_and_reduction_none(monkeypatch):
    """bf16 inputs, per-row losses: the statistics from the bf16 logits chunk (fp32 inside), a subset requested."""
    monkeypatch.setenv("LEANTUNE_BACKEND", "torch")
    h, w, b, labels = _inputs(torch.bfloat16)
    loss, stats = ops.linear_cross_entropy(h, w, labels, b, reduction="none", statistics=["mean_logits", "entropy"])
    assert list(stats) == ["mean_logits", "entropy"] and loss.shape == (N,)
    # the reference from the op's own bf16 product, so only the fp32 reduction inside differs
    x = torch.addmm(b, h, w.T).detach().double()
    log_p = torch.log_softmax(x, -1)
    assert_close("entropy", stats["entropy"], -(log_p.exp() * log_p).sum(-1), torch.float32)
    assert_close("mean_logits", stats["mean_logits"], x.mean(-1), torch.float32)


def test_top1_takes_the_first_of_tied_maxima(backend):
    """Vocabulary rows 20/21 (one block) and 10/200 (two blocks of the interpreter's 128) give equal logits, the row
    maximum (small integers: every product and sum exact, whatever the summation order): argmax is the first of each
    pair, as torch.argmax."""
    h = torch.randint(-2, 3, (4, H), device=DEVICE).float()
    w = torch.randint(-1, 2, (V, H), device=DEVICE).float()
    h[1], h[3] = h[0], h[2]
    w[20] = w[21] = 4 * h[0]
    w[10] = w[200] = 4 * h[2]
    labels = torch.tensor([20, 21, 10, 200], device=DEVICE)
    _, stats = ops.linear_cross_entropy(h, w, labels, statistics=("is_top1",))
    assert stats["is_top1"].tolist() == [True, False, True, False]


def test_a_minus_inf_logit_adds_no_entropy(backend):
    """A token banned by a -inf bias has p = 0: its entropy term is the limit 0 (not 0 * -inf), the mean logit -inf."""
    h, w, b, labels = _inputs(torch.float32)
    with torch.no_grad():
        b[[5, 130]] = float("-inf")
    labels[labels == 5] = 6
    labels[labels == 130] = 6
    _, stats = ops.linear_cross_entropy(h, w, labels, b, statistics=NAMES)
    x = h.detach().double() @ w.detach().double().T + b.detach().double()
    p = torch.softmax(x, -1)
    assert_close("entropy", stats["entropy"], -torch.special.xlogy(p, p).sum(-1), torch.float32)
    assert_close("log_sum_sq_probs", stats["log_sum_sq_probs"], p.square().sum(-1).log(), torch.float32)
    assert torch.equal(stats["is_top1"], x.argmax(-1) == labels)
    assert bool((stats["mean_logits"] == float("-inf")).all())


def test_a_nan_logit_shows_in_the_statistics(backend):
    """A diverged row (a NaN logit) reads NaN, as TRL's own head reports it, not a plausible entropy."""
    h = torch.ones(2, 1, device=DEVICE)
    w = torch.zeros(V, 1, device=DEVICE)
    w[7] = float("nan")
    _, stats = ops.linear_cross_entropy(h, w, torch.tensor([7, 3], device=DEVICE), statistics=NAMES)
    for name in ("entropy", "log_sum_sq_probs", "mean_logits"):
        assert torch.isnan(stats[name]).all(), name


def test_no_rows_and_errors(backend):
    h, w, b, labels = _inputs(torch.float32)
    loss, stats = ops.linear_cross_entropy(h[:0], w, labels[:0], b, reduction="none", statistics=NAMES)
    assert loss.shape == (0,) and all(t.shape == (0,) for t in stats.values())
    with pytest.raises(ValueError, match="statistics must be a tuple of names"):
        ops.linear_cross_entropy(h, w, labels, b, statistics="entropy")
    with pytest.raises(ValueError, match="statistics must name only .* got 'accuracy'"):
        ops.linear_cross_entropy(h, w, labels, b, statistics=("entropy", "accuracy"))
