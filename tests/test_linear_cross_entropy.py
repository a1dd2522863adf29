"""ops.linear_cross_entropy vs float64 cross_entropy(hidden @ weight.T + bias): values, gradients, memory rules."""

import importlib
import itertools

import pytest
import torch
from conftest import DEVICE, ON_GPU
from reference import assert_close, grads64, linear_cross_entropy_ref, recording_sizes, rel_err, tolerance
from test_cross_entropy import _eager
from torch.utils._python_dispatch import TorchDispatchMode

from leantune import ops

OPTIONS = [{"label_smoothing": s, "softcap": c, "z_loss": z} for s, c, z in itertools.product([0.0, 0.1], [None, 4.0],
                                                                                          [0.0, 1e-2])]
REDUCTIONS = [("mean", None), ("mean", 41), ("sum", None), ("none", None)]
MEMORY = ["fast", "low"]
N, H, V = 29, 40, 230  # interpreter-sized; none a multiple of a block


def _inputs(dtype, rows=N, hidden=H, vocab=V, bias=True, grads=(True, True, True), ignored=4):
    h = torch.randn(rows, hidden, device=DEVICE).to(dtype).requires_grad_(grads[0])
    w = (torch.randn(vocab, hidden, device=DEVICE) * 0.4).to(dtype).requires_grad_(grads[1])
    b = (torch.randn(vocab, device=DEVICE)).to(dtype).requires_grad_(grads[2]) if bias else None
    labels = torch.randint(0, vocab, (rows,), device=DEVICE)
    labels[torch.randperm(rows, device=DEVICE)[:ignored]] = -100
    return h, w, b, labels


