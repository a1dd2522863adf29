"""Step-time statistics of `leantune bench e2e` (bench/stepstats.py): quantiles, the union of device intervals, the
busy fraction, the extraction of profiler events, repeated runs combined, the step table, and `--repeat` end to end
with fake children."""

from __future__ import annotations

import json
import random

import pytest
from transformers import LlamaConfig

from leantune.bench import e2e, report, stepstats
from leantune.bench.stepstats import busy_fraction, combine_runs, quantile, step_stats, union_length


def test_quantile_interpolates_between_order_statistics():
    # h = (n - 1) p; q = x_f + (h - f)(x_{f+1} - x_f), computed here by hand
    xs = [40.0, 10.0, 30.0, 20.0]  # sorted 10, 20, 30, 40
    assert quantile(xs, 0.5) == 25.0  # h = 1.5
    assert quantile(xs, 0.9) == pytest.approx(30.0 + 0.7 * 10.0)  # h = 2.7
    assert quantile(xs, 0.0) == 10.0 and quantile(xs, 1.0) == 40.0
    assert quantile([7.0], 0.9) == 7.0
    draws = [random.random() for _ in range(21)]  # odd n: the median is the middle order statistic
    assert quantile(draws, 0.5) == sorted(draws)[10]
    assert quantile(draws, 0.9) == pytest.approx(sorted(draws)[18])  # h = 18 exactly
    with pytest.raises(ValueError, match="no values"):
        quantile([], 0.5)
    with pytest.raises(ValueError, match=r"p must be in \[0, 1\]"):
        quantile(xs, 1.5)


def test_step_stats_of_twenty_steps():
    steps = [100.0 + i for i in range(20)]  # 100..119
    issue = [50.0 + i for i in range(20)]
    s = step_stats(steps, issue)
    assert s["median_step_ms"] == 109.5 and s["min_step_ms"] == 100.0
    assert s["p90_step_ms"] == pytest.approx(100.0 + 17.1)  # h = 19 * 0.9 = 17.1
    assert s["p90_over_median"] == pytest.approx(117.1 / 109.5)
    assert s["median_issue_ms"] == 59.5 and s["issue_over_step"] == pytest.approx(59.5 / 109.5)
    assert "median_issue_ms" not in step_stats(steps)
    with pytest.raises(ValueError, match="3 issue times for 20 steps"):
        step_stats(steps, issue[:3])
    with pytest.raises(ValueError, match="at least one step"):
        step_stats([])


@pytest.mark.parametrize("intervals, covered", [
    ([(0, 10), (5, 15)], 15),  # overlapping
    ([(0, 100), (10, 20), (30, 40)], 100),  # nested
    ([(0, 10), (20, 25), (40, 41)], 16),  # disjoint
    ([(20, 25), (0, 10), (5, 8), (9, 12), (30, 30)], 17),  # unsorted, nested, chained overlap, empty
    ([(0, 10), (10, 20)], 20),  # touching
    ([], 0),
])
def test_union_of_intervals(intervals, covered):
    assert union_length(intervals) == covered
    assert busy_fraction(intervals, 200) == covered / 200


def test_union_matches_a_fine_grid_on_random_intervals():
    """A brute-force reference: count unit cells covered by any interval of random integer endpoints."""
    rng = random.Random()
    spans = []
    for _ in range(40):
        s = rng.randrange(0, 500)
        spans.append((s, s + rng.randrange(0, 60)))
    cells = {c for s, e in spans for c in range(s, e)}
    assert union_length(spans) == len(cells)


def test_busy_fraction_errors():
    with pytest.raises(ValueError, match="ends before it starts"):
        union_length([(5, 1)])
    with pytest.raises(ValueError, match="wall time must be positive, got 0"):
        busy_fraction([(0, 1)], 0)


class _Event:
    def __init__(self, kind, device, start, duration):
        self.kind, self.device, self.start, self.duration = kind, device, start, duration

    def activity_type(self):
        return self.kind

    def device_type(self):
        return self.device

    def start_ns(self):
        return self.start

    def duration_ns(self):
        return self.duration


def test_device_intervals_take_the_gpu_activities_and_count_kernels():
    events = [_Event("cpu_op", "DeviceType.CPU", 0, 1000), _Event("cuda_runtime", "DeviceType.CPU", 5, 3),
              _Event("kernel", "DeviceType.CUDA", 10, 20), _Event("kernel", "DeviceType.CUDA", 15, 10),
              _Event("gpu_memcpy", "DeviceType.CUDA", 40, 5), _Event("gpu_memset", "DeviceType.CUDA", 50, 1)]
    intervals, kernels = stepstats.device_intervals(events, "cuda")
    assert intervals == [(10, 30), (15, 25), (40, 45), (50, 51)] and kernels == 2
    assert union_length(intervals) == 26
    intervals, ops = stepstats.device_intervals(events, "cpu")  # the CPU dry run: operators stand in
    assert intervals == [(0, 1000)] and ops == 1


