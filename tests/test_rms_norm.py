"""ops.rms_norm vs the float64 formula, HF's modules bit for bit, and its input errors; both backends."""

import pytest
import torch
from conftest import DEVICE, ON_GPU
from reference import assert_close, grads64, rms_norm_ref
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from leantune import ops
from leantune.ops import _runtime

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# The interpreter costs ~1 ms per program: keep its shapes small (docs/design.md, "Backends").
HIDDEN = {"torch": [64, 576, 2520, 4096], "triton": [64, 100, 576] if not ON_GPU else [64, 576, 2520, 4096]}
ROWS = [0, 1, 7, 33]
VARIANTS = ["llama", "gemma", "none"]


def _inputs(rows, hidden, dtype, variant, lead=()):
    x = (torch.randn(*lead, rows, hidden, device=DEVICE) * 3).to(dtype).requires_grad_()
    if variant == "none":
        return x, None, {}
    # Gemma stores w with scale offset + w, so a small w; llama's weights sit near 1. Both perturbed from init.
    w = torch.randn(hidden, device=DEVICE) * (0.1 if variant == "gemma" else 0.5) + (0.0 if variant == "gemma" else 1.0)
    w = w.to(dtype).requires_grad_()
    kwargs = {"casting": "gemma", "offset": 1.0} if variant == "gemma" else {}
    return x, w, kwargs


def _eager(x, w, eps, offset):
    """The same formula run entirely in the low-precision dtype (the bar for half-precision tolerance)."""
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if w is None else y * (offset + w)


def _check(x, w, kwargs, eps=1e-6):
    dtype = x.dtype
    y = ops.rms_norm(x, w, eps, **kwargs)
    assert y.shape == x.shape
    expected_dtype = x.dtype if (w is None or kwargs) else torch.promote_types(w.dtype, x.dtype)
    assert y.dtype == expected_dtype
    dy = torch.randn_like(y)
    inputs = [x, w]
    ref, ref_grads = grads64(lambda a, b: rms_norm_ref(a, b, eps, kwargs.get("offset", 0.0)), inputs, dy)
    grads = torch.autograd.grad(y, [t for t in inputs if t is not None], dy)
    offset = kwargs.get("offset", 0.0)
    eager_y = _eager(x.detach().clone().requires_grad_(), None if w is None else w.detach().clone().requires_grad_(),
                     eps, offset) if dtype != torch.float32 else None
    assert_close("y", y, ref, dtype, eager_y)
    for name, g, r, t in zip(["dx", "dw"], grads, [g for g in ref_grads if g is not None], inputs):
        assert g.dtype == t.dtype and g.shape == t.shape
        if dtype == torch.float32:
            assert_close(name, g, r, dtype)
        else:
            xe = x.detach().clone().requires_grad_()
            we = None if w is None else w.detach().clone().requires_grad_()
            ye = _eager(xe, we, eps, offset)
            eg = torch.autograd.grad(ye, [xe] if name == "dx" else [we], dy.to(ye.dtype))[0]
            assert_close(name, g, r, dtype, eg)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("rows", ROWS)
def test_matches_reference(backend, dtype, variant, rows):
    for hidden in HIDDEN[backend]:
        x, w, kwargs = _inputs(rows, hidden, dtype, variant)
        _check(x, w, kwargs)


@pytest.mark.parametrize("variant", VARIANTS)
def test_3d_and_strided_inputs(backend, variant):
    x, w, kwargs = _inputs(5, 72, torch.float32, variant, lead=(3,))
    _check(x, w, kwargs)
    # a strided view: every other row of a wider buffer, last dim sliced out of a larger one
    base = torch.randn(4, 10, 160, device=DEVICE, requires_grad=True)
    xs = base[:, ::2, 8:80]
    assert not xs.is_contiguous()
    w2 = None if variant == "none" else (1 + 0.1 * torch.randn(72, device=DEVICE)).requires_grad_()
    _check(xs, w2, kwargs)
    if variant != "none":  # a strided weight (every other element): the kernels read w at unit stride
        wide = (1 + 0.1 * torch.randn(144, device=DEVICE)).requires_grad_()
        _check(xs, wide[::2], kwargs)


