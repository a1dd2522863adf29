"""The LoRA MLP's fused forward pass (``leantune.ops.lora.glu_lowrank.glu_forward_lowrank``) vs the float64 sums and
GLU formulas, and its input errors; both backends."""

import math

import pytest
import torch
from conftest import DEVICE, ON_GPU
from reference import assert_close, geglu_ref, swiglu_ref

from leantune.ops import glu
from leantune.ops.lora.glu_lowrank import glu_forward_lowrank

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")

REFERENCES = {
    "swiglu": swiglu_ref,
    "geglu_tanh": lambda g, u: geglu_ref(g, u, "tanh"),
    "geglu_erf": lambda g, u: geglu_ref(g, u, "none"),
}
def _lowrank_inputs(rows, inter, ranks, base_dtype, lora_dtype):
    gate = (torch.randn(rows, inter, device=DEVICE) * 2).to(base_dtype)
    up = torch.randn(rows, inter, device=DEVICE).to(base_dtype)
    terms = []
    for rank in ranks:
        xa = torch.randn(rows, rank, device=DEVICE).to(lora_dtype)
        b = (torch.randn(inter, rank, device=DEVICE) / math.sqrt(rank)).to(lora_dtype)
        terms.append((xa, b, 0.5 + torch.rand(()).item()))
    return gate, up, terms


def _lowrank_ref(gate, up, terms, activation):
    """float64 gate/up sums and h = act(gate) * up from them."""
    sums = [base.double() + s * xa.double() @ b.double().T for base, (xa, b, s) in zip((gate, up), terms)]
    return sums[0], sums[1], REFERENCES[activation](*sums)


@pytest.mark.parametrize("ranks", [(1, 8), (16, 64), (100, 3)], ids=str)  # 100: loops over rank tiles
@pytest.mark.parametrize("base_dtype,lora_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                                   (torch.bfloat16, torch.bfloat16)], ids=str)
def test_glu_forward_lowrank_matches_reference(backend, base_dtype, lora_dtype, ranks):
    """Gate/up get their B terms in place (summed in fp32, cast once), h comes from the stored values (so a recompute
    from the saved gate/up, as the LoRA MLP backward does, gives the same h exactly); rows/columns not multiples of
    the blocks (small blocks under the interpreter)."""
    launch = {"block_n": 16, "block_i": 32} if backend == "triton" and not ON_GPU else {}
    activations = list(glu.ACTIVATIONS) if ranks == (1, 8) else ["swiglu"]
    for activation in activations:
        gate, up, terms = _lowrank_inputs(19, 100, ranks, base_dtype, lora_dtype)
        ref_gate, ref_up, ref_h = _lowrank_ref(gate, up, terms, activation)
        ptrs = gate.data_ptr(), up.data_ptr()
        (xa_g, b_g, s_g), (xa_u, b_u, s_u) = terms
        inputs = gate.clone(), up.clone()
        h = glu_forward_lowrank(gate, up, xa_g, b_g, s_g, xa_u, b_u, s_u, activation, **launch)
        if backend == "triton":  # the other load order (a launch override): the same values bit for bit
            gate2, up2 = inputs
            h2 = glu_forward_lowrank(gate2, up2, xa_g, b_g, s_g, xa_u, b_u, s_u, activation, **launch,
                                     base_first=False)
            assert torch.equal(h2, h) and torch.equal(gate2, gate) and torch.equal(up2, up)
        assert (gate.data_ptr(), up.data_ptr()) == ptrs and h.dtype == base_dtype and h.shape == gate.shape
        # half precision: the bar is the exact sum rounded once to the base dtype
        eager = [None if base_dtype == torch.float32 else r.to(base_dtype) for r in (ref_gate, ref_up, ref_h)]
        assert_close("gate", gate, ref_gate, base_dtype, eager[0])
        assert_close("up", up, ref_up, base_dtype, eager[1])
        assert_close("h", h, ref_h, base_dtype, eager[2])
        assert torch.equal(h, glu.glu_forward(gate, up, activation)), "h must equal the recompute from gate/up"


def test_glu_forward_lowrank_strided_factors_and_errors(backend):
    """xa as column slices of one concatenated [N, r_g + r_u] buffer (as lora_qkv/lora_mlp produce); input errors."""
    gate, up, _ = _lowrank_inputs(7, 40, (), torch.float32, torch.float32)
    xa_cat = torch.randn(7, 12, device=DEVICE)
    b_g, b_u = torch.randn(40, 8, device=DEVICE), torch.randn(40, 4, device=DEVICE)
    terms = [(xa_cat[:, :8], b_g, 0.25), (xa_cat[:, 8:], b_u, 2.0)]
    ref_gate, ref_up, ref_h = _lowrank_ref(gate, up, terms, "geglu_erf")
    h = glu_forward_lowrank(gate, up, *terms[0], *terms[1], "geglu_erf")
    for name, out, ref in (("gate", gate, ref_gate), ("up", up, ref_up), ("h", h, ref_h)):
        assert_close(name, out, ref, torch.float32)
    xa = xa_cat[:, :8]
    calls = [
        (lambda: glu_forward_lowrank(gate, up, xa[:6], b_g, 1.0, xa, b_g, 1.0, "swiglu"), r"xa_g must have shape"),
        (lambda: glu_forward_lowrank(gate, up, xa, b_g[:39], 1.0, xa, b_g, 1.0, "swiglu"), r"b_g must have shape"),
        (lambda: glu_forward_lowrank(gate, up, xa, b_g, 1.0, xa, b_g.half(), 1.0, "swiglu"), "share a dtype"),
        (lambda: glu_forward_lowrank(gate, up.half(), xa, b_g, 1.0, xa, b_g, 1.0, "swiglu"), "share a dtype"),
        (lambda: glu_forward_lowrank(gate, gate, xa, b_g, 1.0, xa, b_g, 1.0, "swiglu"), "must not overlap"),
        (lambda: glu_forward_lowrank(gate.t(), up.t(), xa, b_g, 1.0, xa, b_g, 1.0, "swiglu"), "unit last stride"),
        (lambda: glu_forward_lowrank(gate[None], up[None], xa, b_g, 1.0, xa, b_g, 1.0, "swiglu"), "2-D"),
        (lambda: glu_forward_lowrank(gate, up, xa, b_g, 1.0, xa, b_g, 1.0, "relu"), "activation must be one of"),
    ]
    before = gate.clone()
    for call, match in calls:
        with pytest.raises(ValueError, match=match):
            call()
    assert torch.equal(gate, before), "a rejected call must not write"
    # the two halves of one [N, 2I] buffer (a fused gate_up output) do not overlap: accepted, written in place
    fused = torch.cat([before, up], dim=1)
    h_halves = glu_forward_lowrank(fused[:, :40], fused[:, 40:], *terms[0], *terms[1], "geglu_erf")
    ref_gate, ref_up, ref_h = _lowrank_ref(before, up, terms, "geglu_erf")
    for name, out, ref in (("gate", fused[:, :40], ref_gate), ("up", fused[:, 40:], ref_up), ("h", h_halves, ref_h)):
        assert_close(name + " (halves)", out, ref, torch.float32)

