"""ops.lora_linear / lora_qkv / lora_mlp vs float64 formulas, PEFT's LoraLayers, saved-bytes accounting; both
backends."""

import copy
import math
import weakref

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICE, ON_GPU
from peft import LoraConfig, get_peft_model
from reference import F64, assert_close, geglu_ref, grads64, lora_linear_ref, rel_err, swiglu_ref
from torch import nn

from leantune import ops
from leantune.ops import lora
from leantune.ops.lora import api as lora_api
from leantune.ops.lora import kernels

LOW = torch.bfloat16
# the interpreter costs ~1 ms per program: small widths there (docs/design.md, "Backends")
IN, OUT = 72, 40


def _proj(n_in, n_out, rank, wdt, ldt, bias=False, lora_on=True, train_weight=False):
    w = (torch.randn(n_out, n_in, device=DEVICE) / math.sqrt(n_in)).to(wdt).requires_grad_(train_weight)
    b = (torch.randn(n_out, device=DEVICE) * 0.1).to(wdt).requires_grad_() if bias else None
    if not lora_on:
        return lora.LoraWeights(w, None, None, 1.0, b)
    a = (torch.randn(rank, n_in, device=DEVICE) / math.sqrt(n_in)).to(ldt).requires_grad_()
    bm = torch.randn(n_out, rank, device=DEVICE).to(ldt).requires_grad_()
    return lora.LoraWeights(w, a, bm, 2.0 / rank, b)


def _leaves(p):
    return [t for t in (p.weight, p.lora_A, p.lora_B, p.bias) if t is not None and t.requires_grad]


def _seeds_of(call, count):
    """Run ``call`` with a known generator state; return (its result, the dropout seeds it drew)."""
    state = torch.randint(2**31, ()).item()
    torch.manual_seed(state)
    out = call()
    torch.manual_seed(state)
    return out, lora.dropout_seeds(count, DEVICE)


def _mask(seeds, k, rows, cols, p):
    return None if seeds is None else lora.dropout_mask(seeds[k], (rows, cols), p, DEVICE)


def _linear_f(p, mask):
    """lora_linear_ref as a function of the projection's leaves (x first), for grads64."""
    def fn(x, w, a, b, bias):
        return lora_linear_ref(x, w, a, b, p.scaling, bias, mask)
    return fn


def _eager_linear(x, p, mask, dtype):
    """The formula run in ``dtype`` (the half-precision bar): y and grads for the same leaves."""
    leaves = [None if t is None else t.detach().to(dtype).requires_grad_(t.requires_grad)
              for t in (x, p.weight, p.lora_A, p.lora_B, p.bias)]
    x_, w, a, b, bias = leaves
    y = x_ @ w.T + (0 if bias is None else bias)
    if a is not None:
        xd = x_ if mask is None else x_ * mask.to(dtype)
        y = y + p.scaling * (xd @ a.T) @ b.T
    return y, leaves


def _check_linear_grads(x, p, y, mask, dtype):
    dy = torch.randn_like(y)
    inputs = [x, p.weight, p.lora_A, p.lora_B, p.bias]
    ref, ref_grads = grads64(lambda *t: lora_linear_ref(*t[:4], p.scaling, t[4], mask), inputs, dy)
    eager = eager_grads = None
    if dtype != torch.float32:
        eager, e_leaves = _eager_linear(x, p, mask, dtype)
        wanted = [t for t in e_leaves if t is not None and t.requires_grad]
        eager_grads = iter(torch.autograd.grad(eager, wanted, dy.to(dtype)))
    assert_close("y", y, ref, dtype, eager)
    wanted = [t for t in inputs if t is not None and t.requires_grad]
    grads = torch.autograd.grad(y, wanted, dy)
    refs = [g for g in ref_grads if g is not None]
    for name, g, r, t in zip(["dx", "dW/dA", "dA/dB", "dB/db", "db"], grads, refs, wanted):
        assert g.dtype == t.dtype and g.shape == t.shape, name
        assert_close(name, g, r, dtype, None if eager_grads is None else next(eager_grads))


# ------------------------------------------------------------------------------------------------- lora_linear
GRID = [(dtype, rank, bias, p, lead) for dtype in (torch.float32, LOW) for rank in (1, 8, 64)
        for bias in (False, True) for p in (0.0, 0.25) for lead in ((), (2,))]


@pytest.mark.parametrize("dtype,rank,bias,p,lead", GRID, ids=str)
def test_linear_matches_reference_torch(monkeypatch, dtype, rank, bias, p, lead):
    monkeypatch.setenv("LEANTUNE_BACKEND", "torch")
    _linear_case(dtype, rank, bias, p, lead, rows=13)


@pytest.mark.parametrize("dtype", [torch.float32, LOW], ids=str)
@pytest.mark.parametrize("rank", [1, 8, 64])
def test_linear_matches_reference_triton(monkeypatch, dtype, rank):
    """Dropout and mixed dtypes go through the Triton kernels (same-dtype p = 0 is all cuBLAS)."""
    monkeypatch.setenv("LEANTUNE_BACKEND", "triton")
    _linear_case(dtype, rank, True, 0.25, (2,), rows=13)
    _linear_case(dtype, rank, False, 0.0, (), rows=70, ldt=torch.float32)


def _linear_case(dtype, rank, bias, p, lead, rows, ldt=None):
    x = torch.randn(*lead, rows, IN, device=DEVICE).to(dtype).requires_grad_()
    pr = _proj(IN, OUT, rank, dtype, ldt or dtype, bias)
    y, seeds = _seeds_of(lambda: ops.lora_linear(x, *pr, dropout=p), 1 if p else 0)
    assert y.shape == (*lead, rows, OUT) and y.dtype == dtype
    mask = _mask(seeds if p else None, 0, x[..., 0].numel(), IN, p)
    _check_linear_grads(x, pr, y, None if mask is None else mask.view(x.shape), dtype)


