"""Issue 3's large-shape check: ops.linear_cross_entropy at rows x V > 2^31 against the eager loss (GPU, bf16).

Shapes: (N=16384, V=262144) and (N=32768, V=128256), H=4096, both memory modes; the eager reference is
F.cross_entropy on the full fp32 logits (16-17 GB, fits the H200). Also compares the hidden gradient.
Usage: PYTHONPATH=src python3 benchmarks/lce_large.py [--tiny]   (--tiny: small shapes, runs on CPU)
"""
import argparse
import time

import torch
import torch.nn.functional as F

from leantune import ops

parser = argparse.ArgumentParser()
parser.add_argument("--tiny", action="store_true", help="small shapes on the CPU (a dry run of this script)")
args = parser.parse_args()
device = "cpu" if args.tiny else "cuda"
dtype = torch.float32 if args.tiny else torch.bfloat16
shapes = [(64, 32, 1000), (128, 32, 500)] if args.tiny else [(16384, 4096, 262144), (32768, 4096, 128256)]

for n, h, v in shapes:
    torch.manual_seed(0)
    hidden = torch.randn(n, h, device=device).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, device=device) * h**-0.5).to(dtype)
    labels = torch.randint(0, v, (n,), device=device)
    labels[::7] = -100
    logits = (hidden.detach() @ weight.T).float().requires_grad_()
    ref = F.cross_entropy(logits, labels)
    ref.backward()
    ref_dh = (logits.grad.to(dtype) @ weight).float()
    del logits
    for memory in ("fast", "low"):
        hidden.grad = None
        start = time.perf_counter()
        loss = ops.linear_cross_entropy(hidden, weight, labels, memory=memory)
        loss.backward()
        if device == "cuda":
            torch.cuda.synchronize()
        ms = (time.perf_counter() - start) * 1e3
        loss_err = abs(loss.item() - ref.item()) / abs(ref.item())
        dh_err = ((hidden.grad.float() - ref_dh).norm() / ref_dh.norm()).item()
        ok = loss_err <= 1e-3 and dh_err <= 2e-2
        print(f"N={n} H={h} V={v} rows*V={n * v:.3e} memory={memory}: loss {loss.item():.6f} vs eager {ref.item():.6f} "
              f"(rel {loss_err:.1e}), d_hidden rel {dh_err:.1e}, {ms:.0f} ms  {'ok' if ok else 'MISMATCH'}")
