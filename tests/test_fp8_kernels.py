"""FP8 Triton kernels (ops/fp8.py): the per-row quantisation kernel and the e4m3 weight transpose, bit for bit
against the torch path (``_quantize_rows_torch``, the reference, itself checked against the e4m3 rounding rule in
tests/test_fp8.py) on the same device. Triton backend: the interpreter here, the card unchanged (conftest.DEVICE).
Outputs come from the NaN-poisoning allocator (conftest), so an element a kernel forgot to write shows up."""

import os
import subprocess
import sys

import pytest
import torch
from conftest import DEVICE, ON_GPU

from leantune import ops
from leantune.ops import fp8, fp8_group

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@pytest.fixture(autouse=True)
def triton_backend(monkeypatch):
    monkeypatch.setenv("LEANTUNE_BACKEND", "triton")


def assert_same_quantisation(got, ref, what=""):
    """Codes and scales equal bit for bit; NaN where the reference has NaN (a NaN's sign and payload are not part
    of the contract: torch on the CPU keeps an operand's NaN, the card makes a canonical one)."""
    (q, s), (q_ref, s_ref) = got, ref
    assert q.dtype == fp8.E4M3 and q.shape == q_ref.shape and s.dtype == torch.float32 and s.shape == s_ref.shape
    assert q.device == q_ref.device and s.device == s_ref.device
    nan_q, nan_s = q_ref.float().isnan(), s_ref.isnan()
    assert torch.equal(q.float().isnan(), nan_q), f"{what}: NaN codes in other places"
    assert torch.equal(s.isnan(), nan_s), f"{what}: NaN scales in other places"
    bits, bits_ref = q.view(torch.uint8)[~nan_q], q_ref.view(torch.uint8)[~nan_q]
    assert torch.equal(bits, bits_ref), f"{what}: {(bits != bits_ref).sum().item()} codes differ"
    assert torch.equal(s[~nan_s], s_ref[~nan_s]), f"{what}: {(s[~nan_s] != s_ref[~nan_s]).sum().item()} scales differ"


def random_rows(shape, dtype):
    """Rows of very different magnitudes (1e-3 .. 1e3), in ``dtype``, on DEVICE."""
    t = torch.randn(shape) * torch.logspace(-3, 3, shape[0])[:, None]
    return t.to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (7, 100), (9, 4099), (5, fp8.QUANT_ONE_BLOCK + 1),
                                   (3, fp8.MAX_ONE_BLOCK + 9), (2, 0), (0, 5)])