@pytest.mark.parametrize("lead", [(2,), ()])
def test_output_may_be_modified_in_place(backend, lead):
    """HF code may clamp a norm's output in place (OLMoE's clip_qkv on q_norm's): the output (3-D, or 2-D: the rows
    themselves) is no view made inside the Function (autograd would refuse), and the gradient is the float64 one
    through the clamp."""
    x, w, _ = _inputs(5, 64, torch.float32, "llama", lead=lead)
    y = ops.rms_norm(x, w, 1e-6)
    assert not y._is_view() and y.shape == x.shape
    clip = 0.5
    y.clamp_(min=-clip, max=clip)
    assert (y.abs() == clip).any() and (y.abs() < clip).any()  # some values clamped, some not
    dy = torch.randn_like(y)
    grads = torch.autograd.grad(y, [x, w], dy)
    _, ref_grads = grads64(lambda a, b: rms_norm_ref(a, b, 1e-6, 0.0).clamp(min=-clip, max=clip), [x, w], dy)
    for name, g, r in zip(["dx", "dw"], grads, ref_grads):
        assert_close(name, g, r, torch.float32)


def test_mixed_dtypes_promote_as_hf(backend):
    """bf16 activations with an fp32 weight give fp32 out, as LlamaRMSNorm does."""
    # The interpreter truncates at fp32 -> bf16 casts (the GPU rounds), so it is checked there in fp16.
    low = torch.float16 if backend == "triton" and not ON_GPU else torch.bfloat16
    x = torch.randn(9, 64, device=DEVICE).to(low).requires_grad_()
    w = (1 + 0.3 * torch.randn(64, device=DEVICE)).requires_grad_()
    y = ops.rms_norm(x, w)
    hf = LlamaRMSNorm(64).to(DEVICE)
    with torch.no_grad():
        hf.weight.copy_(w)
    ref = hf(x)
    assert y.dtype == ref.dtype == torch.float32
    # x_hat is rounded to x's dtype before the fp32 multiply (as HF): a different fp32 summation order may flip that
    # rounding by one ulp on an element, so compare as the bitwise test does, not at the fp32 tolerance.
    same = (y == ref).float().mean().item()
    assert same >= 0.99, f"only {same:.2%} of elements equal HF's"
    assert_close("y", y, ref, low)
    dx, dw = torch.autograd.grad(y, [x, w], torch.ones_like(y))
    assert dx.dtype == low and dw.dtype == torch.float32


def test_gemma_offset_formed_in_fp32(backend):
    """A tiny bf16 w: 1 + w in bf16 would round to 1, the fp32 sum keeps it (HF Gemma RMSNorm)."""
    w = torch.full((64,), 1e-3, device=DEVICE).to(torch.bfloat16)
    x = torch.randn(4, 64, device=DEVICE).to(torch.float16 if backend == "triton" and not ON_GPU else torch.bfloat16)
    y = ops.rms_norm(x, w, casting="gemma", offset=1.0)
    ref = rms_norm_ref(x, w, 1e-6, 1.0).to(x.dtype)
    assert torch.equal(y, ref) or (y.double() - ref.double()).abs().max() <= 2 * torch.finfo(x.dtype).eps * 4
    wrong = rms_norm_ref(x, (1 + w).to(torch.bfloat16).double() - 1, 1e-6, 1.0).to(x.dtype)  # 1 + w rounded
    assert not torch.equal(ref, wrong), "test premise: rounding 1 + w in bf16 must change the result"


@pytest.mark.parametrize("module", ["llama", "gemma"])
def test_bitwise_against_hf_modules(backend, module):
    # The interpreter truncates fp32 -> bf16 at stores (the GPU rounds); it rounds fp16 correctly
    # (docs/design.md, "Backends").
    dtype = torch.float16 if backend == "triton" and not ON_GPU else torch.bfloat16
    hidden = 576
    x = (torch.randn(3, 11, hidden, device=DEVICE) * 2).to(dtype)
    if module == "llama":
        hf = LlamaRMSNorm(hidden, eps=1e-5)
        kwargs = {}
    else:
        hf = Gemma3RMSNorm(hidden, eps=1e-5)
        kwargs = {"casting": "gemma", "offset": 1.0}
    with torch.no_grad():
        hf.weight.normal_(0.0 if module == "gemma" else 1.0, 0.2)
    hf = hf.to(device=DEVICE, dtype=dtype)
    ref = hf(x)
    y = ops.rms_norm(x, hf.weight, 1e-5, **kwargs)
    assert y.dtype == ref.dtype
    same = (y == ref).float().mean().item()
    assert same >= 0.99, f"only {same:.2%} of elements equal HF's {module} RMSNorm"


