"""ops.moe_kernels.grouped_mm / grouped_outer (Triton; through the interpreter on the CPU) vs float64 loops over the
groups, with NaN-poisoned outputs, shapes off every block size, empty groups, trailing rows, strided operands."""

import pytest
import torch
from conftest import DEVICE
from reference import F64, assert_close, rel_err

from leantune.ops import moe_kernels

LOW = (torch.float16, torch.bfloat16)


@pytest.fixture(autouse=True)
def triton_backend(monkeypatch):
    monkeypatch.setenv("LEANTUNE_BACKEND", "triton")


def _offsets(counts, dtype=torch.int32):
    """Cumulative end rows of groups with ``counts`` rows, on the device, and the host list of (start, end)."""
    ends = torch.tensor(counts, dtype=torch.int64).cumsum(0)
    starts = ends - torch.tensor(counts, dtype=torch.int64)
    return ends.to(dtype).to(DEVICE), list(zip(starts.tolist(), ends.tolist()))


def _random_counts(n_rows, n_groups):
    """A random split of n_rows into n_groups counts (some zero when n_rows is small)."""
    cuts = sorted(torch.randint(0, n_rows + 1, (n_groups - 1,)).tolist())
    return [e - s for s, e in zip([0] + cuts, cuts + [n_rows])]


def _mm_ref(a, b, spans, n_rows, lowrank=None, dtype=F64):
    """c[rows_e] = a[rows_e] @ b[e] + scale t[rows_e] @ cf[e] in ``dtype`` (float64: the truth; a 16-bit dtype: the
    eager formula, the base in a's dtype, the low-rank term in t's, summed in the promoted dtype); zeros elsewhere."""
    out = torch.zeros(n_rows, b.shape[2], dtype=F64, device=a.device)
    for e, (s, t_end) in enumerate(spans):
        if dtype == F64:
            part = a[s:t_end].to(F64) @ b[e].to(F64)
            if lowrank is not None:
                t, cf, scale = lowrank
                part = part + scale * (t[s:t_end].to(F64) @ cf[e].to(F64))
        else:
            part = a[s:t_end] @ b[e]
            if lowrank is not None:
                t, cf, scale = lowrank
                part = part + scale * (t[s:t_end] @ cf[e])
            part = part.to(dtype)
        out[s:t_end] = part.to(F64)
    return out


def _outer_ref(a, b, spans, dtype=F64):
    rows = [a[s:e].to(dtype).T @ b[s:e].to(dtype) for s, e in spans]
    return torch.stack(rows).to(F64) if rows else torch.zeros(0, a.shape[1], b.shape[1], dtype=F64)


def _weights(n_groups, n_out, n_in, dtype, layout):
    """b [E, K, N] as the forward passes it (transposed view of W [E, N, K]) or as dX passes it (W itself)."""
    if layout == "transposed":
        return torch.randn(n_groups, n_out, n_in, device=DEVICE).to(dtype).transpose(1, 2)
    return torch.randn(n_groups, n_in, n_out, device=DEVICE).to(dtype)


# ---------------------------------------------------------------------------------------------------- grouped_mm
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layout", ["transposed", "contiguous"])
@pytest.mark.parametrize("lowrank_dtype", [None, "same", torch.float32])
def test_grouped_mm_matches_float64(dtype, layout, lowrank_dtype):
    n_rows, n_in, n_out, n_groups, rank = 37, 40, 45, 4, 5
    counts = _random_counts(n_rows - 3, n_groups)  # 3 trailing rows past offsets[-1]
    counts[1] = 0  # an empty group
    offsets, spans = _offsets(counts)
    end = spans[-1][1]
    a = torch.randn(n_rows, n_in, device=DEVICE).to(dtype)
    a[end:] = float("nan")  # rows past offsets[-1] are never read
    b = _weights(n_groups, n_out, n_in, dtype, layout)
    lowrank = None
    if lowrank_dtype is not None:
        ldt = dtype if lowrank_dtype == "same" else lowrank_dtype
        t = torch.randn(n_rows, rank, device=DEVICE).to(ldt)
        lowrank = (t, torch.randn(n_groups, rank, n_out, device=DEVICE).to(ldt), 0.7)
    c = moe_kernels.grouped_mm(a, b, offsets, lowrank=lowrank)
    assert c.dtype == dtype and c.shape == (n_rows, n_out)
    assert torch.equal(c[end:], torch.zeros_like(c[end:])), "rows past offsets[-1] must be 0"
    ref = _mm_ref(a, b, spans, n_rows, lowrank)
    eager = None if dtype == torch.float32 else _mm_ref(a, b, spans, n_rows, lowrank, dtype)
    assert_close("grouped_mm", c[:end], ref[:end], dtype, None if eager is None else eager[:end])