def _chunk_bytes(n_chunks, rows, vocab, dtype, memory):
    """A budget that forces about ``n_chunks`` token chunks (fast) or vocab tiles (low, with weight grads)."""
    itemsize = torch.finfo(dtype).bits // 8
    return (-(-rows // n_chunks) * vocab if memory == "fast" else rows * -(-vocab // n_chunks)) * itemsize


def _check(h, w, b, labels, memory, chunk_bytes=None, **kwargs):
    dtype = h.dtype
    loss = ops.linear_cross_entropy(h, w, labels, b, memory=memory, chunk_bytes=chunk_bytes, **kwargs)
    assert loss.dtype == torch.float32
    dy = torch.randn_like(loss)
    inputs = [h, w, b]
    wanted = [t for t in inputs if t is not None and t.requires_grad]
    ref, ref_grads = grads64(lambda a, c, d: linear_cross_entropy_ref(a, c, labels, d, **kwargs), inputs, dy)
    grads = torch.autograd.grad(loss, wanted, dy)
    ref_grads = [g for g in ref_grads if g is not None]
    names = [n for n, t in zip(["dhidden", "dweight", "dbias"], inputs) if t is not None and t.requires_grad]
    if dtype == torch.float32:
        assert_close("loss", loss, ref, dtype)
        for name, g, r, t in zip(names, grads, ref_grads, wanted):
            assert g.dtype == t.dtype and g.shape == t.shape
            assert_close(name, g, r, dtype)
        return
    # eager baseline in the low dtype: materialised logits, the same formula in that dtype
    leaves = [None if t is None else t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
    logits = leaves[0] @ leaves[1].T + (leaves[2] if b is not None else 0)
    eager = _eager(logits, labels, **kwargs)
    eager_grads = torch.autograd.grad(eager, [t for t in leaves if t is not None and t.requires_grad],
                                      dy.to(eager.dtype))
    assert_close("loss", loss, ref, dtype, eager)
    for name, g, r, e, t in zip(names, grads, ref_grads, eager_grads, wanted):
        assert g.dtype == t.dtype and g.shape == t.shape
        assert_close(name, g, r, dtype, e)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("memory", MEMORY)
@pytest.mark.parametrize("reduction,num_items", REDUCTIONS)
def test_matches_reference_torch_grid(monkeypatch, dtype, memory, reduction, num_items):
    """Every option combination on the torch path, several chunks, bias and trainable weight (tied embeddings)."""
    monkeypatch.setenv("LEANTUNE_BACKEND", "torch")
    for kwargs in OPTIONS:
        h, w, b, labels = _inputs(dtype)
        _check(h, w, b, labels, memory, _chunk_bytes(3, N, V, dtype, memory), reduction=reduction,
               num_items=num_items, **kwargs)


@pytest.mark.parametrize("memory", MEMORY)
def test_matches_reference_triton(monkeypatch, memory):
    """A representative subset through the kernels (interpreter on the CPU): 3 chunks, options x reductions."""
    monkeypatch.setenv("LEANTUNE_BACKEND", "triton")
    cases = [(torch.float32, OPTIONS[0], REDUCTIONS[0]), (torch.float32, OPTIONS[7], REDUCTIONS[3 if memory == "low"
                                                                                                 else 1]),
             (torch.float16, OPTIONS[5], REDUCTIONS[2])]
    for dtype, kwargs, (reduction, num_items) in cases:
        h, w, b, labels = _inputs(dtype, rows=21, vocab=150)
        _check(h, w, b, labels, memory, _chunk_bytes(3, 21, 150, dtype, memory), reduction=reduction,
               num_items=num_items, **kwargs)


@pytest.mark.parametrize("memory", MEMORY)
@pytest.mark.parametrize("grads", [(True, False, False), (False, True, True), (True, True, False)],
                         ids=["frozen-lm-head", "head-only", "no-bias-grad"])
def test_gradients_only_where_wanted(backend, memory, grads):
    """Frozen lm_head (LoRA), only the head trainable, bias frozen: each path still matches the reference."""
    h, w, b, labels = _inputs(torch.float32, rows=18, vocab=140, grads=grads)
    _check(h, w, b, labels, memory, _chunk_bytes(2, 18, 140, torch.float32, memory), reduction="sum",
           label_smoothing=0.1)


def test_no_grad_wanted_gives_the_loss(backend):
    h, w, b, labels = _inputs(torch.float32, grads=(False, False, False))
    for memory in MEMORY:
        loss = ops.linear_cross_entropy(h, w, labels, b, memory=memory, softcap=3.0)
        assert not loss.requires_grad
        assert_close("loss", loss, linear_cross_entropy_ref(h, w, labels, b, softcap=3.0), torch.float32)


@pytest.mark.parametrize("memory", MEMORY)
def test_never_an_n_by_v_tensor(backend, memory):
    """No op output, leantune buffer or saved tensor holds N*V elements (budget forces several chunks)."""
    rows, vocab, hidden = 24, 160, 20  # N*V = 3840 > V*H = 3200 > N*H
    h, w, b, labels = _inputs(torch.float32, rows=rows, hidden=hidden, vocab=vocab)
    saved = []


    def pack(t):
        saved.append(t.numel())
        return t

    chunk = _chunk_bytes(4, rows, vocab, torch.float32, memory)
    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
    with recording_sizes() as sizes, hooks:
        loss = ops.linear_cross_entropy(h, w, labels, b, memory=memory, chunk_bytes=chunk)
        loss.backward()
    assert max(sizes) < rows * vocab and max(saved) < rows * vocab, (max(sizes), max(saved))
    assert max(sizes) <= vocab * hidden  # nothing bigger than the weight gradient
    assert sizes.count(chunk // 4) >= 1  # the chunk buffer really was the budget's size
    assert_close("dweight", w.grad, grads64(lambda a, c, d: linear_cross_entropy_ref(a, c, labels, d), [h, w, b],
                                            torch.tensor(1.0))[1][1], torch.float32)


@pytest.mark.parametrize("memory", MEMORY)
def test_bf16_weight_gradient_over_many_chunks(memory):
    """dweight accumulated across 8 chunks in bf16 stays within the bf16 tolerance of float64
    (docs/design.md, "Tests and tolerance")."""
    h, w, b, labels = _inputs(torch.bfloat16, rows=64, hidden=32, vocab=96, ignored=0)
    _check(h, w, b, labels, memory, _chunk_bytes(8, 64, 96, torch.bfloat16, memory))


@pytest.mark.parametrize("memory", MEMORY)
def test_all_labels_ignored(backend, memory):
    h, w, b, labels = _inputs(torch.float32, rows=10, vocab=90)
    labels[:] = -100
    for reduction in ["mean", "sum", "none"]:
        loss = ops.linear_cross_entropy(h, w, labels, b, memory=memory, reduction=reduction, z_loss=1e-3)
        assert not loss.isnan().any() and (loss == 0).all()
        grads = torch.autograd.grad(loss.sum(), [h, w, b])
        for g in grads:
            assert not g.isnan().any() and (g == 0).all()


def test_no_rows(backend):
    h, w, b, labels = _inputs(torch.float32, rows=0, ignored=0)
    for memory in MEMORY:
        loss = ops.linear_cross_entropy(h, w, labels, b, memory=memory)
        assert loss.item() == 0.0
        grads = torch.autograd.grad(loss, [h, w, b])
        assert [tuple(g.shape) for g in grads] == [(0, H), (V, H), (V,)] and all((g == 0).all() for g in grads)


@pytest.mark.parametrize("memory", MEMORY)
def test_reduction_none_with_token_weights_and_grad_output(backend, memory):
    """Per-token weights after "none", and a scalar grad_output != 1 after "mean" (fast mode rescales in place)."""
    h, w, b, labels = _inputs(torch.float32, rows=16, vocab=100)
    weights = torch.rand(16, device=DEVICE) * 3
    loss = (ops.linear_cross_entropy(h, w, labels, b, memory=memory, reduction="none") * weights).sum()
    grads = torch.autograd.grad(loss, [h, w, b])
    ref, ref_grads = grads64(lambda a, c, d: (linear_cross_entropy_ref(a, c, labels, d, reduction="none")
                                              * weights.double()).sum(), [h, w, b], torch.tensor(1.0))
    assert_close("loss", loss, ref, torch.float32)
    for name, g, r in zip(["dhidden", "dweight", "dbias"], grads, ref_grads):
        assert_close(name, g, r, torch.float32)
    loss = ops.linear_cross_entropy(h, w, labels, b, memory=memory) * 2.5
    grads = torch.autograd.grad(loss, [h, w, b])
    _, ref_grads = grads64(lambda a, c, d: linear_cross_entropy_ref(a, c, labels, d), [h, w, b], torch.tensor(2.5))
    for name, g, r in zip(["dhidden", "dweight", "dbias"], grads, ref_grads):
        assert_close(name, g, r, torch.float32)


def test_fast_mode_refuses_a_second_backward(backend):
    h, w, b, labels = _inputs(torch.float32, rows=8, vocab=60)
    loss = ops.linear_cross_entropy(h, w, labels, b) * 2.0
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="supports one backward"):
        loss.backward()
    h.grad = None
    low = ops.linear_cross_entropy(h, w, labels, b, memory="low")
    low.backward(retain_graph=True)
    first = h.grad.clone()
    h.grad = None
    low.backward()
    assert torch.equal(h.grad, first)


@pytest.mark.parametrize("memory", MEMORY)
def test_gradient_accumulation_with_num_items(backend, memory):
    """Micro-batches with num_items = total valid tokens give the full-batch gradients; one is fully masked."""
    h, w, b, labels = _inputs(torch.float32, rows=24, vocab=80, ignored=3)
    labels[16:] = -100
    total = int((labels != -100).sum())
    full = ops.linear_cross_entropy(h, w, labels, b, memory=memory)
    full_grads = torch.autograd.grad(full, [h, w, b])
    w_acc, b_acc = w.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    h_grad, acc = torch.zeros_like(h), 0.0
    for part in (slice(0, 8), slice(8, 16), slice(16, 24)):
        piece = h.detach()[part].clone().requires_grad_()
        loss = ops.linear_cross_entropy(piece, w_acc, labels[part], b_acc, memory=memory, num_items=total)
        loss.backward()
        acc += loss.item()
        h_grad[part] = piece.grad
    assert abs(acc - full.item()) <= 1e-5 * abs(full.item())
    for name, g, r in zip(["dhidden", "dweight", "dbias"], [h_grad, w_acc.grad, b_acc.grad], full_grads):
        assert_close(name, g, r, torch.float32)


def test_under_autocast_matches_hf_lm_head(monkeypatch):
    """fp32 hidden and lm_head under bf16 autocast: logits rounded to bf16 as nn.Linear's, grads in fp32."""
    monkeypatch.setenv("LEANTUNE_BACKEND", "triton" if ON_GPU else "torch")
    h, w, b, labels = _inputs(torch.float32, rows=20, vocab=120)
    lm_head = torch.nn.Linear(H, 120).to(DEVICE)
    with torch.no_grad():
        lm_head.weight.copy_(w)
        lm_head.bias.copy_(b)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        loss = ops.linear_cross_entropy(h, w, labels, b, chunk_bytes=_chunk_bytes(3, 20, 120, torch.bfloat16,
                                                                                   "fast"))
        logits = lm_head(h)
    assert logits.dtype == torch.bfloat16
    ref = torch.nn.functional.cross_entropy(logits.float(), labels)
    assert abs(loss.item() - ref.item()) <= 1e-5 * abs(ref.item())
    grads = torch.autograd.grad(loss, [h, w, b])
    ref_grads = torch.autograd.grad(ref, [h, lm_head.weight, lm_head.bias])
    for name, g, r in zip(["dhidden", "dweight", "dbias"], grads, ref_grads):
        assert g.dtype == torch.float32
        assert_close(name, g, r, torch.bfloat16)


def test_strided_hidden(backend):
    base = torch.randn(12, 2 * H, device=DEVICE)
    h = base[:, ::2].requires_grad_()
    _, w, b, labels = _inputs(torch.float32, rows=12, vocab=70)
    for memory in MEMORY:
        _check(h, w, b, labels, memory)


def test_error_cases(backend):
    h, w, b, labels = _inputs(torch.float32, rows=6, vocab=30)
    with pytest.raises(ValueError, match=r"labels must be in \[0, 30\)"):
        ops.linear_cross_entropy(h, w, torch.tensor([0, 1, 2, 3, 4, 30], device=DEVICE))
    with pytest.raises(ValueError, match="hidden must be 2-D"):
        ops.linear_cross_entropy(h[None], w, labels)
    with pytest.raises(ValueError, match=r"weight must be \[V, H\]"):
        ops.linear_cross_entropy(h, w[:, :-1], labels)
    with pytest.raises(ValueError, match=r"weight must be \[V, H\]"):
        ops.linear_cross_entropy(h, w[:0], labels)
    with pytest.raises(ValueError, match="bias must have shape"):
        ops.linear_cross_entropy(h, w, labels, b[:-1])
    with pytest.raises(ValueError, match="labels must have shape"):
        ops.linear_cross_entropy(h, w, labels[:-1])
    with pytest.raises(ValueError, match="labels must be int64"):
        ops.linear_cross_entropy(h, w, labels.int())
    with pytest.raises(ValueError, match="share one dtype"):
        ops.linear_cross_entropy(h, w.to(torch.bfloat16), labels)
    with pytest.raises(ValueError, match="share one dtype"):
        ops.linear_cross_entropy(h, w, labels, b.to(torch.float16))
    with pytest.raises(ValueError, match="hidden must be float32"):
        ops.linear_cross_entropy(h.double(), w, labels)
    with pytest.raises(ValueError, match="memory must be one of"):
        ops.linear_cross_entropy(h, w, labels, memory="medium")
    with pytest.raises(ValueError, match="chunk_bytes must be a positive int"):
        ops.linear_cross_entropy(h, w, labels, chunk_bytes=0)
    with pytest.raises(ValueError, match="chunk_bytes must be a positive int"):
        ops.linear_cross_entropy(h, w, labels, chunk_bytes=1.5e6)
    with pytest.raises(ValueError, match="num_items is only valid"):
        ops.linear_cross_entropy(h, w, labels, reduction="none", num_items=4)
    with pytest.raises(ValueError, match="num_items must be >= 0"):
        ops.linear_cross_entropy(h, w, labels, num_items=torch.tensor(-2))
    with pytest.raises(ValueError, match="softcap must be None or a finite number > 0"):
        ops.linear_cross_entropy(h, w, labels, softcap=-1.0)
    if DEVICE == "cpu":
        with pytest.raises(ValueError, match="one device"):
            ops.linear_cross_entropy(h, w.to("meta"), labels)


def test_chunk_length_rounds_to_gemm_tiles():
    from leantune.ops.linear_cross_entropy import chunk_length

    assert chunk_length(128 * 2**20, 128256 * 2, 16384) == 512  # Llama-3 default: 523 rows -> 512
    assert chunk_length(32 * 2**20, 16384 * 2, 128256) == 1024  # low mode vocab tiles: already a multiple
    assert chunk_length(5000, 10, 1000) == 384  # 500 -> 384
    assert chunk_length(2000, 10, 1000) == 200  # under two granules: kept
    assert chunk_length(10**9, 10, 1000) == 1000  # everything in one chunk: never rounded below the total
    assert chunk_length(1, 10, 5) == 1  # at least one row


def test_rounded_chunks_match_reference(monkeypatch):
    """Chunks of 256 rows (a 300-row budget rounded down) and a 188-row tail, torch path in fp32."""
    monkeypatch.setenv("LEANTUNE_BACKEND", "torch")
    lce = importlib.import_module("leantune.ops.linear_cross_entropy")  # the package exports a function of that name
    seen = []
    original = lce._logits_into
    monkeypatch.setattr(lce, "_logits_into",
                        lambda out, h, *rest: (seen.append(h.shape[0]), original(out, h, *rest))[1])
    h, w, b, labels = _inputs(torch.float32, rows=700, hidden=16, vocab=64)
    _check(h, w, b, labels, "fast", chunk_bytes=300 * 64 * 4)
    assert seen == [256, 256, 188]


def _dweight_errors(h, w, labels, **kwargs):
    """(fast path's dweight error, eager bf16's dweight error), both relative to float64."""
    loss = ops.linear_cross_entropy(h, w, labels, memory="fast", **kwargs)
    (dweight,) = torch.autograd.grad(loss, [w])
    _, (_, ref) = grads64(lambda a, c: linear_cross_entropy_ref(a, c, labels), [h, w], torch.tensor(1.0))
    h_e, w_e = h.detach().clone(), w.detach().clone().requires_grad_()
    (eager,) = torch.autograd.grad(_eager(h_e @ w_e.T, labels), [w_e])
    return rel_err(dweight, ref), rel_err(eager, ref)


def test_bf16_weight_gradient_does_not_grow_with_chunk_count(backend):
    """memory="fast" sums one dweight product per token chunk; in bf16 that sum rounded once per chunk, its error
    growing with the chunk count (3e-2 against eager bf16's 2e-3 here, 1-row chunks). It is summed in fp32 and
    cast once: within the bf16 bar (eager error + 1e-2) at any chunk count, and no worse than twice the eager error."""
    rows, hidden, vocab = (1024, 16, 24) if backend == "triton" and not ON_GPU else (2048, 16, 24)
    h, w, _, labels = _inputs(torch.bfloat16, rows=rows, hidden=hidden, vocab=vocab, bias=False, ignored=0)
    err, eager_err = _dweight_errors(h, w, labels, chunk_bytes=vocab * 2)  # one row per chunk
    assert err <= tolerance(torch.bfloat16, eager_err), f"dweight error {err:.3g}, eager {eager_err:.3g}"
    assert err <= 2 * eager_err, f"dweight error {err:.3g} against eager bf16's {eager_err:.3g}"


@pytest.mark.skipif(not ON_GPU, reason="Llama-3 vocabulary size: GPU only")
def test_bf16_weight_gradient_at_llama3_vocabulary():
    """The fp32 dweight sum on the card (cuBLAS's fp32-output GEMM) at V = 128256, H = 1024, 8192 tokens in 256-row
    chunks: within the bf16 bar and no worse than twice eager bf16's error (the bf16 sum measured 3x)."""
    rows, hidden, vocab = 8192, 1024, 128256
    h, w, _, labels = _inputs(torch.bfloat16, rows=rows, hidden=hidden, vocab=vocab, bias=False, ignored=0)
    err, eager_err = _dweight_errors(h, w, labels, chunk_bytes=256 * vocab * 2)
    assert err <= tolerance(torch.bfloat16, eager_err), f"dweight error {err:.3g}, eager {eager_err:.3g}"
    assert err <= 2 * eager_err, f"dweight error {err:.3g} against eager bf16's {eager_err:.3g}"


def _fresh_storages_of_size(fn, numel, inputs):
    """The number of distinct storages of at least ``numel`` elements, other than those of ``inputs`` (views such
    as weight.t()), that the ops inside ``fn`` return."""
    storages = set()

    class RecordStorages(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and t.numel() >= numel:
                    storages.add(t.untyped_storage().data_ptr())
            return out

    with RecordStorages():
        fn()
    return len(storages - {t.untyped_storage().data_ptr() for t in inputs})


def test_torch_path_forms_the_gradient_inside_its_logits_chunk(monkeypatch):
    """CPU rule (docs/design.md, "Backends"): the fused loss's torch path turns each logits chunk into its softmax and
    gradient in place, so no other tensor of a chunk's size is ever formed; values as the float64 reference."""
    monkeypatch.setenv("LEANTUNE_BACKEND", "torch")
    rows, vocab, hidden = 40, 300, 24
    h, w, b, labels = _inputs(torch.float32, rows=rows, hidden=hidden, vocab=vocab, grads=(True, False, False))
    chunk = _chunk_bytes(2, rows, vocab, torch.float32, "fast")
    chunk_rows = chunk // (4 * vocab)

    def step():
        ops.linear_cross_entropy(h, w, labels, b, memory="fast", chunk_bytes=chunk, label_smoothing=0.1,
                                 z_loss=1e-3).backward()

    assert _fresh_storages_of_size(step, chunk_rows * vocab, [h, w, b]) == 1  # the chunk buffer alone
    ref = grads64(lambda a: linear_cross_entropy_ref(a, w, labels, b, label_smoothing=0.1, z_loss=1e-3), [h],
                  torch.tensor(1.0))[1][0]
    assert_close("dhidden", h.grad, ref, torch.float32)
