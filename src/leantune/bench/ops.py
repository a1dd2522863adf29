"""Op-level benchmark on the GPU: leantune vs eager PyTorch, torch.compile, Liger-Kernel and Cut Cross-Entropy.

One harness for every implementation (DESIGN.md, "Roofline"): inputs are created once as leaves with
``requires_grad``; the timed call sets ``.grad`` to None, runs forward and backward with pre-made gradient outputs;
the time is the median of ``triton.testing.do_bench``; for calls under 20 ms, the median of 3 such timings taken
in turns over the implementations (``ROUNDS``: the host's speed drifts within a run). The copy ceiling
(device-to-device copy, read + write bytes) and the bf16 matmul ceiling (8192^3) are measured in the same run, and
each op is judged against its floor ``max(minimal bytes / copy rate, FLOPs / matmul rate)``. Extra peak memory is
``max_memory_allocated`` during one call minus what was allocated before it (inputs and gradient outputs), so
parameter gradients count.

A second time, ``graph ms``, replays the same fwd+bwd captured once in a CUDA graph (also through ``do_bench``, with
its L2 flush): the device time without the host. When the host issues kernels slower than the GPU runs them (small
ops on a slow host CPU), ``fwd+bwd ms`` measures the host and ``graph ms`` the kernels; where they differ, both are
reported. Ops whose call syncs with the host (label checks) cannot be captured: their graph time is left empty.

Usage (CUDA only)::

    python -m leantune.bench.ops --ops rms_norm,rope,swiglu --out results.json
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

GiB = 1024**3


@dataclasses.dataclass
class Case:
    """One op at one shape: leaves, gradient outputs, the floor, and the implementations to time."""

    op: str
    shape: str
    leaves: list[torch.Tensor]
    grad_outputs: list[torch.Tensor] | None  # None: the output is a scalar loss
    bytes: float = 0.0  # minimal bytes moved (DESIGN.md's roofline count)
    flops: float = 0.0
    impls: dict[str, Callable] = dataclasses.field(default_factory=dict)
    params: list[torch.Tensor] = dataclasses.field(default_factory=list)  # weights and adapters: not activations


# --------------------------------------------------------------------------------------------------------- ceilings
def measure_ceilings() -> dict:
    """Copy bandwidth (bytes read + written per s) and bf16 matmul rate (FLOP/s) of this card, measured now."""
    from triton.testing import do_bench

    src = torch.randn(2 * GiB // 4, device="cuda")
    dst = torch.empty_like(src)
    copy_ms = do_bench(lambda: dst.copy_(src), warmup=50, rep=400, return_mode="median")
    copy_rate = 2 * src.numel() * 4 / (copy_ms * 1e-3)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm_ms = do_bench(lambda: a @ b, warmup=100, rep=500, return_mode="median")
    mm_rate = 2 * 8192**3 / (mm_ms * 1e-3)
    torch.cuda.empty_cache()
    return {"copy_bytes_per_s": copy_rate, "matmul_flop_per_s": mm_rate}


# ---------------------------------------------------------------------------------------------------------- harness
def _fwd_bwd(fn: Callable, leaves: list[torch.Tensor], grad_outputs) -> Callable[[], None]:
    def call():
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
    """Median ms of fwd+bwd through ``do_bench`` (DESIGN.md's harness), grads cleared after."""
    from triton.testing import do_bench

    ms = do_bench(_fwd_bwd(fn, case.leaves, case.grad_outputs), warmup=warmup_ms, rep=rep_ms, return_mode="median")
    for t in case.leaves:
        t.grad = None
    return ms


def time_and_peak(fn: Callable, case: Case, warmup_ms: int = 100, rep_ms: int = 500) -> tuple[float, float]:
    """(median ms of fwd+bwd, extra peak GiB over what was allocated before the call)."""
    call = _fwd_bwd(fn, case.leaves, case.grad_outputs)
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


GRAPH_MAX_MS = 20.0  # longer calls are device-bound: a graph replay would only repeat do_bench
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


# ------------------------------------------------------------------------------------------------------------ cases
def _liger(name: str):
    try:
        if name == "rms_norm":
            from liger_kernel.ops.rms_norm import LigerRMSNormFunction

            return lambda x, w: LigerRMSNormFunction.apply(x, w, 1e-5, 0.0, "llama", True)
        if name == "rope":
            from liger_kernel.transformers.rope import liger_rotary_pos_emb

            return liger_rotary_pos_emb
        if name == "swiglu":
            from liger_kernel.ops.swiglu import LigerSiLUMulFunction

            return LigerSiLUMulFunction.apply
        if name == "cross_entropy":
            from liger_kernel.ops.cross_entropy import LigerCrossEntropyFunction

            return lambda z, y: LigerCrossEntropyFunction.apply(z, y, None)[0]
        if name == "linear_cross_entropy":
            from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction

            return lambda h, w, y: LigerFusedLinearCrossEntropyFunction.apply(h, w, y)[0]
    except ImportError:
        return None
    return None


def _cce(filter_eps):
    try:
        from cut_cross_entropy import linear_cross_entropy
    except ImportError:
        return None
    return lambda h, w, y: linear_cross_entropy(h, w, y, filter_eps=filter_eps)


def _rand(*shape, dtype=torch.bfloat16, scale=1.0):
    return (torch.randn(*shape, device="cuda", dtype=torch.float32) * scale).to(dtype).requires_grad_()


def case_rms_norm(n=16384, h=4096) -> Case:
    from leantune import ops

    x, w = _rand(n, h), _rand(h, scale=0.1)
    with torch.no_grad():
        w.add_(1.0)

    def eager(x, w):
        xf = x.float()
        return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype)

    case = Case("rms_norm", f"{n}x{h} bf16", [x, w], [torch.randn_like(x)], bytes=5 * n * h * 2)
    case.impls = {"leantune": lambda x, w: ops.rms_norm(x, w, 1e-5), "eager": eager,
                  "torch.compile": torch.compile(eager), "liger": _liger("rms_norm")}
    return case


