"""ops.linear_log_probs vs float64 log_softmax((hidden @ weight.T + bias) / T)[token]: values, entropy, gradients
for arbitrary upstream gradients on both, chunking, memory, errors."""

import pytest
import torch
from conftest import DEVICE
from reference import assert_close, grads64, log_probs_ref, recording_sizes

from leantune import ops


def _inputs(dtype, shape=(3, 7), hidden=40, vocab=230, bias=True, grads=(True, True, True), ignored=3):
    h = torch.randn(*shape, hidden, device=DEVICE).to(dtype).requires_grad_(grads[0])
    w = (torch.randn(vocab, hidden, device=DEVICE) * 0.4).to(dtype).requires_grad_(grads[1])
    b = torch.randn(vocab, device=DEVICE).to(dtype).requires_grad_(grads[2]) if bias else None
    tokens = torch.randint(0, vocab, shape, device=DEVICE)
    tokens.view(-1)[torch.randperm(tokens.numel(), device=DEVICE)[:ignored]] = -100
    return h, w, b, tokens


def _check(h, w, b, tokens, n_chunks=3, **kwargs):
    """Values, entropy and the gradients of sum(g * logp) for a random g, against float64."""
    rows, vocab = tokens.numel(), w.shape[0]
    itemsize = h.element_size()
    # forces about n_chunks token chunks forward and n_chunks vocab tiles backward
    chunk = max(-(-rows // n_chunks) * vocab, rows * -(-vocab // n_chunks)) * itemsize
    log_probs, entropy = ops.linear_log_probs(h, w, tokens, b, entropy=True, chunk_bytes=chunk, **kwargs)
    assert log_probs.dtype == entropy.dtype == torch.float32 and log_probs.shape == tokens.shape
    g, e = torch.randn_like(log_probs), torch.randn_like(entropy)  # upstream gradients of logp and H
    inputs = [h, w, b]
    wanted = [t for t in inputs if t is not None and t.requires_grad]
    ref, ref_entropy = log_probs_ref(h, w, tokens, b, **kwargs)
    ignored = tokens == -100
    assert (log_probs[ignored] == 0).all() and (entropy[ignored] == 0).all()
    assert_close("log_probs", log_probs, ref, torch.float32)
    assert_close("entropy", entropy, ref_entropy, torch.float32)
    if not wanted:
        return
    _, ref_grads = grads64(lambda a, c, d: log_probs_ref(a, c, tokens, d, **kwargs)[0], inputs, g)
    grads = torch.autograd.grad(log_probs, wanted, g, retain_graph=True)
    _, ref_both = grads64(lambda a, c, d: torch.stack(log_probs_ref(a, c, tokens, d, **kwargs)), inputs,
                          torch.stack([g, e]))
    both = torch.autograd.grad([log_probs, entropy], wanted, [g, e])  # an entropy bonus: through H too
    names = [n for n, t in zip(["dhidden", "dweight", "dbias"], inputs) if t is not None and t.requires_grad]
    for name, got, r, t in zip(names, grads, [x for x in ref_grads if x is not None], wanted):
        assert got.dtype == t.dtype and got.shape == t.shape
        assert_close(name, got, r, torch.float32)
    for name, got, r in zip(names, both, [x for x in ref_both if x is not None]):
        assert_close(f"{name} (logp and entropy)", got, r, torch.float32)


@pytest.mark.parametrize("options", [{}, {"temperature": 0.7}, {"temperature": 1.3, "softcap": 3.0}],
                         ids=["plain", "temperature", "temperature+softcap"])
def test_matches_reference_torch(monkeypatch, options):
    """Torch path: several token chunks and vocab tiles (none a multiple of a block), bias, [B, T] leading shape."""
    monkeypatch.setenv("LEANTUNE_BACKEND", "torch")
    h, w, b, tokens = _inputs(torch.float32, shape=(4, 9), vocab=230)
    _check(h, w, b, tokens, **options)


def test_matches_reference_triton(monkeypatch):
    """The kernels (interpreter on the CPU): temperature and softcap, 3 chunks, a vocab of 150 (two 128-blocks)."""
    monkeypatch.setenv("LEANTUNE_BACKEND", "triton")
    h, w, b, tokens = _inputs(torch.float32, shape=(2, 4), vocab=150, ignored=2)
    _check(h, w, b, tokens, temperature=1.3, softcap=3.0)


@pytest.mark.parametrize("grads", [(True, False, False), (False, True, True), (False, False, False)],
                         ids=["frozen-lm-head", "head-only", "no-grad"])
def test_gradients_only_where_wanted(monkeypatch, grads):
    """Frozen lm_head (LoRA: dhidden over token chunks), only the head trainable, and a reference model's no-grad
    call (nothing saved); the frozen head also through the kernels."""
    monkeypatch.setenv("LEANTUNE_BACKEND", "torch")
    h, w, b, tokens = _inputs(torch.float32, shape=(11,), vocab=140, grads=grads, bias=grads[1])
    _check(h, w, b, tokens, temperature=0.9)
    if grads == (True, False, False):
        monkeypatch.setenv("LEANTUNE_BACKEND", "triton")
        h, w, b, tokens = _inputs(torch.float32, shape=(7,), vocab=140, grads=grads, bias=False)
        _check(h, w, b, tokens, n_chunks=2, temperature=0.9)


def test_half_precision_within_eager_error(monkeypatch):
    """bf16 on the torch path: within the bf16 bar of the same formula run eagerly in bf16 (float64 truth)."""
    monkeypatch.setenv("LEANTUNE_BACKEND", "torch")
    h, w, b, tokens = _inputs(torch.bfloat16, shape=(40,), vocab=300, bias=False)
    log_probs = ops.linear_log_probs(h, w, tokens, temperature=0.8, chunk_bytes=13 * 300 * 2)
    g = torch.randn_like(log_probs)
    ref, (ref_h, ref_w) = grads64(lambda a, c: log_probs_ref(a, c, tokens, temperature=0.8)[0], [h, w], g)
    he, we = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    eager_lp = torch.log_softmax((he @ we.T) / 0.8, -1).gather(1, tokens.clamp(min=0)[:, None]).squeeze(1)
    eager_lp = torch.where(tokens != -100, eager_lp, 0.0)
    eager_h, eager_w = torch.autograd.grad(eager_lp, [he, we], g.to(eager_lp.dtype))
    grads = torch.autograd.grad(log_probs, [h, w], g)
    assert_close("log_probs", log_probs, ref, torch.bfloat16, eager_lp)
    assert_close("dhidden", grads[0], ref_h, torch.bfloat16, eager_h)
    assert_close("dweight", grads[1], ref_w, torch.bfloat16, eager_w)


def test_never_an_n_by_v_tensor(backend):
    """No output, leantune buffer or saved tensor holds N*V elements; forward and backward chunked."""
    rows, vocab, hidden = 24, 160, 20
    h, w, b, tokens = _inputs(torch.float32, shape=(rows,), hidden=hidden, vocab=vocab)
    saved = []


    hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: (saved.append(t.numel()), t)[1], lambda t: t)
    with recording_sizes() as sizes, hooks:
        log_probs = ops.linear_log_probs(h, w, tokens, b, temperature=0.5, chunk_bytes=rows * vocab)
        (log_probs * torch.randn_like(log_probs)).sum().backward()
    assert max(sizes) < rows * vocab and max(saved) < rows * vocab, (max(sizes), max(saved))


def test_empty_and_all_ignored(backend):
    h, w, b, tokens = _inputs(torch.float32, shape=(6,), vocab=50)
    tokens[:] = -100
    log_probs, entropy = ops.linear_log_probs(h, w, tokens, b, entropy=True)
    assert (log_probs == 0).all() and (entropy == 0).all()
    assert not torch.signbit(log_probs).any()  # 0.0, not -0.0 (the row loss negated)
    for g in torch.autograd.grad(log_probs.sum(), [h, w, b]):
        assert (g == 0).all()
    h, w, b, tokens = _inputs(torch.float32, shape=(0,), vocab=50, ignored=0)
    log_probs = ops.linear_log_probs(h, w, tokens, b)
    assert log_probs.shape == (0,)
    grads = torch.autograd.grad(log_probs.sum(), [h, w, b])
    assert all((g == 0).all() for g in grads) and grads[1].shape == w.shape


def test_error_cases(backend):
    h, w, b, tokens = _inputs(torch.float32, shape=(6,), vocab=30)
    with pytest.raises(ValueError, match=r"tokens must be in \[0, 30\)"):
        ops.linear_log_probs(h, w, torch.tensor([0, 1, 2, 3, 4, 30], device=DEVICE))
    with pytest.raises(ValueError, match="tokens must have shape"):
        ops.linear_log_probs(h, w, tokens[:-1])
    with pytest.raises(ValueError, match="tokens must be int64"):
        ops.linear_log_probs(h, w, tokens.int())
    with pytest.raises(ValueError, match=r"weight must be \[V, H\]"):
        ops.linear_log_probs(h, w[:, :-1], tokens)
    with pytest.raises(ValueError, match="bias must have shape"):
        ops.linear_log_probs(h, w, tokens, b[:-1])
    with pytest.raises(ValueError, match="share one dtype"):
        ops.linear_log_probs(h, w.to(torch.bfloat16), tokens)
    for bad in (0.0, -1.0, float("inf"), "1", 1e-320):
        with pytest.raises(ValueError, match="temperature must be"):
            ops.linear_log_probs(h, w, tokens, temperature=bad)
    with pytest.raises(ValueError, match="entropy must be a bool"):
        ops.linear_log_probs(h, w, tokens, entropy=1)
    with pytest.raises(ValueError, match="chunk_bytes must be a positive int"):
        ops.linear_log_probs(h, w, tokens, chunk_bytes=0)
    with pytest.raises(ValueError, match="softcap must be"):
        ops.linear_log_probs(h, w, tokens, softcap=0.0)
    ops.raise_deferred_errors()  # nothing pending from earlier tests
    bad = ops.linear_log_probs(h, w, torch.tensor([0, 1, 2, 3, 4, 30], device=DEVICE), checks="deferred")
    assert torch.isnan(bad).all()
    with pytest.raises(ValueError, match=r"tokens must be in \[0, 30\) .*found 30 .*the token was ignored"):
        ops.raise_deferred_errors()  # named as this op's argument, not "labels"


def test_under_autocast_matches_hf_lm_head(monkeypatch):
    """fp32 hidden and lm_head under bf16 autocast (TRL's GRPO under accelerate's autocast): the logits are rounded
    to bf16 as nn.Linear's would be; gradients come back in fp32. Against float64 with the bf16 bar, whose eager term
    is HF's lm_head under the same autocast (both round the same logits; their errors differ draw by draw)."""
    monkeypatch.setenv("LEANTUNE_BACKEND", "torch")
    h, w, b, tokens = _inputs(torch.float32, shape=(20,), vocab=120)
    lm_head = torch.nn.Linear(40, 120).to(DEVICE)
    with torch.no_grad():
        lm_head.weight.copy_(w)
        lm_head.bias.copy_(b)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        log_probs = ops.linear_log_probs(h, w, tokens, b, temperature=0.8, chunk_bytes=7 * 120 * 2)
        logits = lm_head(h)
    assert logits.dtype == torch.bfloat16
    eager = torch.log_softmax(logits.float() / 0.8, -1).gather(1, tokens.clamp(min=0)[:, None]).squeeze(1)
    eager = torch.where(tokens != -100, eager, 0.0)
    g = torch.randn_like(log_probs)
    ref, ref_grads = grads64(lambda x, c, d: log_probs_ref(x, c, tokens, d, temperature=0.8)[0], [h, w, b], g)
    assert_close("log_probs", log_probs, ref, torch.bfloat16, eager=eager)
    grads = torch.autograd.grad(log_probs, [h, w, b], g)
    eager_grads = torch.autograd.grad(eager, [h, lm_head.weight, lm_head.bias], g)
    for name, got, e, r in zip(["dhidden", "dweight", "dbias"], grads, eager_grads, ref_grads):
        assert got.dtype == torch.float32
        assert_close(name, got, r, torch.bfloat16, eager=e)