def test_fp32_adapters_under_bf16_base(backend):
    """PEFT's default: adapters kept in fp32; y in the base dtype; grads in their inputs' dtypes."""
    x = torch.randn(3, 11, IN, device=DEVICE).to(LOW).requires_grad_()
    pr = _proj(IN, OUT, 8, LOW, torch.float32, bias=True)
    y = ops.lora_linear(x, *pr)
    assert y.dtype == LOW
    _check_linear_grads(x, pr, y, None, LOW)


def test_full_finetune_weight_grad(backend):
    x = torch.randn(17, IN, device=DEVICE, requires_grad=True)
    pr = _proj(IN, OUT, 4, torch.float32, torch.float32, bias=True, train_weight=True)
    y, seeds = _seeds_of(lambda: ops.lora_linear(x, *pr, dropout=0.1), 1)
    _check_linear_grads(x, pr, y, _mask(seeds, 0, 17, IN, 0.1), torch.float32)
    plain = pr._replace(lora_A=None, lora_B=None)
    _check_linear_grads(x, plain, ops.lora_linear(x, *plain), None, torch.float32)


def test_no_adapters_is_plain_linear(backend):
    x = torch.randn(5, IN, device=DEVICE, requires_grad=True)
    w, b = torch.randn(OUT, IN, device=DEVICE), torch.randn(OUT, device=DEVICE, requires_grad=True)
    y = ops.lora_linear(x, w, None, None, 1.0, b, dropout=0.5)
    assert_close("y", y, F.linear(x.double(), w.double(), b.double()), torch.float32)


# --------------------------------------------------------------------------------------------------------- PEFT
class _One(nn.Module):
    def __init__(self, n_in, n_out, bias):
        super().__init__()
        self.proj = nn.Linear(n_in, n_out, bias=bias)

    def forward(self, x):
        return self.proj(x)


def _peft(module, targets, rank, alpha, dtype, adapter_fp32):
    module = module.to(device=DEVICE, dtype=dtype)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0)
    model = get_peft_model(module, config, autocast_adapter_dtype=adapter_fp32)
    for name, param in model.named_parameters():
        if "lora_B" in name:  # PEFT starts B at zero: the LoRA gradient paths would go untested
            with torch.no_grad():
                param.normal_(0.0, 0.5)
    return model


def _weights(layer, train_bias=False):
    """LoraWeights viewing a PEFT lora.Linear's tensors (the same parameters, so grads land on both)."""
    base = layer.base_layer
    bias = base.bias
    if bias is not None:
        bias.requires_grad_(train_bias)
    return lora.LoraWeights(base.weight, layer.lora_A["default"].weight, layer.lora_B["default"].weight,
                            layer.scaling["default"], bias)


def _compare_with_peft(ours_fn, model, x, names):
    """Same y and grads (x and the named trainable parameters) as PEFT: in fp32 within 1e-5 of PEFT; in half
    precision no further from the float64 run of the same PEFT model than PEFT itself is, plus 1e-2 (docs/design.md,
    "Tests and tolerance")."""
    dtype = x.dtype
    params = dict(model.named_parameters())
    y_peft = model(x)
    dy = torch.randn_like(y_peft)
    g_peft = torch.autograd.grad(y_peft, [x, *(params[n] for n in names)], dy)
    y = ours_fn(x)
    assert y.dtype == y_peft.dtype and y.shape == y_peft.shape
    g = torch.autograd.grad(y, [x, *(params[n] for n in names)], dy)
    if dtype == torch.float32:
        assert_close("y vs PEFT", y, y_peft, dtype)
        for n, a, b in zip(["x", *names], g, g_peft):
            assert a.dtype == b.dtype
            assert_close(f"d{n} vs PEFT", a, b, dtype)
        return
    model64 = copy.deepcopy(model).double()
    params64 = dict(model64.named_parameters())
    x64 = x.detach().double().requires_grad_()
    y64 = model64(x64)
    g64 = torch.autograd.grad(y64, [x64, *(params64[n] for n in names)], dy.double())
    assert_close("y", y, y64, dtype, y_peft)
    for n, a, b, r in zip(["x", *names], g, g_peft, g64):
        assert a.dtype == b.dtype
        assert_close(f"d{n}", a, r, dtype, b)


def _names(model):
    return [n for n, t in model.named_parameters() if t.requires_grad]


@pytest.mark.parametrize("dtype,adapter_fp32", [(torch.float32, False), (LOW, False), (LOW, True)], ids=str)
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_peft(backend, dtype, adapter_fp32, bias):
    model = _peft(_One(IN, OUT, bias), ["proj"], 8, 16, dtype, adapter_fp32)
    layer = model.base_model.model.proj
    pr = _weights(layer, train_bias=bias)
    assert pr.lora_A.dtype == (torch.float32 if adapter_fp32 else dtype)
    x = torch.randn(2, 9, IN, device=DEVICE).to(dtype).requires_grad_()
    names = _names(model)
    assert len(names) == 2 + bias
    _compare_with_peft(lambda t: ops.lora_linear(t, *pr), model, x, names)


def test_linear_under_autocast_matches_peft(backend):
    """fp32 model and input under autocast(bf16): both matmul branches in bf16, as autocast does for PEFT."""
    device_type = "cuda" if ON_GPU else "cpu"
    model = _peft(_One(IN, OUT, True), ["proj"], 8, 16, torch.float32, True)
    pr = _weights(model.base_model.model.proj)
    x = torch.randn(13, IN, device=DEVICE, requires_grad=True)
    with torch.autocast(device_type, dtype=LOW):
        y_peft = model(x)
        y = ops.lora_linear(x, *pr)
    assert y.dtype == y_peft.dtype == LOW
    assert rel_err(y, y_peft) <= 1e-2
    dy = torch.randn_like(y)
    for a, b in zip(torch.autograd.grad(y, [x, pr.lora_A, pr.lora_B], dy),
                    torch.autograd.grad(y_peft, [x, pr.lora_A, pr.lora_B], dy)):
        assert a.dtype == b.dtype == torch.float32
        assert rel_err(a, b) <= 2e-2