class _Event211(_Event):
    """torch 2.11's profiler event: no activity_type(); the kind is read from the device and the name."""

    activity_type = property()  # hasattr() is False

    def __init__(self, name, device, start, duration):
        super().__init__(None, device, start, duration)
        self._name = name

    def name(self):
        return self._name


def test_device_intervals_without_activity_type():
    events = [_Event211("aten::mm", "DeviceType.CPU", 0, 1000), _Event211("sm90_gemm", "DeviceType.CUDA", 10, 20),
              _Event211("Memcpy HtoD (Pinned -> Device)", "DeviceType.CUDA", 40, 5),
              _Event211("Memset (Device)", "DeviceType.CUDA", 50, 1), _Event211("triton_rms", "DeviceType.CUDA", 60, 4)]
    intervals, kernels = stepstats.device_intervals(events, "cuda")
    assert intervals == [(10, 30), (40, 45), (50, 51), (60, 64)] and kernels == 2


def test_top_kernels_rank_device_time_by_name_per_step():
    events = [_Event211("aten::mm", "DeviceType.CPU", 0, 1000), _Event211("gemm", "DeviceType.CUDA", 10, 20),
              _Event211("flash_bwd", "DeviceType.CUDA", 40, 50), _Event211("gemm", "DeviceType.CUDA", 100, 40),
              _Event211("Memcpy HtoD (Pinned -> Device)", "DeviceType.CUDA", 200, 500)]
    top = stepstats.top_kernels(events, "cuda", steps=2, n=5)
    assert top == [{"name": "gemm", "ms_per_step": 30e-6, "calls_per_step": 1.0},
                   {"name": "flash_bwd", "ms_per_step": 25e-6, "calls_per_step": 0.5}]  # copies are not kernels
    assert stepstats.top_kernels(events, "cuda", steps=1, n=1)[0]["name"] == "gemm"
    assert stepstats.top_kernels(events, "cpu", steps=1) == [{"name": "aten::mm", "ms_per_step": 1e-3,
                                                             "calls_per_step": 1.0}]


def test_profile_pass_on_the_cpu(monkeypatch):
    import torch

    x = torch.randn(32, 32, requires_grad=True)
    calls = []

    def step():
        calls.append(1)
        (x @ x).tanh().sum().backward()

    r = stepstats.profile_pass(step, 2, "cpu", lambda: None)
    assert r["profiled_steps"] == 2 and r["kernels_per_step"] >= 3  # at least mm, tanh, sum per step
    assert len(calls) == 3  # one more in the profiler's warm-up, not recorded: the same operators per step
    assert stepstats.profile_pass(step, 1, "cpu", lambda: None)["kernels_per_step"] == r["kernels_per_step"]
    assert 0 < r["busy_fraction"] <= 1 and 0 < r["busy_ms_per_step"] <= r["profiled_step_ms"]
    assert "profile_error" not in r
    assert r["top_kernels"] and {t["name"] for t in r["top_kernels"]} & {"aten::mm", "aten::tanh"}
    # a profiler that saw no device activity (CUPTI unavailable) gives no fraction, not 0 %
    monkeypatch.setattr(stepstats, "device_intervals", lambda events, device: ([], 0))
    r = stepstats.profile_pass(step, 1, "cpu", lambda: None)
    assert r["busy_fraction"] is None and r["kernels_per_step"] is None and "no device activity" in r["profile_error"]


def _run(tps, status="ok", p90=1.05, **kw):
    return {"status": status, "tokens_per_s": tps, "p90_over_median": p90, "step_ms": [1.0, 2.0], "wall_s": 1.0,
            "error": None if status == "ok" else "boom", **kw}


def test_combine_runs_takes_the_median_run_and_the_worst():
    runs = [_run(9000.0, p90=1.02), _run(6000.0, p90=1.30), _run(8000.0, p90=1.04)]
    c = combine_runs(runs)
    assert c["status"] == "ok" and c["tokens_per_s"] == 8000.0 and c["p90_over_median"] == 1.04  # the median run
    assert c["tokens_per_s_worst"] == 6000.0 and c["tokens_per_s_median"] == 8000.0
    assert c["p90_over_median_worst"] == 1.30 and c["repeat"] == 3 and c["runs"] == runs
    two = combine_runs([_run(100.0), _run(300.0)])
    assert two["tokens_per_s"] == 100.0 and two["tokens_per_s_median"] == 200.0  # lower middle run; mean of two
    failed = combine_runs([_run(9000.0), _run(None, status="oom")])
    assert failed["status"] == "oom" and failed["error"] == "run 2 of 2: boom" and len(failed["runs"]) == 2
    with pytest.raises(ValueError, match="at least one run"):
        combine_runs([])