def case_rope(b=4, s=4096, hq=32, hk=8, d=128) -> Case:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from leantune import ops

    q, k = _rand(b, hq, s, d), _rand(b, hk, s, d)
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, d, 2, device="cuda", dtype=torch.float32) / d))
    freqs = torch.arange(s, device="cuda", dtype=torch.float32)[:, None] * inv_freq[None]
    emb = torch.cat((freqs, freqs), dim=-1)[None]  # [1, S, D], HF's layout
    cos, sin = emb.cos().to(torch.bfloat16), emb.sin().to(torch.bfloat16)
    liger = _liger("rope")

    def eager(q, k):
        return apply_rotary_pos_emb(q.clone(), k.clone(), cos, sin)

    case = Case("rope", f"B{b} S{s} {hq}/{hk}h D{d} bf16", [q, k],
                [torch.randn_like(q), torch.randn_like(k)], bytes=6 * (q.numel() + k.numel()) * 2)
    case.impls = {
        "leantune": lambda q, k: ops.rope(q.clone(), k.clone(), cos, sin),
        "eager": eager,
        "torch.compile": torch.compile(eager),
        "liger": None if liger is None else (lambda q, k: liger(q.clone(), k.clone(), cos, sin)),
    }
    return case


def case_swiglu(n=16384, i=14336) -> Case:
    from leantune import ops

    g, u = _rand(n, i), _rand(n, i)

    def eager(g, u):
        return F.silu(g) * u

    case = Case("swiglu", f"{n}x{i} bf16", [g, u], [torch.randn_like(g)], bytes=8 * n * i * 2)
    case.impls = {"leantune": ops.swiglu, "eager": eager, "torch.compile": torch.compile(eager),
                  "liger": _liger("swiglu")}
    return case


def case_cross_entropy(n=16384, v=128256) -> Case:
    from leantune import ops

    z = _rand(n, v, scale=2.0)
    y = torch.randint(0, v, (n,), device="cuda")

    def eager(z):
        return F.cross_entropy(z.float(), y)

    liger = _liger("cross_entropy")
    case = Case("cross_entropy", f"{n}x{v} bf16 logits", [z], None, bytes=3 * n * v * 2)
    case.impls = {"leantune": lambda z: ops.cross_entropy(z, y), "eager": eager,
                  "torch.compile": torch.compile(eager),
                  "liger": None if liger is None else (lambda z: liger(z, y))}
    return case


