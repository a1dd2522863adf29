"""``leantune bench max-context``: the longest batch-1 sequence whose LoRA training step fits, by bisection.

Bisection over multiples of ``step`` for the longest batch-1 sequence whose step fits (gradient checkpointing on);
every probe is its own process (``bench/step.py``: one training step after the optimizer state exists;
``torch.OutOfMemoryError`` = does not fit). The budget bounds the search: when it runs out, the result says which
bracket to resume from, and ``bench report`` pools the probes of several invocations.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from pathlib import Path

from .harness import Budget, check_range, model_name, run_child
from .step import RunSpec


def bisect_max_fitting(fits: Callable[[int], bool | None], lo: int, hi: int, step: int,
                       stop: Callable[[], bool] = lambda: False) -> dict:
    """Largest multiple of ``step`` in [lo, hi] for which ``fits`` is True, assuming monotone ``fits``.

    ``lo`` and ``hi`` are rounded inward to multiples of ``step``. ``fits`` returning None (a probe that neither fit
    nor ran out of memory: timeout, crash) ends the search. ``stop()`` is asked before each probe (the time budget).
    Returns {"best": largest fitting length or None, "first_fail": smallest length known not to fit or None,
    "probes": [[seq, fits], ...] in order, "complete": whether the bracket is closed (best + step == first_fail, or
    hi fits, or lo fails)}. Binary search: ceil(log2(#candidates + 1)) probes at most. Raises RangeError (a
    ValueError) when [lo, hi] holds no positive multiple of ``step``.
    """
    check_range(lo, hi, step)
    lo_k, hi_k = -(-lo // step), hi // step
    good, bad = lo_k - 1, hi_k + 1  # invariant: good fits (or is below range), bad fails (or is above range)
    probes: list[list] = []
    while bad - good > 1:
        if stop():
            break
        mid = (good + bad) // 2
        ok = fits(mid * step)
        probes.append([mid * step, ok])
        if ok is None:
            break
        if ok:
            good = mid
        else:
            bad = mid
    return {"best": good * step if good >= lo_k else None, "first_fail": bad * step if bad <= hi_k else None,
            "probes": probes, "complete": bad - good == 1}


def run_max_context(config_path: str, impls: list[str], out: Path, *, lo: int, hi: int, step: int,
                    seed: int = 0, layers: int | None = None, budget_s: float = 540.0,
                    memory_cap_gib: float | None = None, log=print) -> list[dict]:
    """Bisection per implementation (batch 1, gradient checkpointing on); each probe one child with 1 step, under
    ``memory_cap_gib`` when given (``torch.cuda.set_per_process_memory_fraction``: a smaller card's limit)."""
    out.mkdir(parents=True, exist_ok=True)
    budget = Budget(budget_s)
    results = []
    for impl in impls:
        probes_detail: list[dict] = []

        def fits(seq: int, impl=impl, details=probes_detail) -> bool | None:
            spec = RunSpec(impl, config_path, seq, 1, True, warmup=0, steps=1, seed=seed, layers=layers,
                           memory_cap_gib=memory_cap_gib)
            r = run_child(["--one", json.dumps(dataclasses.asdict(spec))], out / "probe.json",
                          out / f"probe_{spec.name}.log", budget.left(), keep=False)  # kept in probe_details
            budget.record(r.get("wall_s", 0.0))
            details.append({"seq": seq, "status": r.get("status"), "peak_gib": r.get("peak_gib"),
                            "wall_s": r.get("wall_s"), "error": r.get("error"), "gpu": r.get("gpu"),
                            "versions": r.get("versions")})
            peak = "" if r.get("peak_gib") is None else f"peak {r['peak_gib']:.1f} GiB "
            log(f"max-context {impl} seq {seq}: {r.get('status')} {peak}({r.get('wall_s', 0):.0f} s)")
            if r.get("status") in ("ok", "nonfinite"):
                return True
            return False if r.get("status") == "oom" else None

        found = bisect_max_fitting(fits, lo, hi, step, stop=lambda: not budget.can_start())
        result = {"kind": "max_context", "impl": impl, "config": config_path, "model": model_name(config_path),
                  "layers": layers, "memory_cap_gib": memory_cap_gib, "lo": lo, "hi": hi, "step": step, **found,
                  "probe_details": probes_detail,
                  # from the probes that ran (the parent never touches the GPU: its context would cost memory)
                  "date": time.strftime("%Y-%m-%d %H:%M"),
                  "gpu": next((d["gpu"] for d in probes_detail if d.get("gpu")), None),
                  "versions": next((d["versions"] for d in probes_detail if d.get("versions")), None)}
        # one file per invocation (`bench report` pools the probes of all): a rerun never overwrites earlier probes
        cap = "" if memory_cap_gib is None else f"_cap{memory_cap_gib:g}"
        name = (f"maxctx_{model_name(config_path)}{f'_L{layers}' if layers else ''}{cap}_{impl}_"
                f"{time.strftime('%Y%m%d-%H%M%S')}").replace("+", "-")
        (out / f"{name}.json").write_text(json.dumps(result, indent=1))
        results.append(result)
        log(f"max-context {impl}: best {found['best']}, first fail {found['first_fail']}"
            f"{'' if found['complete'] else ' (INCOMPLETE: rerun with --lo/--hi inside this bracket)'}")
    return results

