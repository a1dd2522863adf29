"""ops.swiglu / ops.geglu and glu_forward / glu_backward vs the float64 formulas, torch eager, and their input
errors."""

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICE, ON_GPU
from reference import assert_close, geglu_ref, grads64, swiglu_ref

from leantune import ops
from leantune.ops import _runtime, glu

# tl.sigmoid is 1 / (1 + exp(-x)): exp overflows to inf for very negative x (giving the right 0); numpy warns about it
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ACTIVATIONS = list(glu.ACTIVATIONS)
APPROXIMATE = {"geglu_tanh": "tanh", "geglu_erf": "none"}
# The interpreter costs ~1 ms per program: keep its shapes small (docs/design.md, "Backends").
SHAPES = {"torch": [(0,), (1,), (7, 33), (2, 3, 50), (64, 576)], "triton": [(0,), (1,), (7, 33), (2, 3, 50)]}
if ON_GPU:
    SHAPES["triton"] = SHAPES["torch"] + [(33, 14336)]


def _fns(activation):
    """(op, float64 reference, the eager torch expression HF runs) for one activation."""
    if activation == "swiglu":
        return ops.swiglu, swiglu_ref, lambda g, u: F.silu(g) * u
    approx = APPROXIMATE[activation]
    return (
        lambda g, u: ops.geglu(g, u, approx),
        lambda g, u: geglu_ref(g, u, approx),
        lambda g, u: F.gelu(g, approximate=approx) * u,
    )


def _inputs(shape, gate_dtype, up_dtype=None):
    # gate spread wide enough to reach both tails of the activations
    gate = (torch.randn(shape, device=DEVICE) * 3).to(gate_dtype).requires_grad_()
    up = torch.randn(shape, device=DEVICE).to(up_dtype or gate_dtype).requires_grad_()
    return gate, up


def _check(gate, up, activation, dh=None):
    """Value and both gradients vs float64 autograd; half precision measured against the eager expression's error."""
    op, ref_fn, eager_fn = _fns(activation)
    h = op(gate, up)
    out_dtype = torch.promote_types(gate.dtype, up.dtype)
    assert h.shape == gate.shape and h.dtype == out_dtype
    if dh is None:
        dh = torch.randn(h.shape, device=DEVICE).to(out_dtype)
    ref, (ref_d_gate, ref_d_up) = grads64(ref_fn, [gate, up], dh)
    d_gate, d_up = torch.autograd.grad(h, [gate, up], dh)
    assert d_gate.dtype == gate.dtype and d_gate.shape == gate.shape
    assert d_up.dtype == up.dtype and d_up.shape == up.shape
    gate_e = gate.detach().clone().requires_grad_()
    up_e = up.detach().clone().requires_grad_()
    h_e = eager_fn(gate_e, up_e)
    eager_d_gate, eager_d_up = torch.autograd.grad(h_e, [gate_e, up_e], dh.to(h_e.dtype))
    assert_close("h", h, ref, out_dtype, h_e)
    assert_close("d_gate", d_gate, ref_d_gate, gate.dtype, eager_d_gate)
    assert_close("d_up", d_up, ref_d_up, up.dtype, eager_d_up)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_matches_reference(backend, dtype, activation):
    for shape in SHAPES[backend]:
        gate, up = _inputs(shape, dtype)
        _check(gate, up, activation)


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_many_programs_and_tails(backend, activation, monkeypatch):
    """A small block: many programs per tensor and per row, tails that are not multiples of the block."""
    monkeypatch.setattr(glu, "BLOCK", 32)
    for shape in [(1000,), (7, 33), (3, 5, 100)]:
        _check(*_inputs(shape, torch.float32), activation)
    base = torch.randn(9, 2 * 70 + 5, device=DEVICE, requires_grad=True)  # rows of 70 = 2 blocks + a tail
    _check(base[:, :70], base[:, 75:], activation)


