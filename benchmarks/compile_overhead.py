"""Eager host cost of an op call: leantune's autograd.Function against the same torch formulas registered as a
torch.library custom op (docs/design.md, "torch.compile"). CPU, one thread, tiny shapes, so the figure is host
overhead, not arithmetic.

    LEANTUNE_BACKEND=torch PYTHONPATH=src python benchmarks/compile_overhead.py [--calls 2000] [--rounds 5]

Prints the median of ``--calls`` timed calls per case (us), in ``--rounds`` interleaved rounds (the median round).
The custom op here is a prototype of what registration would cost; it is not leantune's API.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import time

import torch

from leantune import ops

rms_module = importlib.import_module("leantune.ops.rms_norm")  # the module (leantune.ops.rms_norm is the function)


@torch.library.custom_op("leantune_probe::rms_norm", mutates_args=())
def _rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    y, rstd = rms_module._forward_torch(x, weight, eps, 0.0, False, torch.promote_types(weight.dtype, x.dtype))
    return y, rstd


@_rms_norm_op.register_fake
def _(x, weight, eps):
    return x.new_empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype)), x.new_empty(x.shape[:-1],
                                                                                               dtype=torch.float32)


def _setup(ctx, inputs, output):
    x, weight, _ = inputs
    ctx.save_for_backward(x, weight, output[1])


def _backward(ctx, dy, _drstd):
    x, weight, rstd = ctx.saved_tensors
    return (*rms_module._backward_torch(dy, x, weight, rstd, 0.0, False), None)


_rms_norm_op.register_autograd(_backward, setup_context=_setup)


def _median_us(fn, calls: int) -> float:
    times = []
    for _ in range(calls):
        start = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - start)
    return statistics.median(times) / 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    x = torch.randn(8, 64, requires_grad=True)
    w = torch.randn(64, requires_grad=True)
    dy = torch.randn(8, 64)

    def fwd_bwd(call):
        def run():
            torch.autograd.backward(call(), dy)
        return run

    cases = {
        "forward, autograd.Function (leantune)": lambda: ops.rms_norm(x, w),
        "forward, RMSNormFunction.apply (no checks)": lambda: rms_module.RMSNormFunction.apply(x, w, 1e-6, 0.0, False),
        "forward, custom_op (no checks)": lambda: _rms_norm_op(x, w, 1e-6)[0],
        "fwd+bwd, autograd.Function (leantune)": fwd_bwd(lambda: ops.rms_norm(x, w)),
        "fwd+bwd, RMSNormFunction.apply (no checks)": fwd_bwd(
            lambda: rms_module.RMSNormFunction.apply(x, w, 1e-6, 0.0, False)),
        "fwd+bwd, custom_op (no checks)": fwd_bwd(lambda: _rms_norm_op(x, w, 1e-6)[0]),
        "torch.compiler.is_compiling()": torch.compiler.is_compiling,
    }
    for run in cases.values():  # warm-up
        for _ in range(200):
            run()
    rounds = {name: [] for name in cases}
    for _ in range(args.rounds):
        for name, run in cases.items():
            rounds[name].append(_median_us(run, args.calls))
    for name, values in rounds.items():
        print(f"{name:46s} {statistics.median(values):8.2f} us  (rounds: {', '.join(f'{v:.2f}' for v in values)})")


if __name__ == "__main__":
    main()