def case_linear_cross_entropy(n=16384, h=4096, v=128256, memory="fast", chunk_bytes=None) -> Case:
    from leantune import ops

    hidden, weight = _rand(n, h), _rand(v, h, scale=h**-0.5)
    y = torch.randint(0, v, (n,), device="cuda")

    def eager(hidden, weight):
        return F.cross_entropy((hidden @ weight.T).float(), y)

    liger, cce_exact, cce_filtered = _liger("linear_cross_entropy"), _cce(None), _cce("high")
    flops = (8 if memory == "low" else 6) * n * h * v  # 3 (4 with the recompute) GEMMs of 2 N H V FLOP
    case = Case(f"linear_cross_entropy[{memory}]", f"N{n} H{h} V{v} bf16", [hidden, weight], None, flops=flops)
    extra = {} if chunk_bytes is None else {"chunk_bytes": chunk_bytes}
    label = "leantune" if chunk_bytes is None else f"leantune (chunk_bytes={chunk_bytes >> 20} MiB)"
    case.impls = {label: lambda h, w: ops.linear_cross_entropy(h, w, y, memory=memory, **extra)}
    if memory == "fast" and chunk_bytes is None:
        case.impls.update({"eager": eager, "torch.compile": torch.compile(eager),
                           "liger": None if liger is None else (lambda h, w: liger(h, w, y))})
    else:
        case.impls.update({"cce (filter_eps=None)": None if cce_exact is None else (lambda h, w: cce_exact(h, w, y)),
                           "cce (default filter)": None if cce_filtered is None else
                           (lambda h, w: cce_filtered(h, w, y))})
    return case


def _peft_linear(x, w, a, b, scaling):
    """PEFT LoraLayer.forward at p = 0: base in the weight's dtype, branch in lora_A's dtype, cast back once."""
    result = F.linear(x, w)
    return (result + F.linear(F.linear(x.to(a.dtype), a), b) * scaling).to(result.dtype)


def _lora_params(n_in, n_out, r, dtype, adapter_dtype):
    w = (torch.randn(n_out, n_in, device="cuda") * n_in**-0.5).to(dtype)
    a = _rand(r, n_in, dtype=adapter_dtype, scale=n_in**-0.5)
    b = _rand(n_out, r, dtype=adapter_dtype, scale=r**-0.5)  # non-zero B: every gradient is non-trivial
    return w, a, b


def case_lora_mlp(n=4096, h=4096, i=14336, r=16, adapter_dtype=torch.float32) -> Case:
    from leantune import ops

    x = _rand(n, h)
    (wg, ag, bg), (wu, au, bu) = _lora_params(h, i, r, torch.bfloat16, adapter_dtype), \
        _lora_params(h, i, r, torch.bfloat16, adapter_dtype)
    wd, ad, bd = _lora_params(i, h, r, torch.bfloat16, adapter_dtype)
    s = 2.0

    def peft(x, ag, bg, au, bu, ad, bd):
        return _peft_linear(F.silu(_peft_linear(x, wg, ag, bg, s)) * _peft_linear(x, wu, au, bu, s), wd, ad, bd, s)

    def leantune(x, ag, bg, au, bu, ad, bd):
        return ops.lora_mlp(x, ops.LoraWeights(wg, ag, bg, s), ops.LoraWeights(wu, au, bu, s),
                            ops.LoraWeights(wd, ad, bd, s))

    name = "fp32" if adapter_dtype == torch.float32 else "bf16"
    case = Case(f"lora_mlp[{name} adapters]", f"N{n} H{h} I{i} r{r} bf16", [x, ag, bg, au, bu, ad, bd],
                [torch.randn_like(x)], flops=2 * n * h * i * 3 * 2,  # 3 frozen GEMMs, fwd + dX (no dW)
                params=[wg, wu, wd, ag, bg, au, bu, ad, bd])
    case.impls = {"leantune": leantune, "peft eager": peft}
    return case


def case_lora_qkv(n=4096, h=4096, hq=32, hk=8, d=128, r=16, adapter_dtype=torch.float32) -> Case:
    from leantune import ops

    x = _rand(n, h)
    (wq, aq, bq), (wk, ak, bk), (wv, av, bv) = (_lora_params(h, o, r, torch.bfloat16, adapter_dtype)
                                                for o in (hq * d, hk * d, hk * d))
    s = 2.0

    def peft(x, aq, bq, ak, bk, av, bv):
        return _peft_linear(x, wq, aq, bq, s), _peft_linear(x, wk, ak, bk, s), _peft_linear(x, wv, av, bv, s)

    def leantune(x, aq, bq, ak, bk, av, bv):
        return ops.lora_qkv(x, ops.LoraWeights(wq, aq, bq, s), ops.LoraWeights(wk, ak, bk, s),
                            ops.LoraWeights(wv, av, bv, s))

    name = "fp32" if adapter_dtype == torch.float32 else "bf16"
    outs = [torch.randn(n, o, device="cuda", dtype=torch.bfloat16) for o in (hq * d, hk * d, hk * d)]
    case = Case(f"lora_qkv[{name} adapters]", f"N{n} H{h} {hq}/{hk}h r{r} bf16", [x, aq, bq, ak, bk, av, bv], outs,
                flops=2 * n * h * (hq + 2 * hk) * d * 2,  # the frozen GEMMs, fwd + dX (no dW)
                params=[wq, wk, wv, aq, bq, ak, bk, av, bv])
    case.impls = {"leantune": leantune, "peft eager": peft}
    return case


