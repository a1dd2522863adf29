"""Step-time statistics of ``leantune bench e2e``: quantiles of the timed steps, host issue time, the busy fraction of
a profiled pass, the summary of repeated runs, and their table and chart in the report.

Everything here is a pure function of numbers the child wrote (no torch at import), so the report can rebuild on
any machine and the tests check each formula on hand-made inputs.

- Quantiles: linear interpolation between order statistics (numpy's default, "type 7" of Hyndman & Fan, 1996):
  for sorted x_0..x_{n-1}, q_p = x_f + (h - f) (x_{f+1} - x_f) with h = (n - 1) p, f = floor(h). The median is
  q_0.5 (the mean of the middle two for even n).
- Busy fraction: the length of the union of the device intervals [start, end) of the profiled steps divided by the
  wall time of those steps; overlapping or nested intervals (kernels on several streams) count once.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path

STEP_FIELDS = ("median_step_ms", "min_step_ms", "p90_step_ms", "p90_over_median", "median_issue_ms",
               "issue_over_step", "busy_fraction", "busy_ms_per_step", "kernels_per_step", "tokens_per_s_worst",
               "tokens_per_s_median", "p90_over_median_worst")  # numbers of an ok run (may be null)
# kineto's activity names of what occupies the GPU; the kernels are counted apart
DEVICE_ACTIVITIES = ("kernel", "gpu_memcpy", "gpu_memset")


def quantile(values: Iterable[float], p: float) -> float:
    """The ``p``-quantile (0 <= p <= 1) of ``values`` by linear interpolation (module docstring).

    Raises ValueError for no values or p outside [0, 1]."""
    xs = sorted(float(v) for v in values)
    if not xs:
        raise ValueError("quantile of no values")
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"p must be in [0, 1], got {p}")
    h = (len(xs) - 1) * p
    f = math.floor(h)
    return xs[f] if f + 1 >= len(xs) else xs[f] + (h - f) * (xs[f + 1] - xs[f])


def step_stats(step_ms: list[float], issue_ms: list[float] | None = None) -> dict:
    """Median, min and p90 of the step times (ms), p90 / median, and (when given) the median host issue time and
    its ratio to the median step. Raises ValueError for no steps or issue times of another count."""
    if not step_ms:
        raise ValueError("step_stats needs at least one step time")
    median = quantile(step_ms, 0.5)
    p90 = quantile(step_ms, 0.9)
    out = {"median_step_ms": median, "min_step_ms": min(step_ms), "p90_step_ms": p90,
           "p90_over_median": p90 / median if median > 0 else math.nan}
    if issue_ms is not None:
        if len(issue_ms) != len(step_ms):
            raise ValueError(f"{len(issue_ms)} issue times for {len(step_ms)} steps")
        issue = quantile(issue_ms, 0.5)
        out.update(median_issue_ms=issue, issue_over_step=issue / median if median > 0 else math.nan)
    return out


def union_length(intervals: Iterable[tuple[float, float]]) -> float:
    """Total length covered by the half-open intervals [start, end): overlaps and nesting count once.

    Raises ValueError for an interval whose end is before its start."""
    spans = sorted((float(s), float(e)) for s, e in intervals)
    total, cur_start, cur_end = 0.0, None, None
    for s, e in spans:
        if e < s:
            raise ValueError(f"interval ({s}, {e}) ends before it starts")
        if cur_end is None or s > cur_end:  # a gap: close the current run of overlapping intervals
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = s, e
        else:
            cur_end = max(cur_end, e)
    return total if cur_end is None else total + cur_end - cur_start


def busy_fraction(intervals: Iterable[tuple[float, float]], wall: float) -> float:
    """union_length(intervals) / wall (same unit). Raises ValueError unless wall > 0."""
    if not wall > 0:
        raise ValueError(f"wall time must be positive, got {wall}")
    return union_length(intervals) / wall


def device_intervals(events, device: str) -> tuple[list[tuple[int, int]], int]:
    """(intervals in ns, kernel count) of profiler events (``prof.profiler.kineto_results.events()``).

    On CUDA: the GPU activities (kernels, copies, fills), counting the kernels. On the CPU (the tests' dry run) the
    operator events stand in, so the path runs end to end: the fraction is then the share of the wall time the host
    thread spent inside operators, and "kernels" are operator calls."""
    intervals, kernels = [], 0
    for ev in events:
        kind = _activity(ev)
        if device.startswith("cuda"):
            if "CUDA" not in str(ev.device_type()) or kind not in DEVICE_ACTIVITIES:
                continue
            kernels += kind == "kernel"
        elif kind != "cpu_op":
            continue
        else:
            kernels += 1
        intervals.append((ev.start_ns(), ev.start_ns() + ev.duration_ns()))
    return intervals, kernels


def top_kernels(events, device: str, steps: int, n: int = 48) -> list[dict]:
    """The ``n`` kernels (on the CPU: operators) with the most device time in the recorded ``steps``, by name:
    ``{"name", "ms_per_step", "calls_per_step"}``, largest first (what a step's GPU time is spent on)."""
    totals: dict[str, list] = {}
    for ev in events:
        kind = _activity(ev)
        on_device = device.startswith("cuda") and "CUDA" in str(ev.device_type()) and kind == "kernel"
        if on_device or (not device.startswith("cuda") and kind == "cpu_op"):
            entry = totals.setdefault(ev.name(), [0, 0])
            entry[0] += ev.duration_ns()
            entry[1] += 1
    ranked = sorted(totals.items(), key=lambda item: -item[1][0])[:n]
    return [{"name": name[:160], "ms_per_step": ns / 1e6 / steps, "calls_per_step": calls / steps}
            for name, (ns, calls) in ranked]


def _activity(ev) -> str:
    """The event's kind: ``activity_type()`` where torch has it (2.13); torch 2.11's events lack it, and there a
    device event is a kernel unless its name says copy or fill, a host event an operator."""
    if hasattr(ev, "activity_type"):
        return ev.activity_type()
    if "CUDA" not in str(ev.device_type()):
        return "cpu_op"
    name = ev.name().lower()
    return "gpu_memcpy" if "memcpy" in name else "gpu_memset" if "memset" in name else "kernel"


def profile_pass(step, steps: int, device: str, sync) -> dict:
    """Run ``step()`` once in the profiler's warm-up, then ``steps`` times recorded, under torch.profiler (apart from
    the timed steps: the profiler slows the host); return the busy fraction (union of device intervals / wall time
    of the recorded steps), busy ms per step, kernels per step, the profiled wall ms per step and the kernels that
    take the most device time (:func:`top_kernels`). On the CPU the
    profiler records operators (device_intervals). When it records nothing the numbers are None and
    ``profile_error`` says so."""
    import time

    from torch.profiler import ProfilerActivity, profile, schedule

    activity = ProfilerActivity.CUDA if device.startswith("cuda") else ProfilerActivity.CPU
    # CUDA only: no CPU-op recording to slow the host further. One step in the profiler's warm-up phase (traced,
    # not recorded) first, so that setting up the tracer falls outside the recorded steps.
    with profile(activities=[activity], schedule=schedule(wait=0, warmup=1, active=steps, repeat=1)) as prof:
        step()
        sync()
        prof.step()  # recording starts here and runs until the block ends
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        sync()
        wall_s = time.perf_counter() - t0
    events = prof.profiler.kineto_results.events()
    intervals, kernels = device_intervals(events, device)
    if not intervals:  # e.g. CUPTI unavailable to this process: no fraction rather than a false 0%
        return {"busy_fraction": None, "busy_ms_per_step": None, "kernels_per_step": None,
                "profiled_step_ms": 1e3 * wall_s / steps, "profiled_steps": steps,
                "profile_error": "the profiler recorded no device activity"}
    busy_ns = union_length(intervals)
    return {"busy_fraction": busy_fraction(intervals, wall_s * 1e9), "busy_ms_per_step": busy_ns / 1e6 / steps,
            "kernels_per_step": kernels / steps, "profiled_step_ms": 1e3 * wall_s / steps, "profiled_steps": steps,
            "top_kernels": top_kernels(events, device, steps)}


def combine_runs(runs: list[dict]) -> dict:
    """One result of ``K`` repeated runs of one workload and implementation: the median run's fields (by tokens/s;
    the lower middle one for even K), ``runs`` (each run's own result, every step time kept), tokens/s of the worst
    run and the median of runs, the worst p90 / median. Status ok only when every run is; otherwise the first
    failing run's status and error, naming the run. Raises ValueError for no runs."""
    if not runs:
        raise ValueError("combine_runs needs at least one run")
    bad = next(((i, r) for i, r in enumerate(runs) if r.get("status") != "ok"), None)
    tps = sorted(r["tokens_per_s"] for r in runs if r.get("tokens_per_s") is not None)
    if bad is None:
        median_run = sorted(runs, key=lambda r: r.get("tokens_per_s") or 0.0)[(len(runs) - 1) // 2]
        worst_spread = [r["p90_over_median"] for r in runs if r.get("p90_over_median") is not None]
        out = {**median_run, "tokens_per_s_worst": tps[0] if tps else None,
               "tokens_per_s_median": quantile(tps, 0.5) if tps else None,
               "p90_over_median_worst": max(worst_spread, default=None)}
    else:
        i, failed = bad
        out = {**failed, "error": f"run {i + 1} of {len(runs)}: {failed.get('error', '')}"}
    return {**out, "repeat": len(runs), "runs": runs}


# ------------------------------------------------------------------------------------------------------ the report
def num_cell(x, fmt: str) -> str:
    """``x`` formatted for a table cell; "—" for None and non-finite floats."""
    return "—" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, fmt)


def worst_tokens_per_s(row: dict):
    """tokens/s of a result's worst run (a single run is its own worst)."""
    return row.get("tokens_per_s_worst", row.get("tokens_per_s"))


def steps_markdown(rows: list[dict], key, baseline: str) -> list[str]:
    """The step-time table of results.md (ok rows only): per-run tokens/s, the worst run and its ratio to the
    median tokens/s of ``baseline`` of the same workload (``key(row)``), step ms median / min / p90 and
    p90 / median, host issue ms and its share of the step, the profiled GPU-busy fraction and kernels per step.
    [] when no ok row has step times."""
    base = {key(r): r.get("tokens_per_s") for r in rows if r["impl"] == baseline and r.get("status") == "ok"}
    ok = [r for r in rows if r.get("status") == "ok" and isinstance(r.get("step_ms"), list) and r["step_ms"]]
    if not ok:
        return []
    lines = ["", "Step times (ms over the timed steps of a run; of several runs, the median run's by tokens/s, as in "
             f"the table above; worst x HF = the worst run's tokens/s / {baseline}'s median run's; host issue = the "
             "step's Python until its last op is queued, before synchronising; GPU busy = union of kernel intervals / "
             "wall time, and kernels per step, of a separate profiled pass):", "",
             "| model | seq x batch | GC | impl | steps x runs | tokens/s per run | worst tok/s | worst x HF | "
             "median ms | min ms | p90 ms | p90/median | host issue ms | issue/step | GPU busy | kernels/step |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in ok:
        runs = r.get("runs") or [r]
        per_run = " / ".join(num_cell(x.get("tokens_per_s"), ".0f") for x in runs)
        worst, b = worst_tokens_per_s(r), base.get(key(r))
        ratio = worst / b if worst is not None and b else None
        busy = r.get("busy_fraction")
        busy = "—" if busy is None or not math.isfinite(busy) else f"{100 * busy:.0f}%"
        lines.append(
            f"| {r['model']} | {r['seq']} x {r['batch']} | {'on' if r['gc'] else 'off'} | {r['impl']} | "
            f"{len(r['step_ms'])} x {len(runs)} | {per_run} | {num_cell(worst, '.0f')} | {num_cell(ratio, '.2f')} | "
            f"{num_cell(r.get('median_step_ms'), '.1f')} | {num_cell(r.get('min_step_ms'), '.1f')} | "
            f"{num_cell(r.get('p90_step_ms'), '.1f')} | {num_cell(r.get('p90_over_median'), '.3f')} | "
            f"{num_cell(r.get('median_issue_ms'), '.1f')} | {num_cell(r.get('issue_over_step'), '.2f')} | {busy} | "
            f"{num_cell(r.get('kernels_per_step'), '.0f')} |")
    return lines


def plot_steps(rows: list[dict], out: Path):
    """step_ms.png: per run row the median step (bar), min to p90 (whisker) and host issue ms (dot), with the
    GPU-busy fraction written over the bar. None (nothing drawn) without step times."""
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r.get("status") == "ok" and r.get("median_step_ms") is not None]
    if not ok:
        return None
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(ok)), 4.0))
    x = list(range(len(ok)))
    med = [r["median_step_ms"] for r in ok]
    low = [r["median_step_ms"] - r.get("min_step_ms", r["median_step_ms"]) for r in ok]
    high = [r.get("p90_step_ms", r["median_step_ms"]) - r["median_step_ms"] for r in ok]
    bars = ax.bar(x, med, 0.6, yerr=[low, high], capsize=3, label="median step (whisker: min to p90)")
    issue = [r.get("median_issue_ms") if r.get("median_issue_ms") is not None else math.nan for r in ok]
    ax.plot(x, issue, "k.", label="host issue ms")
    ax.bar_label(bars, ["" if r.get("busy_fraction") is None else f"{100 * r['busy_fraction']:.0f}% busy"
                        for r in ok], fontsize=7)
    labels = [f"{r['model']}{' L%d' % r['layers'] if r.get('layers') else ''}\n{r['seq']}x{r['batch']} GC "
              f"{'on' if r['gc'] else 'off'}\n{r['impl']}" for r in ok]
    ax.set_xticks(x, labels, fontsize=7)
    ax.set_ylabel("ms")
    ax.set_title("step time (lower is better)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = Path(out) / "step_ms.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