@pytest.mark.parametrize("counts", [
    [0, 29, 0],            # all rows in one group, empty groups around it
    [1, 0, 2, 0, 0],       # M smaller than E
    [16, 16],              # group ends on tile boundaries (the interpreter's 16-row tiles)
    [0, 0, 0],             # no group has rows: all rows are trailing zeros
    [5, 9, 0, 7],          # ordinary, offsets[-1] == M
])
def test_grouped_mm_routings(counts):
    n_rows = sum(counts) + (2 if counts == [0, 0, 0] else 0)
    n_in, n_out = 24, 20
    offsets, spans = _offsets(counts, torch.int64)
    a = torch.randn(n_rows, n_in, device=DEVICE)
    b = _weights(len(counts), n_out, n_in, torch.float32, "transposed")
    c = moe_kernels.grouped_mm(a, b, offsets)
    assert_close("grouped_mm", c, _mm_ref(a, b, spans, n_rows), torch.float32)


def test_grouped_mm_no_rows_and_no_columns():
    offsets, _ = _offsets([0, 0])
    c = moe_kernels.grouped_mm(torch.randn(0, 8, device=DEVICE), torch.randn(2, 8, 5, device=DEVICE), offsets)
    assert c.shape == (0, 5)
    c = moe_kernels.grouped_mm(torch.randn(0, 8, device=DEVICE), torch.randn(2, 8, 5, device=DEVICE), offsets,
                               lowrank=(torch.randn(0, 3, device=DEVICE), torch.randn(2, 3, 5, device=DEVICE), 1.0))
    assert c.shape == (0, 5)
    offsets, _ = _offsets([3, 4])
    assert moe_kernels.grouped_mm(torch.randn(7, 8, device=DEVICE), torch.randn(2, 8, 0, device=DEVICE),
                                  offsets).shape == (7, 0)


def test_grouped_mm_empty_inner_dimension_gives_lowrank_only():
    """K = 0: the frozen product is 0 (never NaN from an unwritten accumulator); the low-rank term remains."""
    counts = [4, 0, 9]
    offsets, spans = _offsets(counts)
    a = torch.randn(15, 0, device=DEVICE)
    b = torch.randn(3, 0, 18, device=DEVICE)
    lowrank = (torch.randn(15, 2, device=DEVICE), torch.randn(3, 2, 18, device=DEVICE), 2.0)
    c = moe_kernels.grouped_mm(a, b, offsets, lowrank=lowrank)
    assert_close("grouped_mm K=0", c, _mm_ref(a, b, spans, 15, lowrank), torch.float32)


def test_grouped_mm_strided_operands_and_out_dtype():
    """a a column slice, t and cf transposed views, bf16 operands with an fp32 result and fp32 factors."""
    counts = [6, 0, 11, 13]
    offsets, spans = _offsets(counts)
    n_rows, n_in, n_out, rank = sum(counts), 33, 27, 17  # rank 17: two rank blocks
    a = torch.randn(n_rows, n_in + 5, device=DEVICE).to(torch.bfloat16)[:, 3:3 + n_in]
    b = _weights(4, n_out, n_in, torch.bfloat16, "transposed")
    t = torch.randn(rank, n_rows, device=DEVICE).T
    cf = torch.randn(4, n_out, rank, device=DEVICE).transpose(1, 2)
    c = moe_kernels.grouped_mm(a, b, offsets, lowrank=(t, cf, 0.25), out_dtype=torch.float32)
    assert c.dtype == torch.float32
    # the operands are exact bf16 values and the kernel sums in fp32: the fp32 bar applies
    assert_close("grouped_mm strided", c, _mm_ref(a, b, spans, n_rows, (t, cf, 0.25)), torch.float32)


def test_grouped_mm_bf16_times_fp32_factor():
    """a bf16 activation times an fp32 factor stack (dY @ B_e for LoRA's g): the three-way split, fp32-exact."""
    counts = [9, 3, 0, 14]
    offsets, spans = _offsets(counts)
    a = torch.randn(sum(counts), 30, device=DEVICE).to(torch.bfloat16)
    b = torch.randn(4, 30, 6, device=DEVICE)
    c = moe_kernels.grouped_mm(a, b, offsets, out_dtype=torch.float32)
    assert_close("grouped_mm bf16 x fp32", c, _mm_ref(a, b, spans, sum(counts)), torch.float32)