def test_quantize_rows_kernel_is_the_torch_quantisation_bit_for_bit(dtype, shape):
    t = random_rows(shape, dtype)
    assert_same_quantisation(fp8.quantize_rows(t), fp8._quantize_rows_torch(t), f"{dtype} {shape}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_column_block_loop_with_a_partial_last_block(dtype):
    """Rows wider than the block: two passes over 64-column blocks, the last one 44 wide."""
    t = random_rows((5, 300), dtype)
    assert_same_quantisation(fp8._quantize_rows_triton(t, block=64, rows=2), fp8._quantize_rows_torch(t))


def e4m3_values():
    """Every finite e4m3 value >= 0 and the midpoints between neighbours with their fp32 neighbours (ties go to
    the even code), as fp32: the rounding rule's hard cases, quantised as themselves in a row whose absmax is 448
    (scale 448 / 448 = 1)."""
    codes = torch.arange(0, 127, dtype=torch.uint8).view(fp8.E4M3).float()  # 0 .. 448
    mid = (codes[:-1] + codes[1:]) / 2  # exact in fp32
    up, down = torch.nextafter(mid, torch.tensor(1e9)), torch.nextafter(mid, torch.tensor(0.0))
    tiny = torch.tensor([2.0 ** -10, 2.0 ** -10 * (1 + 2 ** -23), 3 * 2.0 ** -10, 15 * 2.0 ** -10, 2.0 ** -20, 0.0])
    return torch.cat([codes, mid, up, down, tiny])


def test_rounding_ties_subnormal_codes_and_saturation():
    v = e4m3_values()
    n = v.numel()
    rows = torch.zeros(6, n + 1)
    rows[0, 0], rows[0, 1:] = 448.0, v  # scale exactly 1: codes of the values themselves
    rows[1, 0], rows[1, 1:] = -448.0, -v  # the negative side (-0.0 included)
    rows[2, 0], rows[2, 1:] = 448.0 * 3.0, v * 3.0  # scale 3: quotients rounded in fp32 first
    rows[3] = 448.0 * 2.0 ** -20 * torch.linspace(-1, 1, n + 1)  # a small scale: quotients on the subnormal codes
    rows[4, 0], rows[4, 1:] = 3.0e38, torch.linspace(-3.0e38, 3.0e38, n)  # huge values, quotients near +-448
    rows[5, 0], rows[5, 1] = 448.0 * (1 + 2.0 ** -23), -1.0  # a quotient that would round past 448 unclamped
    t = rows.to(DEVICE)
    ref = fp8._quantize_rows_torch(t)
    assert ref[1][0] == 1.0 and ref[0][0, 1:].view(torch.uint8).tolist()[:127] == list(range(127))
    assert_same_quantisation(fp8.quantize_rows(t), ref, "hard cases")


@pytest.mark.filterwarnings("ignore:invalid value encountered")  # numpy's inf / inf in the interpreter
@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_nan_inf_rows_and_boundaries(dtype):
    t = random_rows((8, 37), torch.float32)
    t[0] = 0.0  # scale floor 2^-126, codes 0
    t[1, 3] = float("nan")  # NaN row: NaN scale, NaN codes
    t[2, 5] = float("inf")  # inf row: inf scale, NaN where inf / inf, zeros (of each sign) elsewhere
    t[3, 0], t[3, 1] = float("-inf"), float("nan")
    t[4] = 448.0 * torch.linspace(-1, 1, 37)  # scale exactly 1: codes hit the grid, +-448 at the ends
    t[5, :3] = torch.tensor([1e-4, -2e-5, 3e-6])  # codes in e4m3's subnormal range against the row's absmax
    t[6] = -0.0
    t = t.to(dtype)
    ref = fp8._quantize_rows_torch(t)
    assert ref[1][1].isnan() and ref[1][2].isinf() and ref[1][0] == 2.0 ** -126
    assert_same_quantisation(fp8.quantize_rows(t), ref, str(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_inputs(dtype):
    """Rows of a wider buffer (row stride > C), a column-strided view and a transposed one."""
    base = random_rows((9, 70), dtype)
    for t in (base[1:8, 3:60], base[:, ::3], base.t()[:20]):
        assert not t.is_contiguous()
        assert_same_quantisation(fp8.quantize_rows(t), fp8._quantize_rows_torch(t.contiguous()), str(t.stride()))


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_grad_output_quantisation_is_the_fp32_product_quantised(dtype):
    """g = dY diag(s_w) formed inside the kernel: the codes of quantize_rows(dy.float() * scale), bit for bit."""
    scale = torch.rand(4099, device=DEVICE) * 1e-2 + 1e-4  # a weight of out = 4099 (its codes are not read)
    w = ops.FP8Weight(torch.zeros(4099, 2, dtype=fp8.E4M3, device=DEVICE), scale, torch.bfloat16)
    dy = random_rows((6, 4099), dtype)
    dy[1, 7] = float("nan")
    got = fp8.quantize_grad_output(dy, w)
    assert_same_quantisation(got, fp8._quantize_rows_torch(dy.float() * w.scale[None, :]), str(dtype))
    w2 = ops.quantize_fp8(torch.randn(300, 4).to(DEVICE))
    dy2 = random_rows((9, 600), dtype)[:, ::2]  # strided rows, and the column loop
    assert_same_quantisation(fp8._quantize_rows_triton(dy2, w2.scale, block=128),
                             fp8._quantize_rows_torch(dy2.float() * w2.scale[None, :]), "loop")


def test_grad_input_on_the_triton_backend_equals_the_torch_backend(monkeypatch):
    """dX through the fused dY quantisation equals the torch chain's. Dims not multiples of 16: both backends take
    the emulated GEMM (on the card too), so the results compare exactly."""
    w = ops.quantize_fp8(torch.randn(40, 36).to(DEVICE))
    dy = torch.randn(5, 40, device=DEVICE, dtype=torch.bfloat16)
    got = fp8.fp8_grad_input(dy, w, out_dtype=torch.float32)
    monkeypatch.setenv("LEANTUNE_BACKEND", "torch")
    ref = fp8.fp8_grad_input(dy, w, out_dtype=torch.float32)
    assert torch.equal(got, ref)


def test_each_backend_takes_its_own_path(monkeypatch):
    t = torch.randn(3, 8, device=DEVICE)
    w = ops.quantize_fp8(torch.randn(8, 4).to(DEVICE))

    def fail(*args, **kwargs):
        raise AssertionError("wrong path")

    monkeypatch.setattr(fp8, "_quantize_rows_torch", fail)
    fp8.quantize_rows(t), fp8.quantize_grad_output(t, w), fp8._transposed(w)
    monkeypatch.undo()
    monkeypatch.setenv("LEANTUNE_BACKEND", "torch")
    monkeypatch.setattr(fp8, "_quantize_rows_triton", fail)
    monkeypatch.setattr(fp8, "_transpose_kernel", None)  # a launch would raise TypeError
    fp8.quantize_rows(t), fp8.quantize_grad_output(t, w), fp8._transposed(w)


@pytest.mark.parametrize("shape", [(150, 130), (16, 48), (1, 1)])
def test_transpose_kernel_writes_every_byte_of_the_workspace(shape):
    w = ops.quantize_fp8(torch.randn(shape).to(DEVICE))
    fp8._transposed_workspaces.pop((w.shape, w.device), None)  # a fresh, NaN-poisoned workspace
    out = fp8._transposed(w)
    assert out.shape == shape[::-1] and out.is_contiguous() and out.dtype == fp8.E4M3
    assert torch.equal(out.view(torch.uint8), w.qweight.view(torch.uint8).t())
    small = fp8._transposed_workspaces.pop((w.shape, w.device))
    fp8._transposed_workspaces[(w.shape, w.device)] = small.fill_(float("nan"))
    assert fp8._transposed(w, block=32, num_warps=4) is small  # the reused workspace, rewritten in 32 x 32 tiles
    assert torch.equal(small.view(torch.uint8), w.qweight.view(torch.uint8).t())
    fp8._transposed_workspaces.pop((w.shape, w.device))


def scale_only_weight(n_out, n_in=2):
    """An FP8Weight of random row scales (codes zero: the quantisation kernels read only the scales)."""
    scale = torch.rand(n_out, device=DEVICE) * 1e-2 + 1e-4
    return ops.FP8Weight(torch.zeros(n_out, n_in, dtype=fp8.E4M3, device=DEVICE), scale, torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("widths", [(48, 16, 16), (40, 40), (300, 100, 100), (9000, 200), (5000, 1000, 1000)])
def test_group_quantisation_kernel_is_the_torch_quantisation_of_the_side_by_side_products(dtype, widths):
    """One scale a row over 2 or 3 parts: in registers (sum of block widths <= QUANT_ONE_BLOCK) or looped over
    LOOP_BLOCK columns (the last two shapes); parts of magnitudes 10^-3 .. 10^3 apart, a strided part, an all-zero
    row, a NaN in one part (the whole row NaN) and an inf."""
    ws = [scale_only_weight(n) for n in widths]
    dys = [random_rows((7, n), dtype) * 10.0 ** (3 * k - 3) for k, n in enumerate(widths)]
    dys[-1] = random_rows((7, 2 * widths[-1]), dtype)[:, ::2]  # a strided part
    for dy in dys:
        dy[0] = 0.0
    dys[1][2, 3] = float("nan")
    dys[0][4, 1] = float("inf")
    ref = fp8._quantize_rows_torch(torch.cat([dy.float() * w.scale[None, :] for dy, w in zip(dys, ws)], dim=1))
    got = fp8_group.quantize_grad_outputs(dys, ws)
    assert ref[1][2].isnan() and ref[1][0] == 2.0 ** -126
    assert_same_quantisation(got, ref, f"{dtype} {widths}")
    empty = fp8_group.quantize_grad_outputs([dy[:0] for dy in dys], ws)
    assert empty[0].shape == (0, sum(widths)) and empty[1].shape == (0,)


def test_grouped_grad_input_on_the_triton_backend_equals_the_torch_backend(monkeypatch):
    """The group's dX through the parts kernel and the stacked transposed codes equals the torch chain's; then
    the workspace [Wq_1; Wq_2; Wq_3]^T, made by the transpose kernel into column blocks of a NaN-poisoned
    workspace, holds every byte."""
    ws = [ops.quantize_fp8(torch.randn(n, 36).to(DEVICE)) for n in (40, 24, 24)]
    dys = [torch.randn(5, n, device=DEVICE, dtype=torch.bfloat16) for n in (40, 24, 24)]
    got = fp8_group.fp8_grad_input_group(dys, ws, out_dtype=torch.float32)
    monkeypatch.setenv("LEANTUNE_BACKEND", "torch")
    ref = fp8_group.fp8_grad_input_group(dys, ws, out_dtype=torch.float32)
    assert torch.equal(got, ref)
    monkeypatch.setenv("LEANTUNE_BACKEND", "triton")
    key = (tuple(w.shape for w in ws), ws[0].device)
    fp8._transposed_workspaces.pop(key, None)
    out = fp8_group._transposed_group(ws)
    assert out.shape == (36, 88) and out.is_contiguous() and fp8_group._transposed_group(ws) is out
    assert torch.equal(out.view(torch.uint8), torch.cat([w.qweight for w in ws]).view(torch.uint8).t())
    block = fp8._runtime.empty((130, 300), dtype=fp8.E4M3, device=DEVICE).fill_(float("nan"))
    w = ops.quantize_fp8(torch.randn(150, 130).to(DEVICE))
    fp8._transpose_into(block[:, 100:250], w, block=32, num_warps=4)  # a column block: row stride 300
    assert torch.equal(block[:, 100:250].view(torch.uint8), w.qweight.view(torch.uint8).t())
    assert block[:, :100].float().isnan().all() and block[:, 250:].float().isnan().all()  # nothing outside
    fp8._transposed_workspaces.pop(key)


def test_group_backends_take_their_own_path(monkeypatch):
    ws = [scale_only_weight(n, 4) for n in (8, 8)]
    dys = [torch.randn(3, 8, device=DEVICE) for _ in ws]

    def fail(*args, **kwargs):
        raise AssertionError("wrong path")

    monkeypatch.setattr(fp8_group, "_quantize_rows_torch", fail)
    fp8_group.quantize_grad_outputs(dys, ws)
    monkeypatch.undo()
    monkeypatch.setenv("LEANTUNE_BACKEND", "torch")
    monkeypatch.setattr(fp8_group, "_quantize_parts_kernel", None)  # a launch would raise TypeError
    fp8_group.quantize_grad_outputs(dys, ws)


def test_bad_arguments_raise_before_any_kernel():
    w = ops.quantize_fp8(torch.randn(8, 4).to(DEVICE))
    with pytest.raises(ValueError, match="x must be a 2-D"):
        fp8.quantize_rows(torch.ones(2, 3, 4, device=DEVICE))
    with pytest.raises(ValueError, match="act must be a 2-D"):
        fp8.quantize_rows(torch.ones(2, 3, dtype=torch.int32, device=DEVICE), name="act")
    with pytest.raises(ValueError, match="dY must be a 2-D"):
        fp8.fp8_grad_input(torch.ones(8, device=DEVICE), w, out_dtype=torch.float32)
    with pytest.raises(ValueError, match="dY must have 8 columns"):
        fp8.quantize_grad_output(torch.ones(3, 4, device=DEVICE), w)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_fp32_subnormal_inputs(dtype):
    """Rows whose values are fp32 subnormals (< 2^-126) or whose scale is tiny enough that such values get codes:
    where flush-to-zero arithmetic would differ (module docstring). Exact in the interpreter (numpy is IEEE); on
    the card this is the check that the kernel's fp32 division and product keep subnormals."""
    t = torch.zeros(3, 40)
    t[0] = torch.linspace(-1, 1, 40) * 2.0 ** -130  # all subnormal: scale floor, codes t * 2^126
    t[1] = torch.linspace(-1, 1, 40) * 448.0 * 2.0 ** -120  # normal absmax, subnormal small entries with codes
    t[2, 0], t[2, 1:] = 448.0 * 2.0 ** -118, 3 * 2.0 ** -127  # scale 2^-118: code 3 (3 * 2^-9)
    t = t.to(dtype).to(DEVICE)  # bf16 has fp32's exponent range: the same values are bf16 subnormals
    ref = fp8._quantize_rows_torch(t)
    assert ref[0][0].view(torch.uint8).ne(0).any() and ref[0][2, 1].view(torch.uint8) != 0
    assert_same_quantisation(fp8.quantize_rows(t), ref, "fp32 subnormals" + (" on the card" if ON_GPU else ""))
    w = ops.quantize_fp8(torch.ones(40, 4).to(DEVICE))  # scales 1 / 448: products g = dy / 448 subnormal
    dy = torch.linspace(-1, 1, 80).reshape(2, 40).to(DEVICE) * 2.0 ** -120
    assert_same_quantisation(fp8.quantize_grad_output(dy, w), fp8._quantize_rows_torch(dy * w.scale[None, :]),
                             "subnormal products")


SM90_CHECK = r"""
import json, os, re, subprocess, tempfile, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from leantune.ops import fp8, fp8_group

def compile_sm90(kernel, signature, constexprs, aligned, num_warps):
    src = ASTSource(fn=getattr(kernel, "fn", kernel), signature=signature, constexprs=constexprs,
                    attrs={(i,): [["tt.divisibility", 16]] for i in aligned})  # what a launch at 4096 specialises
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps}).asm["ptx"]
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    info = subprocess.run([ptxas, "--gpu-name", "sm_90a", "-v", f.name, "-o", os.devnull], capture_output=True,
                          text=True).stderr
    os.unlink(f.name)
    return sorted(set(re.findall(r"\b(?:div|mul|abs|max|min|cvt|ld\.global|st\.global)\.[A-Za-z0-9.]+", ptx))), info

quant = {"T": "*i16", "M": "*fp32", "Q": "*u8", "S": "*fp32", "stride_row": "i32", "stride_col": "constexpr",
         "n_rows": "i32", "n_cols": "i32", "BF16_BITS": "constexpr", "HAS_MULTIPLIER": "constexpr",
         "BLOCK": "constexpr", "ROWS": "constexpr", "ONE_BLOCK": "constexpr"}
out = {}
for name, fp32, one in (("bf16 dY one block", False, True), ("fp32 loop", True, False)):
    sig = dict(quant, T="*fp32") if fp32 else quant
    out[name] = compile_sm90(fp8._quantize_rows_kernel, sig, {"stride_col": 1, "BF16_BITS": not fp32,
                             "HAS_MULTIPLIER": not fp32, "BLOCK": 4096, "ROWS": 1, "ONE_BLOCK": one},
                             (0, 1, 2, 3, 4, 6, 7), 8)
parts = {}  # in the kernel's argument order (attrs name arguments by position)
for name in fp8_group._quantize_parts_kernel.fn.arg_names:
    parts[name] = ("*i16" if name[0] == "T" else "*fp32" if name[0] in "MS" else "*u8" if name == "Q" else
                   "constexpr" if name.startswith("stride_col") or name.isupper() or name[0].isupper() else "i32")
for name, one, blocks in (("q/k/v dY one block", True, (4096, 1024, 1024)),
                          ("gate/up dY loop", False, (2048, 2048, 2048))):
    out[name] = compile_sm90(fp8_group._quantize_parts_kernel, parts, {
        "stride_col0": 1, "stride_col1": 1, "stride_col2": 1, "BF16_BITS": True, "PARTS": 3 if one else 2,
        "BLOCK0": blocks[0], "BLOCK1": blocks[1], "BLOCK2": blocks[2], "ROWS": 1 if one else 2, "ONE_BLOCK": one},
        [i for i, n in enumerate(parts) if parts[n] != "constexpr"], 8 if one else 4)
out["h codes from tile absmaxes"] = compile_sm90(fp8._quantize_rows_absmax_kernel, {
    "T": "*i16", "A": "*fp32", "Q": "*u8", "S": "*fp32", "stride_row": "i32", "n_rows": "i32", "n_cols": "i32",
    "n_parts": "i32", "BF16_BITS": "constexpr", "BLOCK": "constexpr", "ROWS": "constexpr", "PARTS": "constexpr"},
    {"BF16_BITS": True, "BLOCK": 2048, "ROWS": 2, "PARTS": 128}, (0, 1, 2, 3, 4, 5, 6, 7), 4)
out["transpose"] = compile_sm90(fp8._transpose_kernel, {"W": "*u8", "WT": "*u8", "n_rows": "i32", "n_cols": "i32",
                                "stride_out": "i32", "BLOCK_R": "constexpr", "BLOCK_C": "constexpr"},
                                {"BLOCK_R": 128, "BLOCK_C": 128}, (0, 1, 2, 3, 4), 8)
print(json.dumps(out))
"""


def test_sm90_code_is_ieee_and_vectorised():
    """The kernels compiled for sm_90 (Triton's compiler and ptxas, no GPU needed; a fresh process, since this one
    interprets): IEEE fp32 division, product and abs (no flush-to-zero, no approximate divide), NaN-propagating
    max, the hardware e4m3 conversion (round to nearest even, saturating), 128-bit global loads and stores, no
    spills. What the interpreter cannot show about the card's code."""
    import json

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    done = subprocess.run([sys.executable, "-c", SM90_CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    for name, (ops_, info) in found.items():
        assert "ld.global.v4.b32" in ops_ and "st.global.v4.b32" in ops_, (name, ops_)
        assert "0 bytes spill stores" in info, (name, info)
        if name != "transpose":
            assert "div.rn.f32" in ops_ and "max.NaN.f32" in ops_, (name, ops_)
            assert "cvt.rn.satfinite.e4m3x2.f32" in ops_, (name, ops_)
            assert not [op for op in ops_ if ".ftz" in op or "approx" in op or "div.full" in op], (name, ops_)
    assert "mul.f32" in found["bf16 dY one block"][0]  # the multiplier's product, IEEE