# ------------------------------------------------------------------------------------------------------ dropout
def test_dropout_training_flag_and_mask_reuse(backend):
    x = torch.randn(21, IN, device=DEVICE, requires_grad=True)
    pr = _proj(IN, OUT, 8, torch.float32, torch.float32)
    y0 = ops.lora_linear(x, *pr)
    y_eval = ops.lora_linear(x, *pr, dropout=0.3, training=False)
    assert torch.equal(y0, y_eval)
    y, seeds = _seeds_of(lambda: ops.lora_linear(x, *pr, dropout=0.3), 1)
    assert rel_err(y, y0) > 1e-3, "dropout in training must change the output"
    torch.rand(1000, device=DEVICE)  # the generator moves on: backward must still use the forward's mask
    _check_linear_grads(x, pr, y, _mask(seeds, 0, 21, IN, 0.3), torch.float32)


def test_dropout_mask_statistics(backend):
    p = 0.3
    m = lora.dropout_mask(12345, (64, 130), p, DEVICE)
    assert torch.all((m == 0) | torch.isclose(m, torch.tensor(1 / (1 - p), device=DEVICE)))
    kept = (m > 0).double().mean().item()
    assert abs(kept - (1 - p)) < 4 * math.sqrt(p * (1 - p) / m.numel())
    assert torch.equal(m, lora.dropout_mask(12345, (64, 130), p, DEVICE))
    assert not torch.equal(m, lora.dropout_mask(12346, (64, 130), p, DEVICE))


def test_device_mask_of_the_torch_path_reads_no_seed_back():
    """Off the CPU the torch path's mask is the counter hash of the device seed (a Generator would read it back):
    it runs on the meta device (no values at all), and on the CPU its statistics are dropout's, row and column
    neighbours uncorrelated, a pure function of the seed."""
    from leantune.ops.lora.passes import _hash_mask, _torch_mask

    assert _torch_mask(torch.tensor(5, device="meta"), (3, 4), 0.5, "meta").device.type == "meta"
    p, shape = 0.3, (256, 257)
    m = _hash_mask(torch.tensor(12345), shape, p, "cpu")
    assert torch.all((m == 0) | torch.isclose(m, torch.tensor(1 / (1 - p))))
    keep = (m > 0).double()
    sigma = math.sqrt(p * (1 - p) / m.numel())
    assert abs(keep.mean().item() - (1 - p)) < 4 * sigma
    for a, b in ((keep[:, 1:], keep[:, :-1]), (keep[1:], keep[:-1])):  # covariance of neighbours ~ 0
        assert abs((a * b).mean().item() - a.mean().item() * b.mean().item()) < 4 * p * (1 - p) / math.sqrt(a.numel())
    assert torch.equal(m, _hash_mask(12345, shape, p, "cpu"))
    assert (m != _hash_mask(12346, shape, p, "cpu")).double().mean().item() > 0.3


def test_checkpoint_recomputes_the_same_masks(backend):
    x = torch.randn(9, IN, device=DEVICE, requires_grad=True)
    gate, up = _proj(IN, 48, 4, torch.float32, torch.float32), _proj(IN, 48, 4, torch.float32, torch.float32)
    down = _proj(48, IN, 4, torch.float32, torch.float32)

    def block(t):
        return ops.lora_mlp(t, gate, up, down, dropout=0.2)

    state = torch.randint(2**31, ()).item()
    torch.manual_seed(state)
    y = block(x)
    plain = torch.autograd.grad(y.square().sum(), [x, gate.lora_A, down.lora_B])
    torch.manual_seed(state)
    y_ck = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
    ck = torch.autograd.grad(y_ck.square().sum(), [x, gate.lora_A, down.lora_B])
    assert torch.equal(y, y_ck)
    for a, b in zip(plain, ck):
        assert rel_err(a, b) <= 1e-6


# --------------------------------------------------------------------------------------------------------- qkv
@pytest.mark.parametrize("dtype,p", [(torch.float32, 0.0), (torch.float32, 0.2), (LOW, 0.0), (LOW, 0.2)], ids=str)
def test_qkv_matches_reference(backend, dtype, p):
    """Qwen2-style biases, GQA widths, v without adapters, a strided 3-D x."""
    x_full = torch.randn(2, 11, IN + 8, device=DEVICE).to(dtype)
    x = x_full[..., 4:4 + IN].requires_grad_()  # non-contiguous rows: view of a wider buffer
    q = _proj(IN, 48, 8, dtype, dtype, bias=True)
    k = _proj(IN, 16, 1, dtype, dtype, bias=True)
    v = _proj(IN, 16, 8, dtype, dtype, bias=True, lora_on=False)
    outs, seeds = _seeds_of(lambda: ops.lora_qkv(x, q, k, v, dropout=p), 2 if p else 0)
    rows = 22
    masks = [None if not p else _mask(seeds, i, rows, IN, p).view(x.shape) for i in range(2)] + [None]
    dys = [torch.randn_like(o) for o in outs]
    leaves = [x, *_leaves(q), *_leaves(k), *_leaves(v)]
    grads = torch.autograd.grad(outs, leaves, dys)

    def ref_fn(x64, *ts):
        it = iter(ts)
        res = []
        for pr, mask in zip((q, k, v), masks):
            args = [next(it) if (t is not None and t.requires_grad) else t for t in (pr.weight, pr.lora_A,
                                                                                        pr.lora_B, pr.bias)]
            args = [a if a is None or a.dtype == F64 else a.to(F64) for a in args]
            res.append(lora_linear_ref(x64, args[0], args[1], args[2], pr.scaling, args[3], mask))
        return res

    x64 = x.detach().to(F64).requires_grad_()
    ts64 = [t.detach().to(F64).requires_grad_() for t in leaves[1:]]
    refs = ref_fn(x64, *ts64)
    ref_grads = torch.autograd.grad(refs, [x64, *ts64], [d.to(F64) for d in dys])
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: a few roundings of O(1) terms
    for name, o, r in zip("qkv", outs, refs):
        assert o.dtype == dtype and rel_err(o, r) <= tol, name
    for i, (g, r, t) in enumerate(zip(grads, ref_grads, leaves)):
        assert g.dtype == t.dtype and rel_err(g, r) <= tol, f"grad {i}: {rel_err(g, r):.3g}"


