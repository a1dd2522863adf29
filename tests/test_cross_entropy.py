"""ops.cross_entropy vs the float64 formula of docs/design.md ("Public op contract"), its edge cases (public bug
reports) and its input errors."""

import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICE, ON_GPU
from reference import assert_close, cross_entropy_ref, grads64, rel_err

from leantune import ops
from leantune.ops.cross_entropy import vocab_block

# The interpreter costs ~1 ms per program (and per chunk iteration): tiny shapes there; the torch path takes the grid.
SMALL = not ON_GPU
OPTIONS = [  # (label_smoothing, softcap, z_loss)
    {"label_smoothing": s, "softcap": c, "z_loss": z}
    for s, c, z in itertools.product([0.0, 0.1], [None, 4.0], [0.0, 1e-2])
]
TRITON_OPTIONS = [OPTIONS[0], OPTIONS[3], OPTIONS[5], OPTIONS[7]]  # plain, softcap, smoothing + z-loss, all three
REDUCTIONS = [("mean", None), ("mean", 57), ("sum", None), ("none", None)]


def _low(backend):
    """bf16 where the comparison is meaningful; the interpreter truncates bf16 stores, so it uses fp16 (docs/design.md,
    "Backends")."""
    return torch.float16 if backend == "triton" and not ON_GPU else torch.bfloat16


def _inputs(rows, vocab, dtype, ignored=3, scale=3.0):
    logits = (torch.randn(rows, vocab, device=DEVICE) * scale).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (rows,), device=DEVICE)
    labels[torch.randperm(rows, device=DEVICE)[: min(ignored, rows)]] = -100
    return logits, labels


def _eager(logits, labels, label_smoothing=0.0, softcap=None, z_loss=0.0, reduction="mean", num_items=None):
    """The same formula run eagerly in the input's low-precision dtype (the bar for half-precision tolerance)."""
    z = logits if softcap is None else softcap * torch.tanh(logits / softcap)
    lse = torch.logsumexp(z, -1)
    valid = labels != -100
    target = torch.where(valid, labels, 0)
    loss = lse - z.gather(-1, target[:, None]).squeeze(-1)
    if label_smoothing:
        loss = (1 - label_smoothing) * loss + label_smoothing * (lse - z.mean(-1))
    if z_loss:
        loss = loss + z_loss * lse * lse
    loss = torch.where(valid, loss, torch.zeros_like(loss))
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / (num_items if num_items is not None else max(int(valid.sum()), 1))