def _tail_ref(activation):
    """float64 act(g) * up without cancellation in the far negative tail (reference.geglu_ref's identities)."""
    if activation == "swiglu":
        return swiglu_ref
    return lambda g, u: geglu_ref(g, u, APPROXIMATE[activation])


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_negative_tail_keeps_relative_precision(backend, activation):
    """Elementwise relative error in fp32 where act(g) is tiny: forming 1 + tanh or 1 + erf would cancel there
    (torch's own fp32 GELU loses all digits by g = -6); the norm-wise checks above cannot see these elements."""
    low = {"swiglu": -80.0, "geglu_tanh": -9.0, "geglu_erf": -12.0}[activation]  # fp32 underflow below
    gate = torch.cat([torch.linspace(low, -3.0, 97), torch.linspace(3.0, 40.0, 31)]).to(DEVICE)
    gate = (gate * (1 + 0.01 * torch.rand(gate.shape, device=DEVICE))).requires_grad_()  # fresh draw, same range
    up = torch.ones_like(gate, requires_grad=True)
    op, _, _ = _fns(activation)
    h = op(gate, up)
    ref, (ref_d_gate, ref_d_up) = grads64(_tail_ref(activation), [gate, up], torch.ones_like(gate))
    d_gate, d_up = torch.autograd.grad(h, [gate, up], torch.ones_like(h))
    for name, out, expected in [("h", h, ref), ("d_gate", d_gate, ref_d_gate), ("d_up", d_up, ref_d_up)]:
        assert (expected != 0).all()
        worst = ((out.double() - expected) / expected).abs().max().item()
        assert worst <= 1e-4, f"{name}: elementwise relative error {worst:.3g} in the tails"


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_strided_inputs(backend, activation):
    width = 40
    # gate/up as the two halves of a fused gate_up projection output (row-strided views, no copy)
    base = torch.randn(2, 6, 2 * width, device=DEVICE, requires_grad=True)
    gate, up = base[..., :width], base[..., width:]
    assert not gate.is_contiguous() and not up.is_contiguous()
    dh = torch.randn(2, 6, 3 * width, device=DEVICE)[..., ::3]  # a strided incoming gradient too
    _check(gate, up, activation, dh)
    # a transposed gate and a column-strided up (these take a copy to rows) with a contiguous dh
    gate_t = torch.randn(width, 7, device=DEVICE).t().requires_grad_()
    up_s = torch.randn(7, 2 * width, device=DEVICE, requires_grad=True)[:, ::2]
    _check(gate_t, up_s, activation)
    # one contiguous and one strided input, half precision
    _check(torch.randn(6, width, device=DEVICE).half().requires_grad_(), base[0].half()[:, width:], activation)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtypes", [(torch.bfloat16, torch.float32), (torch.float32, torch.float16),
                                    (torch.float16, torch.bfloat16)], ids=str)