class _Qkv(nn.Module):
    """Qwen2-style q/k/v projections (biased, GQA widths), outputs concatenated for one comparison."""

    def __init__(self, hidden):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(hidden, 48), nn.Linear(hidden, 16), nn.Linear(hidden, 16)

    def forward(self, x):
        return torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], -1)


@pytest.mark.parametrize("dtype,adapter_fp32", [(torch.float32, False), (LOW, True)], ids=str)
def test_qkv_matches_peft(backend, dtype, adapter_fp32):
    model = _peft(_Qkv(IN), ["q_proj", "k_proj", "v_proj"], 8, 16, dtype, adapter_fp32)
    inner = model.base_model.model
    projs = [_weights(getattr(inner, n)) for n in ("q_proj", "k_proj", "v_proj")]
    x = torch.randn(2, 9, IN, device=DEVICE).to(dtype).requires_grad_()
    names = _names(model)
    assert len(names) == 6
    _compare_with_peft(lambda t: torch.cat(ops.lora_qkv(t, *projs), -1), model, x, names)


def test_qkv_equals_three_linears(backend):
    x = torch.randn(15, IN, device=DEVICE, requires_grad=True)
    projs = [_proj(IN, w, 8, torch.float32, torch.float32, bias=True) for w in (40, 24, 24)]
    outs = ops.lora_qkv(x, *projs)
    singles = [ops.lora_linear(x, *pr) for pr in projs]
    for o, s in zip(outs, singles):
        assert rel_err(o, s) <= 1e-6
    dys = [torch.randn_like(o) for o in outs]
    leaves = [x] + [t for pr in projs for t in _leaves(pr)]
    for a, b in zip(torch.autograd.grad(outs, leaves, dys), torch.autograd.grad(singles, leaves, dys)):
        assert rel_err(a, b) <= 1e-6


# --------------------------------------------------------------------------------------------------------- mlp
def _act_ref(activation):
    if activation == "swiglu":
        return swiglu_ref
    return lambda g, u: geglu_ref(g, u, "tanh" if activation == "geglu_tanh" else "none")


def _mlp_ref(x, gate, up, down, activation, masks):
    act = _act_ref(activation)

    def fn(x64, *ts):
        it = iter(ts)
        args = [[next(it) if (t is not None and t.requires_grad) else t for t in (pr.weight, pr.lora_A, pr.lora_B,
                                                                                  pr.bias)] for pr in (gate, up, down)]
        args = [[a if a is None or a.dtype == F64 else a.to(F64) for a in row] for row in args]
        g = lora_linear_ref(x64, *args[0][:3], gate.scaling, args[0][3], masks[0])
        u = lora_linear_ref(x64, *args[1][:3], up.scaling, args[1][3], masks[1])
        return lora_linear_ref(act(g, u), *args[2][:3], down.scaling, args[2][3], masks[2])
    return fn


@pytest.mark.parametrize("activation", ["swiglu", "geglu_tanh", "geglu_erf"])
@pytest.mark.parametrize("dtype,p,adapter_dtype", [(torch.float32, 0.0, None), (torch.float32, 0.2, None),
                                                   (LOW, 0.0, None), (LOW, 0.2, torch.float32)], ids=str)
def test_mlp_matches_reference(backend, activation, dtype, p, adapter_dtype):
    hidden, inter, rows = IN, 100, 19
    x = torch.randn(rows, hidden, device=DEVICE).to(dtype).requires_grad_()
    ldt = adapter_dtype or dtype
    gate, up = _proj(hidden, inter, 8, dtype, ldt), _proj(hidden, inter, 1, dtype, ldt)
    down = _proj(inter, hidden, 8, dtype, ldt)
    y, seeds = _seeds_of(lambda: ops.lora_mlp(x, gate, up, down, activation=activation, dropout=p), 3 if p else 0)
    assert y.shape == x.shape and y.dtype == dtype
    masks = [None] * 3
    if p:
        masks = [_mask(seeds, 0, rows, hidden, p), _mask(seeds, 1, rows, hidden, p), _mask(seeds, 2, rows, inter, p)]
    dy = torch.randn_like(y)
    leaves = [x] + [t for pr in (gate, up, down) for t in _leaves(pr)]
    fn = _mlp_ref(x, gate, up, down, activation, masks)
    ref, ref_grads = grads64(fn, leaves, dy)
    grads = torch.autograd.grad(y, leaves, dy)
    tol = 1e-5 if dtype == torch.float32 else 3e-2  # bf16: gate/up/h each rounded, as the eager module does
    assert rel_err(y, ref) <= tol, f"y: {rel_err(y, ref):.3g}"
    for i, (g, r, t) in enumerate(zip(grads, ref_grads, leaves)):
        assert g.dtype == t.dtype and g.shape == t.shape
        assert rel_err(g, r) <= tol, f"grad {i}: {rel_err(g, r):.3g}"


