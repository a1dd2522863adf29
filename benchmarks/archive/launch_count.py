"""Kernels one fwd+bwd issues, counted on the CPU: leantune's Triton launches (stubbed, as in wrapper_overhead.py)
and torch kernels (a dispatch mode; views and allocations apart), against PEFT's eager LoRA q/k/v for the same
tiny shapes. Each CUDA kernel costs host time in the op harness, so the counts explain host-bound results.
Usage: .venv/bin/python benchmarks/launch_count.py
"""
import collections
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import torch  # noqa: E402
import wrapper_overhead  # noqa: E402  (sets the interpreter backend and stubs the launches)
from peft import LoraConfig, get_peft_model  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

VIEWS = {"view", "_unsafe_view", "t", "transpose", "permute", "slice", "select", "expand", "as_strided", "alias",
         "detach", "unsqueeze", "squeeze", "reshape", "split", "split_with_sizes", "_reshape_alias", "unbind"}
NOT_KERNELS = {"promote_types"}


class Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.ops["view" if name in VIEWS else ("alloc" if name.startswith("empty") else name)] += 1
        return func(*args, **(kwargs or {}))


def count(fn):
    fn()
    wrapper_overhead.launches[0] = 0
    with Count() as c:
        fn()
    kernels = {k: v for k, v in c.ops.items() if k not in ("view", "alloc") and k not in NOT_KERNELS}
    return wrapper_overhead.launches[0], kernels, c.ops["alloc"]


class QKV(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = (torch.nn.Linear(128, n, bias=False) for n in (128, 32, 32))

    def forward(self, x):
        return self.q(x), self.k(x), self.v(x)


cases = wrapper_overhead._cases()
for name in ("lora_qkv", "lora_mlp", "rms_norm", "rope"):
    triton_launches, kernels, allocs = count(cases[name])
    print(f"{name:9s} leantune: {triton_launches} Triton + {sum(kernels.values())} torch kernels {dict(kernels)}, "
          f"{allocs} allocations")
peft = get_peft_model(QKV().to(torch.bfloat16), LoraConfig(r=8, target_modules=["q", "k", "v"],
                                                              init_lora_weights=False))
h = torch.randn(64, 128, dtype=torch.bfloat16, requires_grad=True)
grads = [torch.randn(64, n, dtype=torch.bfloat16) for n in (128, 32, 32)]
_, kernels, allocs = count(lambda: torch.autograd.backward(list(peft(h)), grads))
print(f"lora_qkv  PEFT:     {sum(kernels.values())} torch kernels {dict(kernels)}, {allocs} allocations")