def _row(impl, tps, runs=None, **kw):
    row = {"impl": impl, "model": "m", "layers": None, "seq": 4096, "batch": 1, "gc": True, "status": "ok",
           "name": f"m_{impl}", "first_loss": 2.0, "grad_norm": 1.0, "tokens_per_s": tps, "peak_gib": 10.0,
           "peak_minus_frozen_gib": 6.0, "mfu": 0.25, "hfu": 0.5, "step_ms": [600.0] * 20, "median_step_ms": 600.0,
           "min_step_ms": 590.0, "p90_step_ms": 630.0, "p90_over_median": 1.05, "median_issue_ms": 300.0,
           "issue_over_step": 0.5, "busy_fraction": 0.96, "kernels_per_step": 4020.0, **kw}
    if runs:
        row.update(runs=[{"tokens_per_s": t} for t in runs], tokens_per_s_worst=min(runs), repeat=len(runs))
    return row


def test_step_table_in_results_md(tmp_path):
    rows = [_row("hf+peft", 6000.0), _row("leantune", 9000.0, runs=[9000.0, 6600.0, 9900.0])]
    for r in rows:
        (tmp_path / f"{r['name']}.json").write_text(json.dumps(r))
    text = report.write_report(tmp_path, log=lambda *a: None)
    steps = [line for line in text.split("Step times")[1].splitlines() if line.startswith("| m |")]
    assert len(steps) == 2
    assert steps[0] == ("| m | 4096 x 1 | on | hf+peft | 20 x 1 | 6000 | 6000 | 1.00 | 600.0 | 590.0 | 630.0 | "
                        "1.050 | 300.0 | 0.50 | 96% | 4020 |")
    assert steps[1] == ("| m | 4096 x 1 | on | leantune | 20 x 3 | 9000 / 6600 / 9900 | 6600 | 1.10 | 600.0 | "
                        "590.0 | 630.0 | 1.050 | 300.0 | 0.50 | 96% | 4020 |")
    assert (tmp_path / "step_ms.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (tmp_path / "m_leantune.json").write_text(json.dumps({**rows[1], "busy_fraction": "high"}))
    with pytest.raises(report.ReportError, match="'busy_fraction' must be a number or null"):
        report.write_report(tmp_path, log=lambda *a: None)


def test_repeat_runs_every_child_k_times_interleaved(tmp_path, monkeypatch):
    LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2).save_pretrained(tmp_path / "tiny")
    order, speed = [], {"hf+peft": [6000.0, 6100.0, 5900.0], "leantune": [9000.0, 6000.0, 8000.0]}

    def fake_child(args, result, log, timeout_s, **kw):
        if args == ["--ceilings"]:
            return {"matmul_flop_per_s": 1e12, "wall_s": 1.0}
        impl = json.loads(args[1])["impl"]
        order.append((impl, log.name))
        tps = speed[impl][sum(i == impl for i, _ in order) - 1]
        return {"status": "ok", "first_loss": 2.0, "grad_norm": 1.0, "tokens_per_s": tps, "p90_over_median": 1.05,
                "step_ms": [1.0] * 20, "median_step_ms": 1.0, "wall_s": 1.0}

    monkeypatch.setattr(e2e, "run_child", fake_child)
    results = e2e.run_e2e([str(tmp_path / "tiny")], ["hf+peft", "leantune"], [True], tmp_path / "out", repeat=3,
                          log=lambda *a: None)
    assert [i for i, _ in order] == ["hf+peft", "leantune"] * 3  # interleaved
    assert len({name for _, name in order}) == 6 and order[0][1].endswith(".run1.log")  # one log per run
    assert [(r["impl"], r["tokens_per_s"], r["tokens_per_s_worst"], len(r["runs"])) for r in results] == [
        ("hf+peft", 6000.0, 5900.0, 3), ("leantune", 8000.0, 6000.0, 3)]
    stored = json.loads((tmp_path / "out" / f"{results[1]['name']}.json").read_text())
    assert [r["tokens_per_s"] for r in stored["runs"]] == speed["leantune"] and stored["repeat"] == 3
    with pytest.raises(ValueError, match="repeat must be >= 1, got 0"):
        e2e.run_e2e([str(tmp_path / "tiny")], ["hf+peft"], [True], tmp_path / "out", repeat=0)