def test_mlp_partial_adapters_and_bias(backend):
    """down without adapters, biased gate: still the formula, and the plain projection's seeds are not drawn."""
    x = torch.randn(2, 7, IN, device=DEVICE, requires_grad=True)
    gate, up = _proj(IN, 64, 4, torch.float32, torch.float32, bias=True), _proj(IN, 64, 4, torch.float32,
                                                                                 torch.float32)
    down = _proj(64, IN, 4, torch.float32, torch.float32, lora_on=False)
    y, seeds = _seeds_of(lambda: ops.lora_mlp(x, gate, up, down, dropout=0.1), 2)
    masks = [_mask(seeds, 0, 14, IN, 0.1).view(x.shape), _mask(seeds, 1, 14, IN, 0.1).view(x.shape), None]
    leaves = [x] + [t for pr in (gate, up, down) for t in _leaves(pr)]
    dy = torch.randn_like(y)
    ref, ref_grads = grads64(_mlp_ref(x, gate, up, down, "swiglu", masks), leaves, dy)
    assert rel_err(y, ref) <= 1e-5
    for g, r in zip(torch.autograd.grad(y, leaves, dy), ref_grads):
        assert rel_err(g, r) <= 1e-5


class _Mlp(nn.Module):
    """HF LlamaMLP / GemmaMLP: down(act(gate(x)) * up(x))."""

    def __init__(self, hidden, inter, activation):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.act = {"swiglu": nn.SiLU(), "geglu_tanh": nn.GELU("tanh"), "geglu_erf": nn.GELU()}[activation]

    def forward(self, x):
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


def _peft_mlp(hidden, inter, rank, dtype, adapter_fp32, activation="swiglu"):
    model = _peft(_Mlp(hidden, inter, activation), ["gate_proj", "up_proj", "down_proj"], rank, 2 * rank, dtype,
                  adapter_fp32)
    inner = model.base_model.model
    projs = [_weights(getattr(inner, n)) for n in ("gate_proj", "up_proj", "down_proj")]
    return model, projs


@pytest.mark.parametrize("dtype,adapter_fp32,activation", [(torch.float32, False, "swiglu"),
                                                           (LOW, True, "swiglu"), (LOW, False, "geglu_tanh")],
                         ids=str)
def test_mlp_matches_peft(backend, dtype, adapter_fp32, activation):
    model, projs = _peft_mlp(IN, 100, 8, dtype, adapter_fp32, activation)
    x = torch.randn(2, 9, IN, device=DEVICE).to(dtype).requires_grad_()
    names = _names(model)
    assert len(names) == 6
    _compare_with_peft(lambda t: ops.lora_mlp(t, *projs, activation=activation), model, x, names)


def test_mlp_under_autocast_matches_peft(backend):
    device_type = "cuda" if ON_GPU else "cpu"
    model, projs = _peft_mlp(IN, 100, 8, torch.float32, True)
    x = torch.randn(11, IN, device=DEVICE, requires_grad=True)
    with torch.autocast(device_type, dtype=LOW):
        y_peft = model(x)
        y = ops.lora_mlp(x, *projs)
    assert y.dtype == y_peft.dtype == LOW
    assert rel_err(y, y_peft) <= 3e-2
    dy = torch.randn_like(y)
    leaves = [x, projs[0].lora_A, projs[2].lora_B]
    for a, b in zip(torch.autograd.grad(y, leaves, dy), torch.autograd.grad(y_peft, leaves, dy)):
        assert a.dtype == b.dtype == torch.float32
        assert rel_err(a, b) <= 3e-2


@pytest.mark.parametrize("p", [0.0, 0.2])
def test_mlp_without_output_saves_the_same_for_backward(backend, monkeypatch, p):
    """output=False (a checkpoint's recomputation): the down projection's GEMM is not run, y is only shaped, and a
    backward from that node gives bit for bit the gradients of the node that formed y (same saved tensors, the same
    dropout masks from the same generator state)."""
    calls = []
    frozen = lora.passes._frozen_forward
    monkeypatch.setattr(lora.passes, "_frozen_forward", lambda *a, **k: calls.append(len(a[1])) or frozen(*a, **k))
    projs = [_proj(IN, 32, 2, LOW, torch.float32), _proj(IN, 32, 3, LOW, torch.float32),
             _proj(32, OUT, 2, LOW, torch.float32)]
    x0 = torch.randn(2, 7, IN, device=DEVICE).to(LOW)
    dy = torch.randn(2, 7, OUT, device=DEVICE).to(LOW)
    grads = []
    for output in (True, False):
        torch.manual_seed(1234)  # the dropout seeds: as a checkpoint's recomputation restores the RNG state
        x = x0.clone().requires_grad_()
        calls.clear()
        y = ops.lora_mlp(x, *projs, dropout=p, training=True, output=output)
        assert y.shape == (2, 7, OUT) and y.dtype == LOW
        assert calls == ([2, 1] if output else [2])  # gate/up's GEMMs always; down's only with the output
        leaves = [x] + [t for proj in projs for t in _leaves(proj)]
        grads.append(torch.autograd.grad(y, leaves, dy))
    for with_y, without in zip(*grads):
        assert torch.equal(with_y, without)
    with pytest.raises(ValueError, match="output must be True or False, got 1"):
        ops.lora_mlp(x0, *projs, output=1)


def test_mlp_backward_twice_raises(backend):
    x = torch.randn(5, IN, device=DEVICE, requires_grad=True)
    projs = [_proj(IN, 32, 2, torch.float32, torch.float32), _proj(IN, 32, 2, torch.float32, torch.float32),
             _proj(32, IN, 2, torch.float32, torch.float32)]
    y = ops.lora_mlp(x, *projs).sum()
    y.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="cannot run twice"):
        y.backward()