# ------------------------------------------------------------------------------------------------- grouped_outer
@pytest.mark.parametrize("dtypes", [
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.float32),   # dB_e = dY_e^T xa_e: bf16 dY, fp32 xa
    (torch.float32, torch.bfloat16),   # dA_e = g_e^T x_e: fp32 g, bf16 x
    (torch.float16, torch.float16),
    (torch.bfloat16, torch.bfloat16),
])
def test_grouped_outer_matches_float64(dtypes):
    da, db = dtypes
    counts = _random_counts(35, 4)
    counts[2] = 0
    offsets, spans = _offsets(counts)
    n_rows = sum(counts) + 4  # trailing rows, never read
    a = torch.randn(n_rows, 21, device=DEVICE).to(da)
    b = torch.randn(n_rows, 37, device=DEVICE).to(db)
    a[sum(counts):] = float("nan")
    b[sum(counts):] = float("nan")
    c = moe_kernels.grouped_outer(a, b, offsets)
    assert c.dtype == torch.float32 and c.shape == (4, 21, 37)
    assert torch.equal(c[2], torch.zeros_like(c[2])), "a group without rows gives zeros"
    ref = _outer_ref(a, b, spans)
    if torch.float32 in dtypes:  # exact inputs, fp32 sums
        assert_close("grouped_outer", c, ref, torch.float32)
    else:
        assert_close("grouped_outer", c, ref, da, _outer_ref(a, b, spans, da))


def test_grouped_outer_strided_and_16bit_result():
    counts = [0, 17, 1, 0, 12]
    offsets, spans = _offsets(counts, torch.int64)
    n_rows = sum(counts)
    a = torch.randn(19, n_rows, device=DEVICE).T  # column-major
    b = torch.randn(n_rows, 2 * 23, device=DEVICE)[:, ::2]  # column stride 2
    c = moe_kernels.grouped_outer(a, b, offsets, out_dtype=torch.bfloat16)
    assert c.dtype == torch.bfloat16
    ref = _outer_ref(a, b, spans)
    assert_close("grouped_outer bf16 out", c, ref, torch.bfloat16, ref.to(torch.bfloat16))
    for e in (0, 3):
        assert torch.equal(c[e], torch.zeros_like(c[e]))


def test_grouped_outer_no_rows():
    offsets, _ = _offsets([0, 0, 0])
    c = moe_kernels.grouped_outer(torch.randn(0, 5, device=DEVICE), torch.randn(0, 18, device=DEVICE), offsets)
    assert rel_err(c, torch.zeros(3, 5, 18, dtype=F64)) == 0.0


# ---------------------------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize("case, match", [
    ("b_inner", "b must have shape"),
    ("a_rank", "a must be 2-D"),
    ("offsets_float", "offsets must be int32 or int64"),
    ("offsets_length", "offsets must have shape"),
    ("lowrank_shape", "lowrank cf must have shape"),
    ("lowrank_tuple", "lowrank must be a tuple"),
    ("lowrank_scale", "lowrank scale must be"),
    ("out_dtype", "out_dtype must be"),
    ("int_a", "a must be float32"),
])
def test_grouped_mm_bad_input_raises_before_any_kernel(case, match):
    a, b = torch.randn(6, 4, device=DEVICE), torch.randn(2, 4, 3, device=DEVICE)
    offsets, _ = _offsets([2, 4])
    lowrank, out_dtype = None, None
    if case == "b_inner":
        b = torch.randn(2, 5, 3, device=DEVICE)
    elif case == "a_rank":
        a = a[None]
    elif case == "offsets_float":
        offsets = offsets.float()
    elif case == "offsets_length":
        offsets = offsets[:1]
    elif case == "lowrank_shape":
        lowrank = (torch.randn(6, 2, device=DEVICE), torch.randn(2, 3, 3, device=DEVICE), 1.0)
    elif case == "lowrank_tuple":
        lowrank = torch.randn(6, 2, device=DEVICE)
    elif case == "lowrank_scale":
        lowrank = (torch.randn(6, 2, device=DEVICE), torch.randn(2, 2, 3, device=DEVICE), "x")
    elif case == "out_dtype":
        out_dtype = torch.int32
    elif case == "int_a":
        a = a.to(torch.int64)
    with pytest.raises(ValueError, match=match):
        moe_kernels.grouped_mm(a, b, offsets, lowrank=lowrank, out_dtype=out_dtype)


def test_grouped_outer_bad_input_raises():
    a = torch.randn(6, 4, device=DEVICE)
    offsets, _ = _offsets([2, 4])
    with pytest.raises(ValueError, match="same M"):
        moe_kernels.grouped_outer(a, torch.randn(5, 3, device=DEVICE), offsets)
    with pytest.raises(ValueError, match="offsets must be a 1-D"):
        moe_kernels.grouped_outer(a, torch.randn(6, 3, device=DEVICE), offsets[None])
    with pytest.raises(ValueError, match="offsets must be int32 or int64"):
        moe_kernels.grouped_outer(a, torch.randn(6, 3, device=DEVICE), offsets.to(torch.float16))