CASES = {
    "rms_norm": case_rms_norm,
    "rope": case_rope,
    "swiglu": case_swiglu,
    "cross_entropy": case_cross_entropy,
    "linear_cross_entropy": lambda: case_linear_cross_entropy(memory="fast"),
    "linear_cross_entropy_low": lambda: case_linear_cross_entropy(memory="low"),
    "linear_cross_entropy_512m": lambda: case_linear_cross_entropy(memory="fast", chunk_bytes=512 << 20),
    "lora_mlp": case_lora_mlp,
    "lora_mlp_bf16": lambda: case_lora_mlp(adapter_dtype=torch.bfloat16),
    "lora_qkv": case_lora_qkv,
    "lora_qkv_bf16": lambda: case_lora_qkv(adapter_dtype=torch.bfloat16),
}


# --------------------------------------------------------------------------------------------------------- reporting
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


def _rounds_note(rows: list[dict]) -> str:
    """The header's word on interleaved rounds, for runs that took them (older JSON has a single timing)."""
    counts = {len(r["ms_rounds"]) for r in rows if len(r.get("ms_rounds") or ()) > 1}
    if not counts:
        return ""
    return (f" fwd+bwd ms of the rows under {GRAPH_MAX_MS:.0f} ms: the median of {max(counts)} timings taken in "
            "turns over the implementations.")


def markdown(result: dict) -> str:
    """ops.md: a header (date, GPU, versions, the run's ceilings) and one table row per (op, implementation): ms of
    fwd+bwd (harness), CUDA-graph ms ("—" when not captured), floor ms, % of the copy or matmul ceiling, extra peak
    and saved GiB; a failed row carries its error in the impl cell."""
    from .report import table_cell

    c = result["ceilings"]
    lines = [
        f"{result['date']}, {result['gpu']}, torch {result['versions']['torch']}, triton "
        f"{result['versions']['triton']}, transformers {result['versions']['transformers']}. Ceilings measured in "
        f"this run: copy {c['copy_bytes_per_s'] / 1e12:.2f} TB/s, bf16 matmul {c['matmul_flop_per_s'] / 1e12:.0f} "
        "TFLOP/s." + _rounds_note(result["rows"]),
        "",
        "| op | shape | impl | fwd+bwd ms | graph ms | floor ms | % of ceiling | extra peak GiB | saved GiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        pct = r.get("pct_copy_ceiling", r.get("pct_matmul_ceiling", math.nan))
        note = f" ({table_cell(r['error'])})" if r.get("error") else ""
        graph = r.get("graph_ms", math.nan)  # absent in runs before the column existed
        graph = "—" if graph is None or math.isnan(graph) else f"{graph:.3f}"
        lines.append(f"| {r['op']} | {r['shape']} | {r['impl']}{note} | {r['ms']:.3f} | {graph} | "
                     f"{r['floor_ms']:.3f} | {pct:.0f}% | {r['extra_peak_gib']:.3f} | {r['saved_gib']:.3f} |")
    return "\n".join(lines)


def run_isolated(op_names: list[str], impl_filter: str | None, out_dir, budget_s: float = 540.0,
                 log=print) -> dict:
    """Each op in its own process (``python -m leantune.bench.ops --ops NAME --out DIR/ops_NAME.json``, which
    measures its own ceilings), merged into DIR/ops.json and DIR/ops.md. Rows keep the percentages computed against
    their own process's ceilings; the merged header shows the first op's. Ops the budget leaves out are listed."""
    from pathlib import Path

    from .e2e import Budget, run_child

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
        (out_dir / "ops.md").write_text(markdown(merged) + "\n")
        log(markdown(merged))
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
    table = markdown(result)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        with open(args.out.rsplit(".", 1)[0] + ".md", "w") as f:
            f.write(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