def _check(logits, labels, **kwargs):
    dtype = logits.dtype
    loss = ops.cross_entropy(logits, labels, **kwargs)
    assert loss.dtype == torch.float32
    assert loss.shape == ((logits.shape[0],) if kwargs.get("reduction") == "none" else ())
    dy = torch.randn_like(loss)
    ref, (ref_grad,) = grads64(lambda z: cross_entropy_ref(z, labels, **kwargs), [logits], dy)
    (grad,) = torch.autograd.grad(loss, [logits], dy)
    assert grad.dtype == dtype and grad.shape == logits.shape
    if dtype == torch.float32:
        assert_close("loss", loss, ref, dtype)
        assert_close("dlogits", grad, ref_grad, dtype)
    else:
        eager_in = logits.detach().clone().requires_grad_()
        eager = _eager(eager_in, labels, **kwargs)
        (eager_grad,) = torch.autograd.grad(eager, [eager_in], dy.to(eager.dtype))
        assert_close("loss", loss, ref, dtype, eager)
        assert_close("dlogits", grad, ref_grad, dtype, eager_grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("reduction,num_items", REDUCTIONS)
def test_matches_reference_torch_grid(monkeypatch, dtype, reduction, num_items):
    """Every option combination on the torch path; V not a multiple of anything, some ignored rows."""
    monkeypatch.setenv("LEANTUNE_BACKEND", "torch")
    for kwargs in OPTIONS:
        logits, labels = _inputs(21, 503, dtype)
        _check(logits, labels, reduction=reduction, num_items=num_items, **kwargs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_matches_reference_triton(monkeypatch, dtype):
    """A representative subset through the kernels: V spans 3 vocab chunks, the last one partial; each option set
    meets each reduction once."""
    monkeypatch.setenv("LEANTUNE_BACKEND", "triton")
    vocab = 300 if SMALL else 50000
    assert vocab % vocab_block(torch.device(DEVICE), vocab) != 0
    shift = 0 if dtype == torch.float32 else 1
    for i, kwargs in enumerate(TRITON_OPTIONS):
        reduction, num_items = REDUCTIONS[(i + shift) % len(REDUCTIONS)]
        logits, labels = _inputs(17, vocab, dtype)
        _check(logits, labels, reduction=reduction, num_items=num_items, **kwargs)


def test_num_items_as_tensor_and_strided_logits(backend):
    base = torch.randn(12, 2 * 150, device=DEVICE)
    logits = base[:, ::2].requires_grad_()  # last dim strided: copied, not misread
    labels = torch.randint(0, 150, (12,), device=DEVICE)
    _check(logits, labels, num_items=torch.tensor(40, device=DEVICE))
    _check(logits, labels, num_items=torch.tensor(40))  # a CPU scalar (HF's num_items_in_batch may be one)


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_label_alone_in_a_chunk_with_minus_inf_elsewhere(backend, where):
    """Only the label's logit is finite (others -inf): loss exactly 0, gradient 0, never NaN; across chunk borders."""
    vocab = 3 * vocab_block(torch.device(DEVICE), 10**9) + 37  # last chunk partial
    block = vocab_block(torch.device(DEVICE), vocab)
    col = {"first": 5, "middle": block + 17, "last": vocab - 1}[where]
    logits = torch.full((2, vocab), float("-inf"), device=DEVICE)
    logits[:, col] = torch.tensor([2.5, -7.0])
    labels = torch.full((2,), col, device=DEVICE)
    logits.requires_grad_()
    for reduction in ["mean", "none"]:
        loss = ops.cross_entropy(logits, labels, reduction=reduction)
        assert torch.isfinite(loss).all() and (loss == 0).all(), loss
        (grad,) = torch.autograd.grad(loss.sum(), [logits])
        assert not grad.isnan().any() and (grad == 0).all()


@pytest.mark.filterwarnings("ignore:invalid value encountered")  # the interpreter's numpy on inf - inf
def test_plus_inf_logit_gives_nan_as_torch_does(backend):
    """A +inf logit makes the row's loss NaN on both backends, as F.cross_entropy (inf - inf), never a finite-looking
    inf; other rows are unaffected."""
    logits = torch.randn(3, 40, device=DEVICE)
    logits[0, 7] = float("inf")  # at the label
    logits[1, 30] = float("inf")  # elsewhere
    labels = torch.tensor([7, 3, 5], device=DEVICE)
    expected = F.cross_entropy(logits.double(), labels, reduction="none")
    loss = ops.cross_entropy(logits, labels, reduction="none")
    assert expected[:2].isnan().all() and loss[:2].isnan().all(), loss
    torch.testing.assert_close(loss[2].double(), expected[2], rtol=1e-5, atol=1e-6)


def test_large_vocab_with_softcap(monkeypatch):
    """V = 65537 (one past a power of two) with Gemma-2's softcap 30: padding lanes add no mass. Torch path only on
    the CPU (513 interpreter chunks a row); the kernel's padding is checked by
    test_softcap_padding_lanes_do_not_leak."""
    monkeypatch.setenv("LEANTUNE_BACKEND", "triton" if ON_GPU else "torch")
    logits, labels = _inputs(4, 65537, torch.float32, ignored=0, scale=20.0)
    _check(logits, labels, softcap=30.0)
    _check(logits, labels, softcap=30.0, reduction="none", label_smoothing=0.1)


def test_softcap_padding_lanes_do_not_leak(backend):
    """A row of -inf except the label: with softcap every real lane is -c, so lse = log(exp(c') + (V-1) exp(-c))."""
    vocab = 2 * vocab_block(torch.device(DEVICE), 10**9) - 50  # partial last chunk with many padding lanes
    logits = torch.full((1, vocab), float("-inf"), device=DEVICE)
    logits[0, 3] = 1.0
    labels = torch.tensor([3], device=DEVICE)
    c = 2.0
    loss = ops.cross_entropy(logits, labels, softcap=c)
    z_y = c * math.tanh(1.0 / c)
    expected = math.log(math.exp(z_y) + (vocab - 1) * math.exp(-c)) - z_y
    assert abs(loss.item() - expected) <= 1e-5 * expected


@pytest.mark.parametrize("reduction,num_items", REDUCTIONS)
def test_all_labels_ignored(backend, reduction, num_items):
    logits = torch.randn(9, 130, device=DEVICE, requires_grad=True)
    labels = torch.full((9,), -100, device=DEVICE)
    loss = ops.cross_entropy(logits, labels, reduction=reduction, num_items=num_items, label_smoothing=0.1,
                             z_loss=1e-3)
    assert not loss.isnan().any() and (loss == 0).all()
    (grad,) = torch.autograd.grad(loss.sum(), [logits])
    assert not grad.isnan().any() and (grad == 0).all()


def test_no_rows(backend):
    logits = torch.randn(0, 50, device=DEVICE, requires_grad=True)
    labels = torch.zeros(0, dtype=torch.long, device=DEVICE)
    loss = ops.cross_entropy(logits, labels)
    assert loss.item() == 0.0
    loss.backward()
    assert logits.grad.shape == (0, 50)


def test_reduction_none_with_token_weights(backend):
    """Per-token weights applied to the [N] loss afterwards: the gradient follows grad_output row by row."""
    logits, labels = _inputs(11, 140, torch.float32)
    weights = torch.rand(11, device=DEVICE) * 3
    loss = (ops.cross_entropy(logits, labels, reduction="none") * weights).sum()
    (grad,) = torch.autograd.grad(loss, [logits])
    ref, (ref_grad,) = grads64(lambda z: (cross_entropy_ref(z, labels, reduction="none") * weights.double()).sum(),
                               [logits], torch.tensor(1.0))
    assert_close("loss", loss, ref, torch.float32)
    assert_close("dlogits", grad, ref_grad, torch.float32)


def test_z_loss_off_is_plain_cross_entropy(backend):
    logits, labels = _inputs(13, 120, torch.float32)
    plain = ops.cross_entropy(logits, labels)
    off = ops.cross_entropy(logits, labels, z_loss=0.0)
    assert torch.equal(plain, off)
    torch_loss = F.cross_entropy(logits, labels)
    assert abs(plain.item() - torch_loss.item()) <= 1e-6 * abs(torch_loss.item())
    g_plain, g_off = (torch.autograd.grad(ops.cross_entropy(logits, labels, z_loss=z), [logits])[0] for z in (0.0, 0.0))
    assert torch.equal(g_plain, g_off)
    on = ops.cross_entropy(logits, labels, z_loss=1e-2)
    assert on.item() > plain.item()  # the z-loss term is really there


def test_gradient_accumulation_with_num_items(backend):
    """Micro-batches with num_items = total valid tokens sum to the full batch; one micro-batch is fully masked."""
    logits, labels = _inputs(24, 110, torch.float32, ignored=5)
    labels[16:] = -100  # the third micro-batch has no valid token
    total = int((labels != -100).sum())
    full = ops.cross_entropy(logits, labels)
    (full_grad,) = torch.autograd.grad(full, [logits])
    acc_loss, acc_grad = 0.0, torch.zeros_like(logits)
    for part in (slice(0, 8), slice(8, 16), slice(16, 24)):
        piece = logits.detach()[part].clone().requires_grad_()
        loss = ops.cross_entropy(piece, labels[part], num_items=total)
        loss.backward()
        assert not piece.grad.isnan().any()
        acc_loss += loss.item()
        acc_grad[part] = piece.grad
    assert abs(acc_loss - full.item()) <= 1e-5 * abs(full.item())
    assert_close("accumulated grad", acc_grad, full_grad, torch.float32)


def test_requires_grad_false_and_caller_logits_untouched(backend):
    logits, labels = _inputs(10, 150, torch.float32)
    frozen = logits.detach().clone()
    loss = ops.cross_entropy(frozen, labels)  # no grad wanted at all
    assert not loss.requires_grad
    assert_close("loss", loss, cross_entropy_ref(frozen, labels), torch.float32)
    before = logits.detach().clone()
    ops.cross_entropy(logits, labels, softcap=3.0, label_smoothing=0.1).backward()
    assert torch.equal(logits.detach(), before), "the caller's logits were overwritten"
    assert logits.grad is not None and logits.grad.abs().sum() > 0


def test_confident_prediction_keeps_true_class_gradient(backend):
    """p_y ~ 0.999: p - 1 = -1e-3 must survive in half precision (formed in fp32, scaled, then cast)."""
    dtype = _low(backend)
    vocab = 200
    logits = torch.zeros(4, vocab, device=DEVICE)
    labels = torch.tensor([0, 50, 130, 199], device=DEVICE)
    logits[torch.arange(4), labels] = math.log(999 * (vocab - 1))  # p_y = 0.999 exactly in exact arithmetic
    logits = logits.to(dtype).requires_grad_()
    (grad,) = torch.autograd.grad(ops.cross_entropy(logits, labels, reduction="sum"), [logits])
    _, (ref_grad,) = grads64(lambda z: cross_entropy_ref(z, labels, reduction="sum"), [logits], torch.tensor(1.0))
    true_class = grad[torch.arange(4), labels].float()
    expected = ref_grad[torch.arange(4), labels]
    assert (true_class < 0).all(), true_class
    assert ((true_class.double() - expected).abs() <= 0.01 * expected.abs()).all(), (true_class, expected)


@pytest.mark.parametrize("option, value, match", [
    ("softcap", float("inf"), "softcap must be None or a finite number > 0"),
    ("softcap", "30", "softcap must be None or a finite number > 0"),
    ("softcap", True, "softcap must be None or a finite number > 0"),
    ("softcap", 10**400, "softcap must be None or a finite number > 0"),
    ("label_smoothing", "0.1", "label_smoothing must be a real number"),
    ("label_smoothing", None, "label_smoothing must be a real number"),
    ("z_loss", float("nan"), "z_loss must be finite"),
    ("z_loss", 10**400, "z_loss must be finite"),
    ("ignore_index", 2**70, "ignore_index must fit in int64"),
    ("num_items", torch.tensor(float("nan")), "num_items must be >= 0, finite, whole and < 2\\^63"),
    ("num_items", torch.tensor(float("inf")), "num_items must be >= 0, finite, whole and < 2\\^63"),
    ("num_items", torch.tensor(2.5), "num_items must be >= 0, finite, whole and < 2\\^63"),
    ("num_items", torch.tensor(1e30), "num_items must be >= 0, finite, whole and < 2\\^63"),
    ("num_items", torch.tensor(-1), "num_items must be >= 0, finite, whole and < 2\\^63"),
    ("num_items", torch.tensor(3, device="meta"), "num_items must be on labels' device"),
    ("num_items", 10**400, "num_items must be < 2\\^63"),
])
def test_option_errors_name_the_option(option, value, match):
    """Non-finite or mistyped options once gave NaN losses or raw TypeErrors."""
    logits = torch.randn(4, 10, device=DEVICE)
    labels = torch.tensor([1, 2, 3, -100], device=DEVICE)
    if isinstance(value, torch.Tensor) and value.device.type != "meta":
        value = value.to(DEVICE)
    for op, args in ((ops.cross_entropy, (logits, labels)),
                     (ops.linear_cross_entropy, (logits, torch.randn(7, 10, device=DEVICE), labels))):
        with pytest.raises(ValueError, match=match):
            op(*args, **{option: value})


def test_error_cases(backend):
    logits = torch.randn(4, 10, device=DEVICE)
    labels = torch.tensor([1, 2, 3, -100], device=DEVICE)
    with pytest.raises(ValueError, match=r"labels must be in \[0, 10\)"):
        ops.cross_entropy(logits, torch.tensor([1, 2, 10, 0], device=DEVICE))
    with pytest.raises(ValueError, match=r"labels must be in \[0, 10\)"):
        ops.cross_entropy(logits, torch.tensor([1, -1, 0, 0], device=DEVICE))
    with pytest.raises(ValueError, match="labels must be in"):
        ops.cross_entropy(logits, torch.tensor([1, -100, 0, 0], device=DEVICE), ignore_index=-1)
    with pytest.raises(ValueError, match="labels must be int64"):
        ops.cross_entropy(logits, labels.int())
    with pytest.raises(ValueError, match="labels must have shape"):
        ops.cross_entropy(logits, labels[:3])
    with pytest.raises(ValueError, match="logits must be 2-D"):
        ops.cross_entropy(logits[None], labels)
    with pytest.raises(ValueError, match="logits must be float32"):
        ops.cross_entropy(logits.double(), labels)
    with pytest.raises(ValueError, match="reduction must be one of"):
        ops.cross_entropy(logits, labels, reduction="avg")
    with pytest.raises(ValueError, match="num_items is only valid with reduction='mean'"):
        ops.cross_entropy(logits, labels, reduction="sum", num_items=3)
    with pytest.raises(ValueError, match="num_items is 0 but"):
        ops.cross_entropy(logits, labels, num_items=0)
    with pytest.raises(ValueError, match="num_items is 0 but"):
        ops.cross_entropy(logits, labels, num_items=torch.tensor(0))
    with pytest.raises(ValueError, match="num_items must be >= 0"):
        ops.cross_entropy(logits, labels, num_items=-2)
    with pytest.raises(ValueError, match="num_items must be an int or a 0-dim"):
        ops.cross_entropy(logits, labels, num_items=torch.tensor([3]))
    with pytest.raises(ValueError, match="num_items must be an int or a 0-dim"):
        ops.cross_entropy(logits, labels, num_items=2.5)
    with pytest.raises(ValueError, match="label_smoothing must be in"):
        ops.cross_entropy(logits, labels, label_smoothing=1.5)
    with pytest.raises(ValueError, match="softcap must be None or a finite number > 0"):
        ops.cross_entropy(logits, labels, softcap=0.0)
    with pytest.raises(ValueError, match="z_loss must be >= 0"):
        ops.cross_entropy(logits, labels, z_loss=-1.0)
    with pytest.raises(ValueError, match="non-empty vocabulary"):
        ops.cross_entropy(logits[:, :0], labels)
    if DEVICE == "cpu":
        with pytest.raises(ValueError, match="one device"):
            ops.cross_entropy(logits, labels.to("meta"))


def test_label_check_is_exact_at_the_boundary(backend):
    """V - 1 is a valid label and an ignore_index inside [0, V) is allowed (torch allows it)."""
    logits = torch.randn(3, 10, device=DEVICE)
    labels = torch.tensor([9, 0, 4], device=DEVICE)
    assert_close("loss", ops.cross_entropy(logits, labels), cross_entropy_ref(logits, labels), torch.float32)
    loss = ops.cross_entropy(logits, labels, ignore_index=4)
    ref = cross_entropy_ref(logits, labels, ignore_index=4)
    assert rel_err(loss, ref) <= 1e-5
    far = torch.tensor([2**62, 3, 2**62], device=DEVICE)  # an ignore_index far outside [0, V): ignored, not checked
    loss = ops.cross_entropy(logits, far, ignore_index=2**62)
    assert_close("loss", loss, cross_entropy_ref(logits[1:2], far[1:2]), torch.float32)
    with pytest.raises(ValueError, match=r"labels must be in \[0, 10\)"):
        ops.cross_entropy(logits, far)


@pytest.mark.parametrize("value", [torch.tensor(-1.0), torch.tensor(float("nan")), torch.tensor(2.5)])
def test_num_items_tensor_is_checked_without_rows(backend, value):
    """With N = 0 the label check has nothing to read; num_items' check must still run (NaN or -0.0 came back
    instead of the ValueError). A 0 there is a window without targets and gives 0.0 (tested below)."""
    labels = torch.empty(0, dtype=torch.int64, device=DEVICE)
    for op, args in ((ops.cross_entropy, (torch.randn(0, 5, device=DEVICE), labels)),
                     (ops.linear_cross_entropy, (torch.randn(0, 4, device=DEVICE), torch.randn(5, 4, device=DEVICE),
                                                 labels))):
        with pytest.raises(ValueError, match="num_items must be >= 0"):
            op(*args, num_items=value.to(DEVICE))
        assert op(*args, num_items=torch.tensor(3, device=DEVICE)).item() == 0.0


def test_label_error_names_the_bad_label(backend):
    logits = torch.randn(3, 10, device=DEVICE)
    with pytest.raises(ValueError, match=r"labels must be in \[0, 10\) or equal ignore_index=-100; found 97"):
        ops.cross_entropy(logits, torch.tensor([1, 97, 2], device=DEVICE))
    with pytest.raises(ValueError, match="found -3"):
        ops.cross_entropy(logits, torch.tensor([1, -3, 12], device=DEVICE))


@pytest.mark.parametrize("options", [{}, {"softcap": 30.0}, {"z_loss": 1e-3, "label_smoothing": 0.1}])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ignored_row_with_huge_logits_has_zero_gradient(backend, options, dtype):
    """An ignored row's gradient was once exp(z - 0) * 0, NaN once a logit exceeded ~88.7 (fp32
    exp overflow); after HF's shift every sequence's last position is ignored, so this poisoned whole steps."""
    logits = torch.randn(3, 11, device=DEVICE)
    logits[0, 3], logits[2, 5] = 89.0, 1e4
    logits = logits.to(dtype).requires_grad_()
    labels = torch.tensor([-100, 2, -100], device=DEVICE)
    loss = ops.cross_entropy(logits, labels, **options)
    loss.backward()
    assert torch.equal(logits.grad[0::2], torch.zeros_like(logits.grad[0::2]))
    ref_logits = logits.detach()[1:2].clone().requires_grad_()
    ref = ops.cross_entropy(ref_logits, labels[1:2], **options)
    ref.backward()
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # the same row in a 1-row batch: reduction order may differ
    assert rel_err(loss, ref) <= 1e-5 and rel_err(logits.grad[1:2], ref_logits.grad) <= tol


@pytest.mark.parametrize("memory", ["fast", "low"])
def test_linear_ce_ignored_row_with_huge_logits_keeps_weight_grad_finite(backend, memory):
    hidden = torch.tensor([[10.0, 0.0], [0.1, 0.2]], device=DEVICE, requires_grad=True)
    weight = torch.tensor([[10.0, 0.0], [0.0, 1.0], [1.0, 1.0]], device=DEVICE, requires_grad=True)
    ops.linear_cross_entropy(hidden, weight, torch.tensor([-100, 1], device=DEVICE), memory=memory).backward()
    h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    torch.nn.functional.cross_entropy(h64[1:] @ w64.T, torch.tensor([1], device=DEVICE)).backward()
    assert torch.equal(hidden.grad[0], torch.zeros_like(hidden.grad[0]))
    assert_close("dhidden", hidden.grad[1:], h64.grad[1:], torch.float32)
    assert_close("dweight", weight.grad, w64.grad, torch.float32)


def _elementwise_rel(out, ref):
    return ((out.double() - ref) / ref).abs().max().item()


@pytest.mark.parametrize("op", ["cross_entropy", "linear_cross_entropy"])
def test_fp32_softcap_is_accurate_elementwise(backend, op):
    """softcap * tanh(x / softcap) in fp32 keeps every loss row and gradient element within 1e-6 relative of float64,
    also for |x / softcap| << 1, where 2 sigmoid(2u) - 1 cancels (~4e-6 at softcap 30); V small so that lse itself is
    not the limit. Covers both sides of the series/exp switch (softcap 1, |u| up to 1) and +-inf logits."""
    rows, vocab = 24, 8
    for softcap, scale in ((30.0, 1.0), (1.0, 0.5)):
        logits = torch.randn(rows, vocab, device=DEVICE) * scale
        labels = torch.randint(0, vocab, (rows,), device=DEVICE)
        if op == "cross_entropy":
            x = logits.clone().requires_grad_()
            loss = ops.cross_entropy(x, labels, softcap=softcap, reduction="none")
        else:  # identity weight: logits = hidden exactly, so the loss op alone sets the error
            x = logits.clone().requires_grad_()
            eye = torch.eye(vocab, device=DEVICE)
            loss = ops.linear_cross_entropy(x, eye, labels, softcap=softcap, reduction="none")
        (grad,) = torch.autograd.grad(loss.sum(), [x])
        ref, (ref_grad,) = grads64(lambda z, y=labels, c=softcap: cross_entropy_ref(z, y, softcap=c, reduction="none"),
                                   [x], torch.ones(rows, device=DEVICE))
        assert _elementwise_rel(loss, ref) <= 1e-6, f"loss at softcap {softcap}"
        assert _elementwise_rel(grad, ref_grad) <= 1e-6, f"dlogits at softcap {softcap}"
    logits = torch.tensor([[float("-inf"), 0.0, 1e-4, float("inf")], [float("-inf"), -3.0, 2.0, 0.5]], device=DEVICE)
    loss = ops.cross_entropy(logits, torch.tensor([1, 2], device=DEVICE), softcap=2.0, reduction="none")
    assert_close("loss", loss, cross_entropy_ref(logits, torch.tensor([1, 2], device=DEVICE), softcap=2.0,
                                                 reduction="none"), torch.float32)


@pytest.mark.parametrize("op", ["cross_entropy", "linear_cross_entropy"])
def test_num_items_zero_without_valid_labels_gives_zero(backend, op):
    """HF Trainer passes num_items_in_batch = 0 when a whole accumulation window has no targets: the loss is 0.0 and
    every gradient exactly 0 (not 0 / 0 = NaN), with num_items as an int or a tensor; a 0 that would divide real
    tokens still raises."""
    rows, hidden, vocab = 5, 6, 11
    h = torch.randn(rows, hidden, device=DEVICE, requires_grad=True)
    w = torch.randn(vocab, hidden, device=DEVICE, requires_grad=True)
    ignored = torch.full((rows,), -100, device=DEVICE)

    def run(labels, num_items):
        if op == "cross_entropy":
            return ops.cross_entropy(h @ w.T, labels, num_items=num_items)
        return ops.linear_cross_entropy(h, w, labels, num_items=num_items)

    for num_items in (0, torch.tensor(0, device=DEVICE), torch.tensor(0.0), torch.tensor(0)):
        loss = run(ignored, num_items)
        assert loss.item() == 0.0
        for g in torch.autograd.grad(loss, [h, w]):
            assert torch.equal(g, torch.zeros_like(g))
    labels = ignored.clone()
    labels[2] = 3
    for num_items in (0, torch.tensor(0, device=DEVICE)):
        with pytest.raises(ValueError, match="num_items is 0 but 1 labels are valid"):
            run(labels, num_items)
