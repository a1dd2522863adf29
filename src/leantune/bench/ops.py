"""Op-level benchmark on the GPU: leantune vs eager PyTorch, torch.compile, Liger-Kernel and Cut Cross-Entropy.

One harness for every implementation (docs/design.md, "Timing harness and floors"): inputs are created once as leaves
with ``requires_grad`` (``op_cases``); the timed call sets ``.grad`` to None, runs forward and backward with pre-made
gradient outputs; the time is the median of ``triton.testing.do_bench``; for calls under 20 ms, the median of 3 such
timings taken in turns over the implementations (``ROUNDS``: the host's speed drifts within a run). The copy ceiling
(device-to-device copy, read + write bytes) and the bf16 matmul ceiling (8192^3) are measured in the same run, and each
op is judged against its floor ``max(minimal bytes / copy rate, FLOPs / matmul rate)``. Extra peak memory is
``max_memory_allocated`` during one call minus what was allocated before it (inputs and gradient outputs), so parameter
gradients count. A forward-only op (``nf4_dequant``) is timed the same way without the backward.

A second time, ``graph ms``, replays the same fwd+bwd captured once in a CUDA graph (also through ``do_bench``, with
its L2 flush): the device time without the host. When the host issues kernels slower than the GPU runs them (small
ops on a slow host CPU), ``fwd+bwd ms`` measures the host and ``graph ms`` the kernels; where they differ, both are
reported. Ops whose call syncs with the host (label checks) cannot be captured: their graph time is left empty.

Usage (CUDA only)::

    python -m leantune.bench.ops --ops rms_norm,rope,swiglu --out results.json
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from .harness import GRAPH_MAX_MS, Budget, GiB, measure_ceilings, run_child
from .op_cases import CASES, Case
from .report import ops_markdown


# ---------------------------------------------------------------------------------------------------------- harness
def _fwd_bwd(fn: Callable, leaves: list[torch.Tensor], grad_outputs, backward: bool = True) -> Callable[[], None]:
    def call():
        if not backward:
            fn(*leaves)
            return
        for t in leaves:
            t.grad = None
        out = fn(*leaves)
        outs = list(out) if isinstance(out, (tuple, list)) else [out]
        if grad_outputs is None:
            outs[0].backward()
        else:
            torch.autograd.backward(outs, grad_outputs)

    return call


def harness_ms(fn: Callable, case: Case, warmup_ms: int = 100, rep_ms: int = 500) -> float:
    """Median ms of fwd+bwd through ``do_bench`` (the timing harness), grads cleared after."""
    from triton.testing import do_bench

    call = _fwd_bwd(fn, case.leaves, case.grad_outputs, case.backward)
    ms = do_bench(call, warmup=warmup_ms, rep=rep_ms, return_mode="median")
    for t in case.leaves:
        t.grad = None
    return ms


def time_and_peak(fn: Callable, case: Case, warmup_ms: int = 100, rep_ms: int = 500) -> tuple[float, float]:
    """(median ms of fwd+bwd, extra peak GiB over what was allocated before the call)."""
    call = _fwd_bwd(fn, case.leaves, case.grad_outputs, case.backward)
    call()  # compile / autotune outside the measurement
    for t in case.leaves:
        t.grad = None
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    call()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / GiB
    for t in case.leaves:
        t.grad = None
    return harness_ms(fn, case, warmup_ms, rep_ms), peak


# Calls shorter than GRAPH_MAX_MS are often host-bound, and the lent hosts' speed drifts within a process (the same
# code measured 1.80 and 2.82 ms a minute apart): their harness time is the median of ROUNDS timings taken in turns
# over the implementations (A B C A B C ...), so that a slow stretch of the host hits every implementation alike.
ROUNDS = 3


def graph_ms(fn: Callable, case: Case, warmup_ms: int = 100, rep_ms: int = 500) -> float:
    """Median ms of fwd+bwd replayed from one CUDA-graph capture (device time; raises if the call cannot be
    captured, e.g. it reads a value back to the host)."""
    from triton.testing import do_bench

    def call():  # autograd.grad, not .backward(): no AccumulateGrad, whose stream (the leaves') breaks capture
        out = fn(*leaves)
        outs = list(out) if isinstance(out, (tuple, list)) else [out]
        if not case.backward:
            return
        if case.grad_outputs is None:
            torch.autograd.grad(outs[0], leaves, allow_unused=True)
        else:
            torch.autograd.grad(outs, leaves, case.grad_outputs, allow_unused=True)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture stream, as torch.cuda.graph asks
        # fresh leaves: the harness's backward calls left autograd state (per-leaf streams) that breaks capture
        leaves = [t.detach().clone().requires_grad_(t.requires_grad) for t in case.leaves]
        for _ in range(2):
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            call()
        ms = do_bench(graph.replay, warmup=warmup_ms, rep=rep_ms, return_mode="median")
    finally:
        del graph
        torch.cuda.synchronize()
        gc.collect()
        torch.cuda.empty_cache()
    return ms


def saved_bytes(fn: Callable, case: Case) -> int:
    """Bytes saved for backward by one forward: storages deduplicated, parameters (``case.params``) excluded."""
    storages: dict[int, int] = {}
    excluded = {t.untyped_storage().data_ptr() for t in case.params}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in excluded and not isinstance(t, torch.nn.Parameter):
            storages[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*case.leaves)
    del out
    return sum(storages.values())


# --------------------------------------------------------------------------------------------------------- measuring
def _interleaved_rounds(rows: list[dict], fns: dict, case: Case, ceilings: dict, rounds: int = ROUNDS) -> None:
    """Rows under GRAPH_MAX_MS get ``rounds - 1`` more timings, taken in turns over their implementations; each such
    row's ``ms`` becomes the median of its timings (kept as ``ms_rounds``) and its rates follow. A timing that
    raises ends that row's rounds (``rounds_error``); the timings taken stand."""
    timed = [r for r in rows if r["error"] is None and r["ms"] < GRAPH_MAX_MS]
    for row in timed:
        row["ms_rounds"] = [row["ms"]]
    for _ in range(rounds - 1):
        for row in timed:
            if row.get("rounds_error"):
                continue
            try:
                row["ms_rounds"].append(harness_ms(fns[row["impl"]], case))
            except Exception as exc:  # e.g. an OOM after another implementation's run: keep what was measured
                row["rounds_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    for row in timed:
        row["ms"] = statistics.median(row["ms_rounds"])
        _rates(row, case, ceilings)


def _rates(row: dict, case: Case, ceilings: dict) -> None:
    """Achieved bandwidth or FLOP rate of ``row["ms"]`` and its share of the run's ceiling."""
    if case.bytes:
        row["gb_per_s"] = case.bytes / (row["ms"] * 1e-3) / 1e9
        row["pct_copy_ceiling"] = 100 * case.bytes / (row["ms"] * 1e-3) / ceilings["copy_bytes_per_s"]
    if case.flops:
        row["tflop_per_s"] = case.flops / (row["ms"] * 1e-3) / 1e12
        row["pct_matmul_ceiling"] = 100 * case.flops / (row["ms"] * 1e-3) / ceilings["matmul_flop_per_s"]


def run(op_names: list[str], impl_filter: set[str] | None = None) -> dict:
    """Measure each op of ``op_names`` (keys of CASES) for every implementation (or those in ``impl_filter``).

    Returns ``{date, gpu, versions, ceilings: {copy_bytes_per_s, matmul_flop_per_s}, rows}``; a row is
    ``{op, shape, impl, ms, graph_ms, graph_error, extra_peak_gib, saved_gib, floor_ms, error}`` (ms of fwd+bwd, GiB)
    plus ``gb_per_s`` / ``pct_copy_ceiling`` or ``tflop_per_s`` / ``pct_matmul_ceiling``, and for short calls
    ``ms_rounds`` (``ms`` is then their median, see ROUNDS). An implementation that raises gives a row with NaN
    numbers and its error."""
    import transformers
    import triton

    ceilings = measure_ceilings()
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "gpu": torch.cuda.get_device_name(),
        "versions": {"torch": torch.__version__, "triton": triton.__version__,
                     "transformers": transformers.__version__, "python": platform.python_version()},
        "ceilings": ceilings,
        "rows": [],
    }
    for name in op_names:
        case = CASES[name]()
        floor_ms = 1e3 * max(case.bytes / ceilings["copy_bytes_per_s"], case.flops / ceilings["matmul_flop_per_s"])
        rows, fns = [], {}
        for impl, fn in case.impls.items():
            if fn is None or (impl_filter and impl not in impl_filter):
                continue
            try:
                ms, peak = time_and_peak(fn, case)
                saved = saved_bytes(fn, case) / GiB
                error = None
            except Exception as exc:  # a peer failing at a shape is a result, not a crash of the benchmark
                ms, peak, saved, error = math.nan, math.nan, math.nan, f"{type(exc).__name__}: {str(exc)[:200]}"
            row = {"op": case.op, "shape": case.shape, "impl": impl, "ms": ms, "graph_ms": math.nan,
                   "graph_error": None, "extra_peak_gib": peak, "saved_gib": saved, "floor_ms": floor_ms,
                   "error": error}
            _rates(row, case, ceilings)
            rows.append(row)
            fns[impl] = fn
        _interleaved_rounds(rows, fns, case, ceilings)
        # graph replays after every harness time, eager last: a failed capture can leave the process unable to
        # capture again, and eager's many small kernels are the likeliest to fail
        for row in sorted(rows, key=lambda r: r["impl"] == "eager"):
            if row["error"] is None and row["ms"] < GRAPH_MAX_MS:
                try:
                    row["graph_ms"] = graph_ms(fns[row["impl"]], case)
                except Exception as exc:  # not capturable (a host sync): the row keeps its do_bench time
                    row["graph_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        for row in rows:
            result["rows"].append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
        del case
        gc.collect()
        torch.cuda.empty_cache()
        torch._dynamo.reset()
    return result


def run_isolated(op_names: list[str], impl_filter: str | None, out_dir, budget_s: float = 540.0,
                 log=print) -> dict:
    """Each op in its own process (``python -m leantune.bench.ops --ops NAME --out DIR/ops_NAME.json``, which
    measures its own ceilings), merged into DIR/ops.json and DIR/ops.md. Rows keep the percentages computed against
    their own process's ceilings; the merged header shows the first op's. Ops the budget leaves out are listed."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    budget = Budget(budget_s)
    merged: dict = {}
    for name in op_names:
        if name not in CASES:
            raise ValueError(f"unknown op {name!r}; expected one of {', '.join(CASES)}")
    for name in op_names:
        if not budget.can_start():
            log(f"not run (budget of {budget_s:.0f} s spent): {name}")
            continue
        path = out_dir / f"ops_{name}.json"
        args = ["--ops", name, "--out", str(path)] + (["--impls", impl_filter] if impl_filter else [])
        result = run_child(args, path, out_dir / f"ops_{name}.log", budget.left(), module="leantune.bench.ops")
        budget.record(result.get("wall_s", 0.0))
        if "rows" not in result:
            log(f"{name}: {result.get('status')} {result.get('error', '')}")
            continue
        if not merged:
            merged = {k: v for k, v in result.items() if k not in ("rows", "wall_s")}
            merged["rows"], merged["ceilings_per_op"] = [], {}
        merged["rows"] += result["rows"]
        merged["ceilings_per_op"][name] = result["ceilings"]
    if merged:
        (out_dir / "ops.json").write_text(json.dumps(merged, indent=1))
        (out_dir / "ops.md").write_text(ops_markdown(merged) + "\n")
        log(ops_markdown(merged))
    return merged


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", default="rms_norm,rope,swiglu", help=f"comma list of {', '.join(CASES)}")
    parser.add_argument("--impls", default=None, help="comma list of implementations to run (default: all)")
    parser.add_argument("--out", default=None, help="write the JSON result here (and .md beside it)")
    args = parser.parse_args(argv)
    names = [name for name in args.ops.split(",") if name]
    unknown = [name for name in names if name not in CASES]
    if unknown or not names:
        print(f"unknown op(s) {', '.join(unknown) or '(none given)'}; expected some of {', '.join(CASES)}",
              file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("leantune bench ops needs a CUDA GPU", file=sys.stderr)
        return 2
    result = run(names, set(args.impls.split(",")) if args.impls else None)
    table = ops_markdown(result)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        with open(args.out.rsplit(".", 1)[0] + ".md", "w") as f:
            f.write(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