def test_mixed_dtypes_promote(backend, activation, dtypes):
    gate, up = _inputs((5, 37), *dtypes)
    _check(gate, up, activation)
    op, _, eager_fn = _fns(activation)
    with torch.no_grad():
        assert op(gate, up).dtype == eager_fn(gate, up).dtype == torch.promote_types(*dtypes)


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_matches_torch_eager_within_rounding(backend, activation):
    """HF's ``act_fn(gate) * up``: we round once where it rounds twice, so most elements equal it and the rest are
    within about one rounding of it (bf16 on the torch backend; fp16 under the interpreter, which truncates bf16)."""
    dtype = torch.float16 if backend == "triton" and not ON_GPU else torch.bfloat16
    op, ref_fn, eager_fn = _fns(activation)
    gate = (torch.randn(12, 200, device=DEVICE) * 3).to(dtype)
    up = torch.randn(12, 200, device=DEVICE).to(dtype)
    h, h_e = op(gate, up), eager_fn(gate, up)
    assert h.dtype == h_e.dtype == dtype
    same = (h == h_e).float().mean().item()
    assert same >= 0.6, f"only {same:.2%} of elements equal torch eager"
    eps = torch.finfo(dtype).eps
    # the absolute slack covers eager's fp32 cancellation in 1 + tanh/erf for very negative gates
    excess = (h.double() - h_e.double()).abs() - (2 * eps * h_e.double().abs() + 1e-5)
    assert excess.max().item() <= 0, f"an element is {excess.max().item():.3g} beyond two roundings of eager"
    # and never further from the exact value than eager, overall
    ref = ref_fn(gate, up)
    assert (h.double() - ref).norm() <= (h_e.double() - ref).norm() * 1.01


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_glu_forward_backward_and_inplace(backend, activation):
    dtypes = (torch.float16, torch.float32)
    gate, up = _inputs((9, 45), *dtypes)
    dh = torch.randn(9, 45, device=DEVICE)
    h = glu.glu_forward(gate, up, activation)
    assert not h.requires_grad and h.dtype == torch.float32
    op, _, _ = _fns(activation)
    h_ag = op(gate, up)
    assert torch.equal(h, h_ag)
    d_gate, d_up = glu.glu_backward(dh, gate, up, activation)
    assert not d_gate.requires_grad and d_gate.dtype == gate.dtype and d_up.dtype == up.dtype
    ag_gate, ag_up = torch.autograd.grad(h_ag, [gate, up], dh)
    assert torch.equal(d_gate, ag_gate) and torch.equal(d_up, ag_up)
    assert not torch.equal(d_gate, gate.detach()), "test premise: the gradient differs from the input"
    # inplace: the results land in the given buffers, equal to the out-of-place ones; also with a strided dh
    for dh_in in (dh, torch.randn(9, 90, device=DEVICE)[:, ::2]):
        expected = glu.glu_backward(dh_in, gate, up, activation)
        gate_buf, up_buf = gate.detach().clone(), up.detach().clone()
        ptrs = (gate_buf.data_ptr(), up_buf.data_ptr())
        out_gate, out_up = glu.glu_backward(dh_in, gate_buf, up_buf, activation, inplace=True)
        assert (out_gate.data_ptr(), out_up.data_ptr()) == ptrs
        assert out_gate.shape == gate.shape and out_gate.dtype == gate.dtype
        assert torch.equal(gate_buf, expected[0]) and torch.equal(up_buf, expected[1])
    # the two contiguous halves of one buffer (as a fused gate_up output split on its first dim) are fine
    fused = torch.stack([gate.detach().float(), up.detach().float()])
    expected = glu.glu_backward(dh, fused[0], fused[1], activation)
    out_gate, out_up = glu.glu_backward(dh, fused[0], fused[1], activation, inplace=True)
    assert out_gate.data_ptr() == fused[0].data_ptr() and out_up.data_ptr() == fused[1].data_ptr()
    assert torch.equal(fused[0], expected[0]) and torch.equal(fused[1], expected[1])


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("shape", [(9, 45), (2, 5, 24)])
def test_glu_backward_into_the_halves_of_one_buffer(backend, activation, shape):
    """``out=``: d_gate and d_up written through the row strides of the two halves of one [..., 2I] buffer (a MoE
    gate_up gradient), equal to the out-of-place results; the rest of the buffer is the results, nothing unwritten
    (the buffer starts as NaN)."""
    gate, up = _inputs(shape, torch.bfloat16)
    dh = torch.randn(shape, device=DEVICE)
    expected = glu.glu_backward(dh, gate, up, activation)
    buffer = torch.full((*shape[:-1], 2 * shape[-1]), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    halves = buffer.chunk(2, dim=-1)
    result = glu.glu_backward(dh, gate, up, activation, out=halves)
    assert all(r.data_ptr() == h.data_ptr() for r, h in zip(result, halves))
    assert torch.equal(buffer, torch.cat(expected, dim=-1))


def test_glu_backward_out_errors(backend):
    gate, up = _inputs((4, 8), torch.float32)
    dh = torch.randn(4, 8, device=DEVICE)
    buffer = torch.empty(4, 16, device=DEVICE)
    with pytest.raises(ValueError, match="out and inplace=True are exclusive"):
        glu.glu_backward(dh, gate.detach(), up.detach(), "swiglu", inplace=True, out=buffer.chunk(2, dim=-1))
    with pytest.raises(ValueError, match="out must be a pair of tensors"):
        glu.glu_backward(dh, gate, up, "swiglu", out=buffer)
    with pytest.raises(ValueError, match=r"out\[1\] must have shape \(4, 8\), dtype torch.float32"):
        glu.glu_backward(dh, gate, up, "swiglu", out=(buffer[:, :8], buffer[:, 8:15]))
    with pytest.raises(ValueError, match=r"out\[0\] must have unit last stride"):
        glu.glu_backward(dh, gate, up, "swiglu", out=(buffer[:, ::2], buffer[:, 8:]))
    with pytest.raises(ValueError, match="must not overlap"):  # columns 4..11 and 8..15 of each row
        glu.glu_backward(dh, gate, up, "swiglu", out=(buffer[:, 4:12], buffer[:, 8:]))
    tall = torch.empty(5, 16, device=DEVICE)
    with pytest.raises(ValueError, match="must not overlap"):  # rows 0-3 and rows 1-4 of the same columns
        glu.glu_backward(dh, gate, up, "swiglu", out=(tall[:4, :8], tall[1:, :8]))
    assert not _runtime.rows_overlap(buffer[:, :8], buffer[:, 8:])
    assert not _runtime.rows_overlap(buffer[:2, :8], buffer[2:, :8])
    assert _runtime.rows_overlap(buffer[:, 7:15], buffer[:, 8:])


def test_saves_only_gate_and_up(backend):
    gate, up = _inputs((4, 30), torch.float32)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        h = ops.geglu(gate, up)
    assert len(saved) == 2
    assert {t.data_ptr() for t in saved} == {gate.data_ptr(), up.data_ptr()}
    h.sum().backward()  # the expanded (stride-0) gradient of a sum
    assert torch.isfinite(gate.grad).all() and torch.isfinite(up.grad).all()
    _, (ref_d_gate, ref_d_up) = grads64(lambda g, u: geglu_ref(g, u), [gate, up], torch.ones(4, 30, device=gate.device))
    assert_close("d_gate", gate.grad, ref_d_gate, torch.float32)
    assert_close("d_up", up.grad, ref_d_up, torch.float32)


@pytest.mark.parametrize("activation", ["swiglu", "geglu_tanh"])
def test_under_autocast(backend, activation):
    """A bf16-autocast MLP: the projections come out bf16, the op returns what ``act(gate) * up`` returns, and the
    value and gradients are as close to float64 truth as eager's."""
    device_type = "cuda" if ON_GPU else "cpu"
    x = torch.randn(6, 32, device=DEVICE, requires_grad=True)
    w_gate = (torch.randn(48, 32, device=DEVICE) / 6).requires_grad_()
    w_up = (torch.randn(48, 32, device=DEVICE) / 6).requires_grad_()
    op, ref_fn, eager_fn = _fns(activation)
    results = []
    for fn in (op, eager_fn):
        with torch.autocast(device_type, dtype=torch.bfloat16):
            h = fn(x @ w_gate.T, x @ w_up.T)
        grads = torch.autograd.grad(h.float().square().sum(), [x, w_gate, w_up])
        results.append((h, grads))
    (h, grads), (h_e, grads_e) = results
    assert h.dtype == h_e.dtype == torch.bfloat16
    # float64 truth of the same graph, from the bf16-rounded operands autocast feeds the matmuls
    leaves = [t.detach().to(torch.bfloat16).double().requires_grad_() for t in (x, w_gate, w_up)]
    h_ref = ref_fn(leaves[0] @ leaves[1].T, leaves[0] @ leaves[2].T)
    grads_ref = torch.autograd.grad(h_ref.square().sum(), leaves)
    assert_close("h", h, h_ref, torch.bfloat16, h_e)
    for name, g, g_e, g_ref in zip(["dx", "dw_gate", "dw_up"], grads, grads_e, grads_ref):
        assert g.dtype == g_e.dtype == torch.float32
        assert_close(name, g, g_ref, torch.bfloat16, g_e)


def _no_kernels(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a kernel ran")

    for name in ("_forward_triton", "_forward_torch", "_backward_triton", "_backward_torch"):
        monkeypatch.setattr(glu, name, refuse)


def test_zero_elements_launch_nothing(backend, monkeypatch):
    _no_kernels(monkeypatch)
    for shape in [(0,), (3, 0, 5), (4, 0)]:
        gate, up = _inputs(shape, torch.bfloat16)
        h = ops.geglu(gate, up, approximate="none")
        assert h.shape == shape and h.dtype == torch.bfloat16
        d_gate, d_up = torch.autograd.grad(h, [gate, up], torch.ones_like(h))
        assert d_gate.shape == shape and d_up.shape == shape
        g_buf, u_buf = gate.detach().clone(), up.detach().clone()
        assert glu.glu_forward(g_buf, u_buf, "swiglu").shape == shape
        out = glu.glu_backward(torch.ones_like(h), g_buf, u_buf, "swiglu", inplace=True)
        assert out[0] is g_buf and out[1] is u_buf


def test_errors_before_any_kernel(backend, monkeypatch):
    _no_kernels(monkeypatch)
    gate, up = torch.randn(4, 64, device=DEVICE), torch.randn(4, 64, device=DEVICE)
    with pytest.raises(ValueError, match=r"up must have shape \(4, 64\)"):
        ops.swiglu(gate, up[:, :63])
    with pytest.raises(ValueError, match=r"up must have shape"):
        ops.geglu(gate, up.reshape(64, 4))
    with pytest.raises(ValueError, match="gate must be float32, float16 or bfloat16"):
        ops.swiglu(gate.to(torch.int32), up)
    with pytest.raises(ValueError, match="approximate must be 'tanh' or 'none'"):
        ops.geglu(gate, up, ["tanh"])  # unhashable: was a raw TypeError
    with pytest.raises(ValueError, match="up must be float32, float16 or bfloat16"):
        ops.geglu(gate, up.double())
    with pytest.raises(ValueError, match="gate must be a torch.Tensor"):
        ops.swiglu(gate.tolist(), up)
    other = "cpu" if ON_GPU else "meta"
    with pytest.raises(ValueError, match="one device"):
        ops.swiglu(gate, up.to(other))
    with pytest.raises(ValueError, match="approximate must be 'tanh' or 'none'"):
        ops.geglu(gate, up, approximate="erf")
    with pytest.raises(ValueError, match="activation must be one of"):
        glu.glu_forward(gate, up, "gelu")
    with pytest.raises(ValueError, match="activation must be one of"):
        glu.glu_backward(gate, gate, up, "relu")
    with pytest.raises(ValueError, match=r"dh must have shape \(4, 64\)"):
        glu.glu_backward(gate[:2], gate, up, "swiglu")
    with pytest.raises(ValueError, match="dh must be float32"):
        glu.glu_backward(gate.to(torch.int64), gate, up, "swiglu")
    with pytest.raises(ValueError, match="one device"):
        glu.glu_backward(gate.to(other), gate, up, "swiglu")
    wide = torch.randn(4, 128, device=DEVICE)
    with pytest.raises(ValueError, match="gate must be contiguous with inplace=True"):
        glu.glu_backward(gate, wide[:, ::2], up, "swiglu", inplace=True)
    with pytest.raises(ValueError, match="up must be contiguous with inplace=True"):
        glu.glu_backward(gate, gate, wide[:, 64:], "swiglu", inplace=True)
    with pytest.raises(ValueError, match="must not overlap"):
        glu.glu_backward(gate, gate, gate, "swiglu", inplace=True)
    fused = torch.randn(2, 8, 64, device=DEVICE)
    with pytest.raises(ValueError, match="must not overlap"):
        glu.glu_backward(gate[:2], fused.view(-1)[:128].view(2, 64), fused.view(-1)[64:192].view(2, 64), "swiglu",
                         inplace=True)


def test_triton_backend_on_cpu_without_interpreter_raises(monkeypatch):
    monkeypatch.setenv("LEANTUNE_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        ops.swiglu(torch.randn(2, 8), torch.randn(2, 8))
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        glu.glu_forward(torch.randn(2, 8), torch.randn(2, 8), "swiglu")


@pytest.mark.skipif(not ON_GPU, reason="needs > 2^31 elements: GPU only")
def test_int64_offsets_beyond_2_31_elements():
    """Flat tensors past 2^31 elements, and row-strided halves of a fused tensor whose offsets pass 2^31."""
    torch.cuda.empty_cache()
    n = 2**31 + 4099
    gate = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    up = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    h = glu.glu_forward(gate, up, "swiglu")
    for part in (slice(0, 8192), slice(n - 8192, n)):
        assert_close("h", h[part], swiglu_ref(gate[part], up[part]).to(torch.bfloat16), torch.bfloat16)
    tail_gate, tail_up = gate[-8192:].clone(), up[-8192:].clone()
    expected = glu.glu_backward(h[-8192:], tail_gate, tail_up, "swiglu")
    glu.glu_backward(h, gate, up, "swiglu", inplace=True)
    assert torch.equal(gate[-8192:], expected[0]) and torch.equal(up[-8192:], expected[1])
    del gate, up, h, tail_gate, tail_up, expected
    width = 14336
    rows = 2**31 // (2 * width) + 3
    base = torch.randn(rows, 2 * width, device="cuda", dtype=torch.bfloat16)
    h = ops.geglu(base[:, :width], base[:, width:])
    assert base.numel() > 2**31
    assert_close("h", h[-3:], geglu_ref(base[-3:, :width], base[-3:, width:]), torch.bfloat16)


def test_torch_swiglu_backward_in_place_forms_two_temporaries(monkeypatch):
    """CPU rule (docs/design.md, "Backends"): the fp32 SwiGLU backward on the torch path writes d_gate/d_up into the
    caller's buffers through torch's fused silu kernels; besides them only dh * up and silu(gate) are formed."""
    from torch.utils._python_dispatch import TorchDispatchMode

    monkeypatch.setenv("LEANTUNE_BACKEND", "torch")
    gate, up = (torch.randn(37, 150) for _ in range(2))
    dh = torch.randn(37, 150)
    expected = grads64(lambda g, u: swiglu_ref(g, u), [gate.requires_grad_(), up.requires_grad_()], dh)[1]
    gate_buf, up_buf = gate.detach().clone(), up.detach().clone()
    storages = set()

    class RecordStorages(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and t.numel() == gate.numel():
                    storages.add(t.untyped_storage().data_ptr())
            return out

    with RecordStorages():
        d_gate, d_up = glu.glu_backward(dh, gate_buf, up_buf, "swiglu", inplace=True)
    assert d_gate.data_ptr() == gate_buf.data_ptr() and d_up.data_ptr() == up_buf.data_ptr()
    assert len(storages - {gate_buf.untyped_storage().data_ptr(), up_buf.untyped_storage().data_ptr()}) <= 2
    assert_close("d_gate", d_gate, expected[0], torch.float32)
    assert_close("d_up", d_up, expected[1], torch.float32)
