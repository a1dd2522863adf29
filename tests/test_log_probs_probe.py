"""benchmarks/log_probs_probe.py (issue #27's log-prob head row on the card) as a dry run on the CPU at a tiny shape:
every case's row has a time and fp32-sized errors against the float64 reference, and a path that runs out of memory
is a row with status oom."""

from __future__ import annotations

import json
import math

import bench_scripts
import torch

TINY = ["--device", "cpu", "--n", "300", "--hidden", "32", "--vocab", "1000", "--torch-n", "300,64", "--reps", "5",
        "--warmup", "1", "--ref-rows", "300"]


def _probe():
    return bench_scripts.load("log_probs_probe")


def test_log_probs_probe_cpu_dry_run(tmp_path, capsys):
    probe = _probe()
    assert probe.main([*TINY, "--out", str(tmp_path / "rows.json")]) == 0
    rows = json.loads((tmp_path / "rows.json").read_text())["rows"]
    assert [(r["path"], r["n"], r["grads"]) for r in rows] == [
        ("leantune", 300, "hidden"), ("leantune", 300, "hidden"), ("leantune", 300, "hidden"),
        ("leantune", 300, "hidden+weight"), ("torch", 300, "hidden"), ("torch", 64, "hidden")]
    for r in rows:
        assert r["status"] == "ok" and math.isfinite(r["ms"]) and r["ms"] > 0
        # fp32 against float64 over every row (300 rows: one chunk at 256 MiB and at 32 MiB)
        assert r["logp_err"] <= 1e-5 and r["dhidden_err"] <= 1e-5, r
        assert r["peak_gib"] is None  # no allocator statistics on the CPU
    out = capsys.readouterr().out.rstrip().splitlines()
    assert out[-8].startswith("| path | N | grads | median ms |") and out[-1].startswith("| torch | 64 | hidden |")
    assert "not measured" in out[-9]  # the #27 line: no CUDA peak here


def test_log_probs_probe_oom_is_a_row(monkeypatch, capsys):
    probe = _probe()

    def out_of_memory(hidden, weight, tokens):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 37.09 GiB (simulated)")

    monkeypatch.setattr(probe, "torch_path", out_of_memory)
    assert probe.main([*TINY, "--torch-n", "300"]) == 0
    last = capsys.readouterr().out.rstrip().splitlines()[-1]
    assert last.startswith("| torch | 300 | hidden |") and "oom: CUDA out of memory" in last