def test_weight_gradient_is_returned(backend):
    x = torch.randn(6, 64, device=DEVICE)
    w = torch.ones(64, device=DEVICE, requires_grad=True)
    ops.rms_norm(x, w).square().sum().backward()
    assert w.grad is not None and w.grad.abs().sum() > 0


def test_under_autocast_matches_hf(backend):
    if ON_GPU:
        ctx, dtype = torch.autocast("cuda", dtype=torch.bfloat16), torch.bfloat16
    else:
        ctx, dtype = torch.autocast("cpu", dtype=torch.bfloat16), torch.bfloat16
    hf = LlamaRMSNorm(64).to(DEVICE)
    with torch.no_grad():
        hf.weight.normal_(1.0, 0.2)
    x = torch.randn(7, 64, device=DEVICE, requires_grad=True)
    with ctx:
        y = ops.rms_norm(x, hf.weight, hf.variance_epsilon)
        ref = hf(x)
    assert y.dtype == ref.dtype
    assert_close("y", y, ref, torch.float32)
    del dtype


def test_errors_before_any_kernel(backend):
    x = torch.randn(4, 64, device=DEVICE)
    with pytest.raises(ValueError, match="weight must have shape"):
        ops.rms_norm(x, torch.ones(63, device=DEVICE))
    with pytest.raises(ValueError, match="x must be float32, float16 or bfloat16"):
        ops.rms_norm(torch.ones(4, 64, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="weight must be float32"):
        ops.rms_norm(x, torch.ones(64, dtype=torch.float64, device=DEVICE))
    with pytest.raises(ValueError, match="eps must be >= 0"):
        ops.rms_norm(x, eps=-1e-6)
    for eps, match in ((True, "eps must be a real number"), (10**400, "eps must be finite"),
                       (float("nan"), "eps must be finite")):
        with pytest.raises(ValueError, match=match):
            ops.rms_norm(x, eps=eps)
    for offset, match in (("1", "offset must be a real number"), (None, "offset must be a real number"),
                          (float("nan"), "offset must be finite"), (torch.zeros(2), "offset must be a real number")):
        with pytest.raises(ValueError, match=match):
            ops.rms_norm(x, torch.ones(64, device=DEVICE), casting="gemma", offset=offset)
    with pytest.raises(ValueError, match="last dim .* must be >= 1"):
        ops.rms_norm(torch.randn(4, 0, device=DEVICE))
    with pytest.raises(ValueError, match="casting"):
        ops.rms_norm(x, casting="t5")
    with pytest.raises(ValueError, match="offset must be 0"):
        ops.rms_norm(x, torch.ones(64, device=DEVICE), offset=1.0)
    with pytest.raises(ValueError, match="offset must be 0 without a weight"):  # was silently ignored
        ops.rms_norm(x, None, offset=5.0, casting="gemma")
    if ON_GPU:
        with pytest.raises(ValueError, match="one device"):
            ops.rms_norm(x, torch.ones(64))


def test_interpreter_switched_on_after_import_raises(monkeypatch):
    """The kernels are built for the GPU or the interpreter when leantune is imported (as triton.jit decides)."""
    monkeypatch.setenv("LEANTUNE_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(_runtime, "KERNELS_INTERPRETED", False)
    with pytest.raises(RuntimeError, match="set after leantune was imported"):
        ops.rms_norm(torch.randn(2, 8))


def test_triton_backend_on_cpu_without_interpreter_raises(monkeypatch):
    monkeypatch.setenv("LEANTUNE_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        ops.rms_norm(torch.randn(2, 8))
    monkeypatch.setenv("LEANTUNE_BACKEND", "cuda")
    with pytest.raises(ValueError, match="LEANTUNE_BACKEND"):
        ops.rms_norm(torch.randn(2, 8))
