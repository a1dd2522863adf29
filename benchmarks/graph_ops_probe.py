"""Which op's fwd+bwd captures in a CUDA graph (autograd.grad on fresh leaves), at small 8B-like shapes."""
import traceback

import torch
import torch.nn.functional as F

from leantune import ops
from leantune.bench import op_cases
from leantune.bench.ops import graph_ms


def lora_linear_case(n=1024, h=4096, o=4096, r=16):
    x = op_cases._rand(n, h).requires_grad_()
    w = op_cases._rand(o, h, scale=0.02).requires_grad_(False)
    a = (torch.randn(r, h, device="cuda") * 0.02).requires_grad_()
    b = (torch.randn(o, r, device="cuda") * 0.02).requires_grad_()
    return op_cases.Case(op="lora_linear", shape="", leaves=[x, w, a, b], impls={"leantune": lambda x, w, a, b:
                         ops.lora_linear(x, w, a, b, 2.0)}, grad_outputs=[torch.randn(n, o, device="cuda",
                         dtype=torch.bfloat16)])


def sdpa_case(b=1, hq=32, s=1024, d=128):
    q = op_cases._rand(b, hq, s, d).requires_grad_()
    k = op_cases._rand(b, hq, s, d).requires_grad_()
    v = op_cases._rand(b, hq, s, d).requires_grad_()
    return op_cases.Case(op="sdpa", shape="", leaves=[q, k, v], impls={"leantune": lambda q, k, v:
                         F.scaled_dot_product_attention(q, k, v, is_causal=True)},
                         grad_outputs=[torch.randn(b, hq, s, d, device="cuda", dtype=torch.bfloat16)])


cases = {"rms_norm": lambda: op_cases.case_rms_norm(n=1024), "rope": lambda: op_cases.case_rope(b=1, s=1024),
         "lora_qkv": lambda: op_cases.case_lora_qkv(n=1024), "lora_mlp": lambda: op_cases.case_lora_mlp(n=1024),
         "lora_linear": lora_linear_case, "sdpa": sdpa_case,
         "lce": lambda: op_cases.case_linear_cross_entropy(n=1024)}
for name, make in cases.items():
    try:
        case = make()
        ms = graph_ms(case.impls["leantune"], case, warmup_ms=10, rep_ms=30)
        print(f"{name}: ok {ms:.3f} ms", flush=True)
    except Exception as exc:  # noqa: BLE001
        tb = [ln for ln in traceback.format_exc().splitlines() if "leantune" in ln or "Error" in ln][-6:]
        print(f"{name}: FAIL {type(exc).__name__}: {str(exc)[:100]}", *tb, sep="\n   ", flush=True)
        try:
            torch.cuda.synchronize()
        except Exception:  # noqa: BLE001
            pass