@pytest.mark.parametrize("p", [0.0, 0.2])
def test_mlp_backward_drops_h_before_dh(backend, monkeypatch, p):
    """The recomputed h is gone when dh is formed (the allocator can hand its block to dh: three [N, intermediate]
    buffers alive, not four) wherever the down projection's gradients can be taken apart from its dx: without
    dropout, and with it where the skinny kernels regenerate the mask (Triton path); the fused masked pass of the
    torch path keeps the old order. The gradients are checked against float64 in test_mlp_matches_reference."""
    made, seen_alive = [], []
    glu_forward, input_grad = lora_api.glu_forward, lora_api.group_input_grad

    def recording_glu_forward(*args):
        h = glu_forward(*args)
        made.append(weakref.ref(h))
        return h

    def checking_input_grad(*args, **kwargs):
        seen_alive.append(made[-1]() is not None)
        return input_grad(*args, **kwargs)

    monkeypatch.setattr(lora_api, "glu_forward", recording_glu_forward)
    monkeypatch.setattr(lora_api, "group_input_grad", checking_input_grad)
    x = torch.randn(13, IN, device=DEVICE).to(LOW).requires_grad_()
    mlp = [_proj(IN, 100, 8, LOW, torch.float32), _proj(IN, 100, 4, LOW, torch.float32),
           _proj(100, IN, 8, LOW, torch.float32)]
    ops.lora_mlp(x, *mlp, dropout=p).sum().backward()
    separable = p == 0 or backend == "triton"
    assert seen_alive == ([False] if separable else [])
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (x, *_leaves(mlp[2])))

