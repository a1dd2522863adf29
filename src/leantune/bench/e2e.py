"""``leantune bench e2e``: LoRA training steps of leantune vs HF+PEFT vs HF+PEFT+Liger, one child process per run.

The parent (this module) never touches the GPU. It measures the bf16 matmul ceiling once per invocation in its own
child (``--matmul-tflops`` reuses a known value instead), then runs every (config, gradient checkpointing,
implementation) in a child (``bench/step.py`` says what one run measures), adds MFU / HFU (``flops``) and stores one
JSON per run in the output folder, where ``bench report`` finds it. A rerun that fails keeps the earlier measurement.

``repeat`` K > 1 runs every child K times in one call, interleaved (all implementations once, then again: a drift
of the host's or the card's speed reaches every implementation alike); the JSON of a workload and implementation
then holds every run (``runs``), the median run's fields at the top and the worst run's tokens/s
(``stepstats.combine_runs``), rewritten after each run so a call cut short keeps the runs it finished.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

from .flops import default_shape, utilization
from .harness import Budget, load_config, model_name, run_child
from .step import RunSpec
from .stepstats import combine_runs


def get_ceilings(out: Path, budget: Budget, matmul_tflops: float | None) -> dict:
    if matmul_tflops:
        return {"matmul_flop_per_s": matmul_tflops * 1e12, "source": "--matmul-tflops"}
    found = run_child(["--ceilings"], out / "ceilings.json", out / "ceilings.log", budget.left())
    return {**found, "source": "measured in this invocation"}


def _attach(result: dict, ceilings: dict) -> dict:
    rate = ceilings.get("matmul_flop_per_s")
    result["matmul_flop_per_s"] = rate
    rate = rate and rate * result.get("nproc", 1)  # tokens/s is the world's: MFU per GPU
    result["matmul_source"] = ceilings.get("source")
    result["mfu"] = utilization(result.get("tokens_per_s"), result.get("model_flops_per_token"), rate)
    result["hfu"] = utilization(result.get("tokens_per_s"), result.get("hardware_flops_per_token"), rate)
    return result


def run_e2e(configs: list[str], impls: list[str], gcs: list[bool], out: Path, *, seq: int | None = None,
            batch: int | None = None, warmup: int = 2, steps: int = 20, seed: int = 0, layers: int | None = None,
            budget_s: float = 540.0, matmul_tflops: float | None = None, nproc: int = 1, distributed: str = "none",
            memory_cap_gib: float | None = None, repeat: int = 1, profile_steps: int = 3, dora: bool = False,
            log=print) -> list[dict]:
    """Every (config, gc, impl) run in its own child, ``repeat`` times interleaved; JSON per (config, gc, impl) in
    ``out``; returns the results of this call (one per (config, gc, impl) that ran, repeats combined).
    ``distributed`` "ddp" or "fsdp" launches each child under torchrun with ``nproc`` processes (one GPU each;
    ``seq`` x ``batch`` per GPU; tokens/s global, MFU per GPU, peak of the busiest GPU). ``profile_steps`` steps
    after the timed ones run under torch.profiler (GPU-busy fraction; 0: none). ``dora``: PEFT's DoRA adapters
    (``use_dora=True``) in every run. Raises ValueError for repeat < 1."""
    if repeat < 1:
        raise ValueError(f"repeat must be >= 1, got {repeat}")
    out.mkdir(parents=True, exist_ok=True)
    specs = []
    for config_path in configs:
        config = load_config(config_path, layers)
        default_seq, default_batch = default_shape(config)
        for gc in gcs:
            for impl in impls:
                specs.append(RunSpec(impl, config_path, seq or default_seq, batch or default_batch, gc, warmup,
                                     steps, seed, layers=layers, nproc=nproc, distributed=distributed,
                                     memory_cap_gib=memory_cap_gib, profile_steps=profile_steps, dora=dora))
    budget = Budget(budget_s)
    ceilings = get_ceilings(out, budget, matmul_tflops)
    log(f"matmul ceiling: {ceilings.get('matmul_flop_per_s', math.nan) / 1e12:.0f} TFLOP/s "
        f"({ceilings.get('source')}{', ' + ceilings['error'] if ceilings.get('error') else ''})")
    runs: dict[str, list[dict]] = {}  # spec name -> its runs in this call
    for k in range(repeat):
        for spec in specs:
            if not budget.can_start():
                log(f"not run (budget of {budget_s:.0f} s spent): {spec.name}"
                    + (f" run {k + 1} of {repeat}" if repeat > 1 else ""))
                continue
            path = out / f"{spec.name}.json"
            log_path = out / (f"{spec.name}.log" if repeat == 1 else f"{spec.name}.run{k + 1}.log")
            result = run_child(["--one", json.dumps(dataclasses.asdict(spec))], path, log_path,
                               budget.left(), keep=False,  # stored below, with the parent's fields
                               nproc=spec.nproc if spec.distributed != "none" else None)
            budget.record(result.get("wall_s", 0.0))
            result = _attach({**dataclasses.asdict(spec), "model": model_name(spec.config), "name": spec.name,
                              **result}, ceilings)
            runs.setdefault(spec.name, []).append(result)
            log(_one_line(result) + (f" (run {k + 1} of {repeat})" if repeat > 1 else ""))
            if repeat > 1:
                result = combine_runs(runs[spec.name])
            # an oom, error or crash of a rerun keeps the earlier measurement (the log has this run's)
            if result.get("status") != "ok" and _ok_result(path):
                log(f"{spec.name}: kept the earlier result in {path} (this run: {result.get('status')})")
            else:
                path.write_text(json.dumps(result, indent=1))
    results = [runs[s.name][0] if repeat == 1 else combine_runs(runs[s.name]) for s in specs if s.name in runs]
    if repeat > 1:
        for r in results:
            log(f"{r['name']}: {r.get('status')}, tokens/s of {len(r['runs'])} runs: "
                + " / ".join(_fmt(x.get("tokens_per_s"), ".0f") for x in r["runs"])
                + f"; worst {_fmt(r.get('tokens_per_s_worst'), '.0f')}, median "
                  f"{_fmt(r.get('tokens_per_s_median'), '.0f')}")
    return results


def _fmt(value, fmt: str) -> str:
    return "n/a" if value is None else format(value, fmt)


def _ok_result(path: Path) -> bool:
    try:
        return json.loads(path.read_text()).get("status") == "ok"
    except (OSError, ValueError, AttributeError):
        return False


def _one_line(r: dict) -> str:
    if r.get("status") != "ok":
        return f"{r['name']}: {r.get('status')} {r.get('error', '')}"
    def num(key, fmt, scale=1.0):
        value = r.get(key)
        return "n/a" if value is None else format(scale * value, fmt)

    return (f"{r['name']}: {num('tokens_per_s', '.0f')} tok/s, peak {num('peak_gib', '.2f')} GiB, loss "
            f"{num('first_loss', '.4f')}, |g| {num('grad_norm', '.4g')}, MFU {num('mfu', '.1f', 100)}%, step ms "
            f"median {num('median_step_ms', '.1f')} min {num('min_step_ms', '.1f')} p90 {num('p90_step_ms', '.1f')}, "
            f"host issue {num('median_issue_ms', '.1f')} ms, GPU busy {num('busy_fraction', '.1f', 100)}% "
            f"({num('kernels_per_step', '.0f')} kernels/step), {num('wall_s', '.0f')} s")