# ------------------------------------------------------------------------------------------------- saved bytes
def _saved_bytes(fn, params):
    """Bytes autograd saves during ``fn()``: distinct storages, parameters excluded."""
    skip = {t.untyped_storage().data_ptr() for t in params}
    storages = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in skip:
            storages[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(storages.values()), out


@pytest.mark.parametrize("adapter_fp32", [False, True])
def test_saved_bytes_mlp(backend, adapter_fp32):
    hidden, inter, rank, rows = 64, 176, 4, 24
    dtype = torch.float32 if not adapter_fp32 else LOW
    model, projs = _peft_mlp(hidden, inter, rank, dtype, adapter_fp32)
    params = list(model.parameters())
    x = torch.randn(rows, hidden, device=DEVICE).to(dtype).requires_grad_()
    ours, y = _saved_bytes(lambda: ops.lora_mlp(x, *projs), params)
    peft, _ = _saved_bytes(lambda: model(x), params)
    elt = x.element_size()
    small = 3 * rows * rank * 4  # the [N, r] xa's (fp32 at most)
    assert ours <= rows * (hidden + 2 * inter) * elt + small
    assert ours >= rows * (hidden + 2 * inter) * elt  # x, gate and up really are what is kept
    if not adapter_fp32:  # PEFT also keeps act(gate) and h: ratio (H + 2I) / (H + 4I) up to the [N, r] terms
        expected = (hidden + 2 * inter) / (hidden + 4 * inter)
        assert abs(ours - expected * peft) <= 2 * small, (ours, peft, expected)
    else:  # PEFT keeps fp32 copies of x and h for the adapters on top
        assert ours <= 0.55 * peft
    y.sum().backward()


def test_saved_bytes_qkv_and_linear(backend):
    hidden, rows = 64, 20
    x = torch.randn(rows, hidden, device=DEVICE, requires_grad=True)
    projs = [_proj(hidden, w, 8, torch.float32, torch.float32, bias=True) for w in (64, 16, 16)]
    params = [t for pr in projs for t in (pr.weight, pr.lora_A, pr.lora_B, pr.bias)]
    ours, _ = _saved_bytes(lambda: ops.lora_qkv(x, *projs), params)
    assert rows * hidden * 4 <= ours <= rows * hidden * 4 + 3 * rows * 8 * 4
    ours_p, _ = _saved_bytes(lambda: ops.lora_qkv(x, *projs, dropout=0.1), params)
    assert ours_p <= rows * hidden * 4 + 3 * rows * 8 * 4 + 64  # masks are not stored: seeds only
    one, _ = _saved_bytes(lambda: ops.lora_linear(x, *projs[0], dropout=0.1), params)
    assert one <= rows * hidden * 4 + rows * 8 * 4 + 64

    model = _peft(nn.ModuleDict({"q": nn.Linear(hidden, 64), "k": nn.Linear(hidden, 16),
                                 "v": nn.Linear(hidden, 16)}), ["q", "k", "v"], 8, 16, torch.float32, False)
    inner = model.base_model.model
    peft, _ = _saved_bytes(lambda: [inner[n](x) for n in "qkv"], list(model.parameters()))
    assert ours <= peft


# ------------------------------------------------------------------------------------------------------- errors
def _bad_calls():
    x = torch.randn(4, IN, device=DEVICE)
    w, a, b = torch.randn(OUT, IN, device=DEVICE), torch.randn(8, IN, device=DEVICE), torch.randn(OUT, 8, device=DEVICE)
    good = lora.LoraWeights(w, a, b, 1.0)
    mlp = [lora.LoraWeights(torch.randn(32, IN, device=DEVICE), None, None, 1.0),
           lora.LoraWeights(torch.randn(32, IN, device=DEVICE), None, None, 1.0),
           lora.LoraWeights(torch.randn(IN, 32, device=DEVICE), None, None, 1.0)]
    return [
        (lambda: ops.lora_linear(x, w[:, 1:], a, b, 1.0), r"weight must have shape"),
        (lambda: ops.lora_linear(x, w, a[:, 1:], b, 1.0), r"lora_A must have shape"),
        (lambda: ops.lora_linear(x, w, a, b[:, 1:], 1.0), r"lora_B must have shape"),
        (lambda: ops.lora_linear(x, w, a, b, 1.0, torch.randn(OUT + 1, device=DEVICE)), r"bias must have shape"),
        (lambda: ops.lora_linear(x, w, a, None, 1.0), r"both be tensors or both be None"),
        (lambda: ops.lora_linear(x, w, a, b.double(), 1.0), r"lora_B must be float32"),
        (lambda: ops.lora_linear(x, w, a, b.half(), 1.0), r"must share a dtype"),
        (lambda: ops.lora_linear(x.long(), w, a, b, 1.0), r"x must be float32"),
        (lambda: ops.lora_linear(x, w, a, b, "1"), r"scaling must be a real number"),
        (lambda: ops.lora_linear(x, w, a, b, 1.0, dropout=1.0), r"dropout must be a float in \[0, 1\)"),
        (lambda: ops.lora_linear(x, w, a, b, 1.0, dropout=-0.1), r"dropout must be a float in \[0, 1\)"),
        (lambda: ops.lora_linear(x, w.to("meta"), a, b, 1.0), r"one device"),
        (lambda: ops.lora_qkv(x, good, good._replace(lora_A=a[:, 1:]), good), r"k\.lora_A must have shape"),
        (lambda: ops.lora_qkv(x, good, good, good._replace(weight=w.half())), r"weights must share a dtype"),
        (lambda: ops.lora_qkv(x, good, good, (w,)), r"v must be a LoraWeights"),
        (lambda: ops.lora_mlp(x, *mlp[:2], mlp[2]._replace(weight=torch.randn(IN, 31, device=DEVICE))),
         r"down\.weight must have"),
        (lambda: ops.lora_mlp(x, mlp[0], mlp[1]._replace(weight=torch.randn(31, IN, device=DEVICE)), mlp[2]),
         r"same rows"),
        (lambda: ops.lora_mlp(x, *mlp, activation="relu"), r"activation must be one of"),
        # NaN scaling once made the forward act as s = 1 while the gradients were NaN
        (lambda: ops.lora_linear(x, w, a, b, float("nan")), r"scaling must be finite"),
        (lambda: ops.lora_linear(x, w, a, b, 1e400), r"scaling must be finite"),
        (lambda: ops.lora_linear(x, w, a, b, 10**400), r"scaling must be finite"),
        (lambda: ops.lora_qkv(x, good, good, good._replace(scaling=float("inf"))), r"v\.scaling must be finite"),
        (lambda: ops.lora_linear(x, w, a, b, 1.0, dropout=0.5, training="no"), r"training must be True or False"),
        (lambda: ops.lora_linear(x[:, :0], w[:, :0], a[:, :0], b, 1.0), r"weight must have out >= 1 and in >= 1"),
        (lambda: ops.lora_linear(x, w[:0], a, b[:0], 1.0), r"weight must have out >= 1 and in >= 1"),
    ]


@pytest.mark.parametrize("index", range(25))
def test_errors(index):
    call, match = _bad_calls()[index]
    with pytest.raises(ValueError, match=match):
        call()


# ------------------------------------------------------------------------------------------ skinny Triton kernels
# Small blocks so the interpreter's tiny shapes still take several row tiles, split-K/split-M partials and tails.
SMALL = dict(block_m=16, block_k=32)


@pytest.mark.parametrize("rank", [1, 8, 16, 64, 100])  # 100: wider than one rank tile, run in chunks
@pytest.mark.parametrize("factor_dtype", [torch.float32, LOW], ids=str)
def test_skinny_kernels_match_float64(monkeypatch, rank, factor_dtype):
    """C = s (m*A) @ B and C = s P^T @ (m*X) for bf16/fp16/fp32 activations read as stored (no upcast copy), with
    and without the dropout mask (drawn in registers: must equal dropout_mask), both precisions."""
    monkeypatch.setenv("LEANTUNE_BACKEND", "triton")
    rows, width, p, seed = 37, 150, 0.3, 12345
    mask = lora.dropout_mask(seed, (rows, width), p, DEVICE).to(F64)
    seeds = torch.tensor([7, seed], device=DEVICE)
    cases = [(LOW, "auto")]
    if rank == 16:  # every activation dtype and both precisions at one rank (interpreter time)
        cases += [(torch.float16, "auto"), (torch.float32, "auto"), (LOW, "ieee")]
    for act_dtype, precision in cases:
        a = torch.randn(rows, width, device=DEVICE).to(act_dtype)
        b = torch.randn(rank, width, device=DEVICE).to(factor_dtype)  # lora_A layout: the kernel reads b.T
        lhs = torch.randn(rows, rank, device=DEVICE).to(factor_dtype)
        for drop in (False, True):
            m = mask if drop else 1.0
            kw = dict(seeds=seeds, index=1, p=p) if drop else {}
            c = kernels.skinny_matmul(a, b.T, 0.5, precision=precision, **SMALL, **kw)
            assert c.dtype == torch.float32 and c.shape == (rows, rank)
            assert rel_err(c, 0.5 * (a.to(F64) * m) @ b.to(F64).T) <= 1e-6, (act_dtype, precision, drop)
            t = kernels.skinny_tn(lhs, a, 2.0, precision=precision, **SMALL, **kw)
            assert t.dtype == torch.float32 and t.shape == (rank, width)
            assert rel_err(t, 2.0 * lhs.to(F64).T @ (a.to(F64) * m)) <= 1e-6, (act_dtype, precision, drop)


def test_skinny_kernels_strided_outputs_and_splits(monkeypatch):
    """dB's transposed output view, out-dtype casts, a strided factor slice, one split and many; empty shapes."""
    monkeypatch.setenv("LEANTUNE_BACKEND", "triton")
    x = torch.randn(23, 70, device=DEVICE).to(LOW)
    xa_cat = torch.randn(23, 12, device=DEVICE)
    xa = xa_cat[:, 4:9]  # a column slice of the concatenated xa (row stride 12)
    ref = 3.0 * xa.double().T @ x.double()
    for per_sm, block_m in ((1, 64), (4, 16)):  # splits == 1 writes the view directly; > 1 sums partials
        d_b = torch.full((70, 5), float("nan"), device=DEVICE)
        out = kernels.skinny_tn(xa, x, 3.0, out=d_b.T, block_m=block_m, block_k=32, per_sm=per_sm)
        assert out.data_ptr() == d_b.data_ptr()
        assert rel_err(d_b.T, ref) <= 1e-6
    factor = torch.randn(70, 12, device=DEVICE)[:, 4:9]  # strided factor, bf16 result cast once
    c = kernels.skinny_matmul(x, factor, out_dtype=LOW, **SMALL)
    assert c.dtype == LOW and rel_err(c, x.double() @ factor.double()) <= 1e-2
    assert kernels.skinny_matmul(x[:0], torch.randn(70, 4, device=DEVICE)).shape == (0, 4)
    assert torch.equal(kernels.skinny_tn(torch.randn(0, 4, device=DEVICE), x[:0]), torch.zeros(4, 70, device=DEVICE))
    with pytest.raises(ValueError, match="precision must be"):
        kernels.skinny_matmul(x, torch.randn(70, 4, device=DEVICE), precision="tf32")


class _CopyRecorder(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the shapes of dtype conversions (aten._to_copy) that run inside the block."""

    def __init__(self):
        super().__init__()
        self.copies = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and "dtype" in (kwargs or {}):
            self.copies.append(tuple(args[0].shape))
        return out


@pytest.mark.parametrize("p", [0.0, 0.2])
def test_triton_path_makes_no_activation_dtype_copies(monkeypatch, p):
    """fp32 adapters under a bf16 base (PEFT's default): neither x, h nor any dY is converted to fp32 as a whole
    tensor on the Triton path (the skinny kernels upcast tiles in registers); the result is still the formula."""
    monkeypatch.setenv("LEANTUNE_BACKEND", "triton")
    rows, inter = 19, 100
    x = torch.randn(rows, IN, device=DEVICE).to(LOW).requires_grad_()
    projs = [_proj(IN, 48, 8, LOW, torch.float32), _proj(IN, 16, 4, LOW, torch.float32),
             _proj(IN, 16, 4, LOW, torch.float32)]
    mlp = [_proj(IN, inter, 8, LOW, torch.float32), _proj(IN, inter, 4, LOW, torch.float32),
           _proj(inter, IN, 8, LOW, torch.float32)]
    big = {(rows, IN), (rows, inter), (rows, 48), (rows, 16)}
    with _CopyRecorder() as rec:
        outs = ops.lora_qkv(x, *projs, dropout=p)
        y = ops.lora_mlp(x, *mlp, dropout=p)
        torch.autograd.backward([*outs, y], [torch.randn_like(o) for o in (*outs, y)])
    assert not big & set(rec.copies), f"activation-sized dtype copies: {sorted(big & set(rec.copies))}"
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (x, *_leaves(mlp[0]), *_leaves(projs[0])))


def test_mlp_fuses_lowrank_into_glu_on_triton(monkeypatch):
    """With adapters on gate and up, the Triton path adds their B terms inside the GLU pass (glu_forward and the
    per-projection low-rank add are not called in forward); the result is the float64 formula."""
    monkeypatch.setenv("LEANTUNE_BACKEND", "triton")
    calls = []
    glu_forward = lora_api.glu_forward
    monkeypatch.setattr(lora_api, "glu_forward", lambda *a: calls.append("glu_forward") or glu_forward(*a))
    for rank, ldt in ((64, torch.float32), (16, LOW)):
        x = torch.randn(2, 9, IN, device=DEVICE).to(LOW).requires_grad_()
        gate, up, down = _proj(IN, 100, rank, LOW, ldt), _proj(IN, 100, 1, LOW, ldt), _proj(100, IN, 8, LOW, ldt)
        calls.clear()
        y = ops.lora_mlp(x, gate, up, down, activation="geglu_tanh")
        assert calls == [], "forward must not call glu_forward on the fused path"
        leaves = [x] + [t for pr in (gate, up, down) for t in _leaves(pr)]
        dy = torch.randn_like(y)
        ref, ref_grads = grads64(_mlp_ref(x, gate, up, down, "geglu_tanh", [None] * 3), leaves, dy)
        assert rel_err(y, ref) <= 3e-2
        for g, r in zip(torch.autograd.grad(y, leaves, dy), ref_grads):
            assert rel_err(g, r) <= 3e-2
        assert calls == ["glu_forward"]  # backward recomputes h from the saved (already summed) gate/up


@pytest.mark.parametrize("adapter_dtype", [torch.float32, torch.bfloat16])
def test_dropout_keeps_non_finite_inputs_non_finite_as_peft(backend, adapter_dtype):
    """The Triton kernels once zeroed dropped elements by selection, so a NaN row of x reached only
    the kept columns of dA, where PEFT's dropout multiplies (NaN * 0 = NaN) and the torch path agreed with PEFT."""
    n, d_in, d_out, r, p = 6, 40, 32, 8, 0.3
    x = torch.randn(n, d_in, device=DEVICE, dtype=torch.bfloat16)
    x[2] = float("nan")
    x.requires_grad_()
    w = torch.randn(d_out, d_in, device=DEVICE, dtype=torch.bfloat16)
    a = torch.randn(r, d_in, device=DEVICE, dtype=adapter_dtype, requires_grad=True)
    b = torch.randn(d_out, r, device=DEVICE, dtype=adapter_dtype, requires_grad=True)
    y, seeds = _seeds_of(lambda: ops.lora_linear(x, w, a, b, 0.5, dropout=p), 1)
    d_a, d_x = torch.autograd.grad(y, (a, x), torch.ones_like(y))
    m = _mask(seeds, 0, n, d_in, p)
    ref = x.detach().double() * m.double()  # PEFT: dropout(x) = x * mask / (1 - p)
    ref_y = x.detach().double() @ w.double().T + 0.5 * (ref @ a.detach().double().T) @ b.detach().double().T
    ref_da = 0.5 * (torch.ones_like(ref_y) @ b.detach().double()).T @ ref
    assert torch.equal(torch.isfinite(y), torch.isfinite(ref_y))
    assert torch.equal(torch.isfinite(d_a), torch.isfinite(ref_da))  # every entry: a NaN row meets every column
    assert torch.isfinite(d_x[[0, 1, 3, 4, 5]]).all()  # the bad row's dX stays in its row
