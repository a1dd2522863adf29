"""Bookkeeping of `leantune bench` on CPU: FLOP formulas, MFU/HFU, frozen-weight bytes, ratios, agreement flags, the
markdown table, the bisection, the CLI's CPU error, and a dry run of the e2e child step on a tiny Llama."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from transformers import LlamaConfig

from leantune.bench import build, e2e, harness, max_context, report, step
from leantune.bench.flops import (
    attention_flops_per_token,
    default_shape,
    frozen_weight_bytes,
    hardware_flops_per_token,
    matmul_params,
    model_flops_per_token,
    utilization,
)
from leantune.bench.max_context import bisect_max_fitting
from leantune.bench.step import RunSpec
from leantune.cli import main as cli_main

LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False)
TINY = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)


@pytest.fixture
def tiny_config(tmp_path):
    LlamaConfig(**TINY, tie_word_embeddings=True).save_pretrained(tmp_path / "tiny")
    return str(tmp_path / "tiny")


# ------------------------------------------------------------------------------------------------------------ FLOPs
def test_flops_llama3_8b_by_hand():
    config = LlamaConfig(**LLAMA3_8B)
    h, i, kv, v, layers = 4096, 14336, 1024, 128256, 32
    per_layer = h * h + h * kv + h * kv + h * h + 3 * h * i  # q, k, v, o, gate, up, down
    p_layers = layers * per_layer
    assert p_layers == 6_979_321_856
    assert matmul_params(config, lm_head=False) == p_layers
    assert matmul_params(config) == p_layers + v * h == 7_504_658_432  # "P = 7.50e9"
    a = 2 * 4096 * 32 * 128 * 32
    assert attention_flops_per_token(config, 4096) == a == 1_073_741_824
    assert model_flops_per_token(config, 4096) == 4 * 7_504_658_432 + 3 * a == 33_239_859_200
    assert hardware_flops_per_token(config, 4096, False) == 33_239_859_200
    assert hardware_flops_per_token(config, 4096, True) == 33_239_859_200 + 2 * p_layers + a == 48_272_244_736
    # attention grows linearly per token with S; P does not
    assert model_flops_per_token(config, 8192) - model_flops_per_token(config, 4096) == 3 * a


def test_flops_tied_lm_head_and_default_head_dim():
    config = LlamaConfig(**TINY, tie_word_embeddings=True)  # head_dim = 64 / 4 = 16
    per_layer = 64 * 64 + 64 * 32 + 64 * 32 + 64 * 64 + 3 * 64 * 96
    assert matmul_params(config) == 2 * per_layer + 97 * 64  # tied lm_head is still a matmul
    assert attention_flops_per_token(config, 10) == 2 * 10 * 4 * 16 * 2


def test_utilization_math():
    assert utilization(6198.0, 33_239_859_200, 7.0e14) == pytest.approx(6198 * 33_239_859_200 / 7.0e14, rel=1e-12)
    assert utilization(1000.0, 1e9, 1e12) == pytest.approx(1.0)
    for args in ((None, 1e9, 1e12), (1000.0, 1e9, None), (1000.0, None, 1e12), (0.0, 1e9, 1e12)):
        assert math.isnan(utilization(*args))


def test_default_shape():
    assert default_shape(LlamaConfig(**LLAMA3_8B)) == (4096, 1)
    assert default_shape(LlamaConfig(**TINY)) == (8192, 2)


@pytest.mark.parametrize("tied", [True, False])
def test_frozen_weight_bytes_tiny_peft_model(tied):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    config = LlamaConfig(**TINY, tie_word_embeddings=tied)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model = get_peft_model(model, LoraConfig(r=4, target_modules=build.TARGETS, init_lora_weights=False))
    h, i, kv, v = 64, 96, 32, 97
    layer = h * h + 2 * h * kv + h * h + 3 * h * i + 2 * h  # projections + two norms
    elements = v * h + 2 * layer + h + (0 if tied else v * h)  # embedding, layers, final norm, lm_head
    assert frozen_weight_bytes(model) == 2 * elements  # bf16; adapters (fp32, trainable) excluded


def test_seeded_init_depends_on_seed_and_names_only():
    from transformers import AutoModelForCausalLM

    def draw(torch_seed, seed):
        torch.manual_seed(torch_seed)
        model = AutoModelForCausalLM.from_config(LlamaConfig(**TINY), dtype=torch.bfloat16)
        build.seeded_init(model, seed, trainable_only=False, std=0.02)
        return model.state_dict()

    a, b, c = draw(1, 7), draw(2, 7), draw(1, 8)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    matrices = [n for n in a if a[n].dim() == 2]
    assert all(not torch.equal(a[n], c[n]) for n in matrices)
    w = a["model.layers.0.mlp.down_proj.weight"].float()
    assert abs(w.std().item() - 0.02) < 0.002 and abs(w.mean().item()) < 0.002
    assert torch.equal(a["model.norm.weight"], torch.ones(64, dtype=torch.bfloat16))


# ----------------------------------------------------------------------------------------------------- bisection
@pytest.mark.parametrize("threshold", [0, 4096, 8192, 45056, 49152, 65535, 262144, 10**7])
def test_bisection_finds_the_largest_fitting_multiple(threshold):
    calls = []

    def fits(seq):
        calls.append(seq)
        return seq <= threshold

    found = bisect_max_fitting(fits, 4096, 262144, 4096)
    expected = threshold // 4096 * 4096
    expected = min(expected, 262144) if expected >= 4096 else None
    assert found["best"] == expected
    assert found["complete"]
    assert len(calls) == len(set(calls)) <= math.ceil(math.log2(64 + 1))
    assert all(s % 4096 == 0 and 4096 <= s <= 262144 for s in calls)
    assert found["probes"] == [[s, s <= threshold] for s in calls]
    if expected is not None and expected < 262144:
        assert found["first_fail"] == expected + 4096
    if expected == 262144:
        assert found["first_fail"] is None


def test_bisection_rounds_inward_and_rejects_empty_ranges():
    found = bisect_max_fitting(lambda s: s <= 5000, 1000, 10000, 1024)  # candidates 1024 .. 9216
    assert found["best"] == 4096 and found["first_fail"] == 5120
    with pytest.raises(ValueError, match="no multiple of 4096"):
        bisect_max_fitting(lambda s: True, 5000, 8000, 4096)
    with pytest.raises(ValueError, match="step must be positive"):
        bisect_max_fitting(lambda s: True, 4096, 8192, 0)


def test_bisection_stops_on_budget_and_on_failed_probe():
    budget = iter([False, False, True])  # two probes allowed
    found = bisect_max_fitting(lambda s: s <= 100_000, 4096, 262144, 4096, stop=lambda: next(budget))
    assert len(found["probes"]) == 2 and not found["complete"]
    assert found["probes"] == [[131072, False], [65536, True]]
    assert found["best"] == 65536 and found["first_fail"] == 131072  # the bracket to resume from
    found = bisect_max_fitting(lambda s: None, 4096, 262144, 4096)  # a crash/timeout ends the search
    assert found["probes"] == [[131072, None]] and not found["complete"] and found["best"] is None


def test_budget_with_fake_clock():
    now = [0.0]
    budget = harness.Budget(100.0, clock=lambda: now[0])
    assert budget.can_start()
    now[0] = 30.0
    budget.record(50.0)
    assert budget.left() == 70.0 and budget.can_start()
    now[0] = 60.0
    assert not budget.can_start()  # 40 s left < longest child (50 s)


# ------------------------------------------------------------------------------------------- agreement, ratios, table
def _row(impl, gc=True, loss=2.0, grad=1.0, tps=1000.0, peak=10.0, frozen=4.0, model="m", seq=4096, status="ok"):
    return {"impl": impl, "model": model, "layers": None, "seq": seq, "batch": 1, "gc": gc, "status": status,
            "name": f"{model}_{impl}_{gc}", "first_loss": loss, "grad_norm": grad, "tokens_per_s": tps,
            "peak_gib": peak, "peak_minus_frozen_gib": peak - frozen, "median_step_ms": 4096 / tps * 1e3,
            "mfu": 0.25, "hfu": 0.5, "error": None if status == "ok" else "boom"}


def test_agreement_flags():
    rows = [_row("hf+peft", gc=True, loss=2.0, grad=1.0),
            _row("leantune", gc=True, loss=2.0 * (1 + 0.009), grad=1.0 * (1 - 0.029)),  # inside both tolerances
            _row("hf+peft+liger", gc=True, loss=2.0 * 1.011, grad=1.0),  # loss out
            _row("leantune", gc=False, loss=2.0, grad=1.031),  # grad out; reference from the other gc setting
            _row("leantune", gc=True, loss=math.nan, model="m2"),  # no reference model
            _row("hf+peft", gc=True, model="m3"), _row("leantune", gc=True, model="m3", loss=math.nan),
            _row("leantune", gc=True, model="m4", status="oom")]
    report.flag_agreement(rows)
    assert [r["agreement"] for r in rows] == [
        "reference", "ok", "FLAG: loss rel 1.10e-02 > 0.01", "FLAG: grad-norm rel 3.10e-02 > 0.03", "no reference",
        "reference", "FLAG: loss rel nan > 0.01", None]
    assert rows[1]["loss_rel_diff"] == pytest.approx(0.009) and rows[1]["grad_norm_rel_diff"] == pytest.approx(0.029)


def test_agreement_prefers_the_same_checkpointing_setting():
    rows = [_row("hf+peft", gc=False, loss=3.0), _row("hf+peft", gc=True, loss=2.0), _row("leantune", gc=True)]
    report.flag_agreement(rows)
    assert rows[2]["agreement"] == "ok"


def test_compare_ratios():
    rows = [_row("hf+peft", tps=6198.0, peak=24.0, frozen=15.0), _row("leantune", tps=9297.0, peak=18.0, frozen=15.0),
            _row("hf+peft+liger", status="error"), _row("leantune", gc=False, tps=1.0)]  # no gc-off baseline
    (c,) = report.compare(rows)
    assert c["impl"] == "leantune"
    assert c["tokens_per_s"] == pytest.approx(1.5) and c["peak_gib"] == pytest.approx(0.75)
    assert c["peak_minus_frozen_gib"] == pytest.approx(3.0 / 9.0)
    assert math.isnan(report.ratio(1.0, 0.0)) and math.isnan(report.ratio(None, 1.0))
    maxctx = [{"model": "m", "layers": None, "impl": "hf+peft", "best": 49152},
              {"model": "m", "layers": None, "impl": "leantune", "best": 163840},
              {"model": "m", "layers": None, "impl": "hf+peft+liger", "best": None}]
    mx = report.compare_max_context(maxctx)
    assert mx[("m", None, None, "leantune")] == pytest.approx(163840 / 49152)
    assert mx[("m", None, None, "hf+peft")] == 1.0
    assert math.isnan(mx[("m", None, None, "hf+peft+liger")])
    text = report.format_compare(rows, maxctx)
    assert "tokens/s x1.50, peak GiB x0.75" in text and "max context m leantune: x3.33" in text


def test_markdown_table():
    rows = [_row("hf+peft", tps=6198.0, peak=24.0, frozen=15.0), _row("leantune", tps=9297.0, peak=18.0, frozen=15.0),
            _row("hf+peft+liger", status="oom")]
    rows[0].update(date="2026-01-01", gpu="H200", versions={"torch": "2.x"}, matmul_flop_per_s=7.0e14)
    report.flag_agreement(rows)
    maxctx = [{"model": "m", "layers": None, "impl": "hf+peft", "best": 49152, "first_fail": 53248,
               "complete": True, "hi": 262144, "probes": [[49152, True], [53248, False]]},
              {"model": "m", "layers": None, "impl": "leantune", "best": 163840, "first_fail": None,
               "complete": False, "hi": 262144, "probes": [[163840, True], [200000, None]]}]
    text = report.markdown(rows, maxctx)
    lines = text.splitlines()
    assert lines[0].startswith("2026-01-01, H200, torch 2.x. bf16 matmul ceiling 700 TFLOP/s (8192^3, measured")
    rows[0]["matmul_source"] = "--matmul-tflops"  # a ceiling given on the command line is not called measured
    assert "700 TFLOP/s (given by --matmul-tflops)" in report.markdown(rows, maxctx).splitlines()[0]
    table = [line for line in lines if line.startswith("| m |")]
    assert table[0] == ("| m | 4096 x 1 | on | hf+peft | 6198 | — | 24.00 | 9.00 | 25.0% | 50.0% | 661 | 2.0000 "
                        "| 1 | reference |")
    assert table[1] == ("| m | 4096 x 1 | on | leantune | 9297 | 1.50 | 18.00 | 3.00 | 25.0% | 50.0% | 441 | "
                        "2.0000 | 1 | ok |")
    assert table[2].startswith("| m | 4096 x 1 | on | hf+peft+liger | oom: boom |")
    assert all(line.count("|") == 15 for line in table[:3])  # 14 columns in every e2e row
    assert table[3] == "| m | hf+peft | 49152 | 53248 | 1.00 | 49152: y, 53248: n |"
    assert table[4] == "| m | leantune | 163840 (incomplete) | — | 3.33 | 163840: y, 200000: ? |"


def test_report_cli_writes_table_and_pngs(tmp_path, capsys):
    rows = [_row("hf+peft"), _row("leantune", tps=1500.0)]
    for r in rows:
        (tmp_path / f"{r['name']}.json").write_text(json.dumps(r))
    (tmp_path / "ceilings.json").write_text(json.dumps({"matmul_flop_per_s": 1.0}))
    assert cli_main(["bench", "report", "--out", str(tmp_path), "--compare"]) == 0
    out = capsys.readouterr().out
    assert "tokens/s x1.50" in out
    assert "| m | 4096 x 1 | on | leantune | 1500 | 1.50 |" in (tmp_path / "results.md").read_text()
    for name in ("tokens_per_s.png", "peak_gib.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------------------------------------------------- the CLI
@pytest.mark.parametrize("argv", [["e2e", "--configs", "CONFIG"], ["max-context", "--config", "CONFIG"], ["ops"]])
def test_cli_needs_cuda(argv, monkeypatch, capsys, tmp_path, tiny_config):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    argv = [tiny_config if a == "CONFIG" else a for a in argv]
    code = cli_main(["bench", *argv, "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    assert err.strip() == ("leantune: error: `leantune bench` needs a CUDA GPU (none is visible); `leantune bench "
                           "report` works anywhere")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv, message", [(["e2e", "--configs", "x", "--impls", "hf,leantune"],
                                            "unknown implementation(s) hf"),
                                           (["e2e", "--configs", "x", "--gc", "maybe"], "--gc takes on, off"),
                                           (["ops", "--ops", "rms_norm,nope"], "unknown op(s) nope"),
                                           (["report", "--out", "/nonexistent/dir"],
                                            "/nonexistent/dir: does not exist"),
                                           (["max-context", "--config", "x", "--step", "0"], "--step must be positive"),
                                           (["max-context", "--config", "x", "--lo", "300000", "--hi", "200000"],
                                            "no multiple of 4096 in [300000, 200000] (--step, --lo, --hi"),
                                           (["max-context", "--config", "x", "--memory-cap-gib", "0"],
                                            "--memory-cap-gib must be a positive number of GiB, got 0.0"),
                                           (["e2e", "--configs", "x", "--repeat", "0"], "--repeat must be >= 1, got 0"),
                                           (["e2e", "--configs", "x", "--profile-steps", "-1"],
                                            "--profile-steps must be >= 0, got -1")])
def test_cli_option_errors(argv, message, capsys):
    code = cli_main(["bench", *argv])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err and message in err


# --------------------------------------------------------------------------------------------- parent orchestration
def test_run_e2e_with_fake_children(tiny_config, tmp_path, monkeypatch):
    calls = []

    def fake_child(args, result, log, timeout_s, **kw):
        calls.append(args)
        if args == ["--ceilings"]:
            return {"matmul_flop_per_s": 1e12, "wall_s": 1.0}
        spec = json.loads(args[1])
        return {"status": "ok", "first_loss": 2.0, "grad_norm": 1.0, "tokens_per_s": 100.0, "peak_gib": 1.0,
                "peak_minus_frozen_gib": 0.5, "model_flops_per_token": 1e9, "hardware_flops_per_token": 2e9,
                "median_step_ms": 1.0, "wall_s": 2.0, **({"first_loss": 9.0} if spec["impl"] == "leantune" else {})}

    monkeypatch.setattr(e2e, "run_child", fake_child)
    results = e2e.run_e2e([tiny_config], ["hf+peft", "leantune"], [True, False], tmp_path, steps=3,
                          log=lambda *a: None)
    assert len(results) == 4 and len(calls) == 5
    specs = [json.loads(a[1]) for a in calls[1:]]
    assert {(s["impl"], s["gc"], s["seq"], s["batch"], s["steps"]) for s in specs} == {
        (i, g, 8192, 2, 3) for i in ("hf+peft", "leantune") for g in (True, False)}
    assert results[0]["mfu"] == pytest.approx(100 * 1e9 / 1e12) and results[0]["hfu"] == pytest.approx(0.2)
    rows, _ = report.load_results(tmp_path)
    report.flag_agreement(rows)
    assert sorted(r["agreement"] for r in rows) == ["FLAG: loss rel 3.50e+00 > 0.01"] * 2 + ["reference"] * 2


def test_run_e2e_respects_the_budget(tiny_config, tmp_path, monkeypatch):
    monkeypatch.setattr(e2e, "run_child", lambda args, *a, **k: {"status": "ok", "wall_s": 1e6})
    logged = []
    results = e2e.run_e2e([tiny_config], ["hf+peft", "leantune"], [True], tmp_path, matmul_tflops=700.0,
                          budget_s=1000.0, log=logged.append)
    assert len(results) == 1  # the first child took longer than the budget left: the second is not started
    assert any(line.startswith("not run (budget") and "leantune" in line for line in logged)


def test_run_max_context_with_fake_children(tiny_config, tmp_path, monkeypatch):
    limits = {"hf+peft": 49152, "leantune": 180000}

    def fake_child(args, result, log, timeout_s, **kw):
        spec = json.loads(args[1])
        assert spec["batch"] == 1 and spec["gc"] and spec["steps"] == 1 and spec["warmup"] == 0
        return {"status": "ok" if spec["seq"] <= limits[spec["impl"]] else "oom", "wall_s": 1.0}

    monkeypatch.setattr(max_context, "run_child", fake_child)
    results = max_context.run_max_context(tiny_config, ["hf+peft", "leantune"], tmp_path, lo=4096, hi=262144, step=4096,
                                  log=lambda *a: None)
    assert [(r["best"], r["first_fail"], r["complete"]) for r in results] == [(49152, 53248, True),
                                                                             (176128, 180224, True)]
    _, maxctx = report.load_results(tmp_path)
    assert [r["impl"] for r in maxctx] == ["hf+peft", "leantune"]
    assert "| tiny | leantune | 176128 | 180224 | 3.58 |" in report.markdown([], maxctx)


# ------------------------------------------------------------------------------------------- the child, dry run on CPU
def test_child_dry_run_on_cpu_agrees_between_implementations(tiny_config):
    rows = []
    for impl in ("hf+peft", "leantune"):
        for gc in (False, True):
            profile = 1 if (impl, gc) == ("leantune", True) else 0  # one profiled pass: the CPU's operators
            r = step.run_one_safe(RunSpec(impl, tiny_config, seq=24, batch=2, gc=gc, warmup=1, steps=2, device="cpu",
                                          profile_steps=profile))
            assert r["status"] == "ok", r.get("error")
            assert len(r["step_ms"]) == 2 and r["tokens_per_s"] > 0 and math.isfinite(r["last_loss"])
            # step statistics of the timed steps; the host issue time is part of its step
            assert r["tokens_per_s"] == pytest.approx(2 * 2 * 24 / (sum(r["step_ms"]) / 1e3))
            assert r["median_step_ms"] == pytest.approx(sum(r["step_ms"]) / 2) and r["min_step_ms"] == min(r["step_ms"])
            assert r["min_step_ms"] <= r["median_step_ms"] <= r["p90_step_ms"] <= max(r["step_ms"])
            assert len(r["issue_ms"]) == 2 and all(0 < i <= s for i, s in zip(r["issue_ms"], r["step_ms"]))
            assert 0 < r["issue_over_step"] <= 1
            if profile:
                assert r["profiled_steps"] == 1 and r["kernels_per_step"] > 0 and 0 < r["busy_fraction"] <= 1
            else:
                assert "busy_fraction" not in r
            assert r["lora_params"] == 2 * 16 * (128 + 96 + 96 + 128 + 3 * 160)  # r=16 on all 7 projections
            rows.append(r)
    hf_off, hf_on, lt_off, lt_on = rows
    # the first-step loss is that of the freshly built model (the optimizer priming left the weights unchanged)
    model, config = step.build(RunSpec("hf+peft", tiny_config, seq=24, batch=2, gc=False, device="cpu"))
    ids = torch.randint(0, config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert model(input_ids=ids, labels=ids).loss.item() == hf_off["first_loss"]
    assert hf_off["first_loss"] == hf_on["first_loss"]  # checkpointing does not change the math
    assert hf_off["grad_norm"] == pytest.approx(hf_on["grad_norm"], rel=1e-6)
    assert 0 < lt_off["first_loss"] and lt_off["grad_norm"] > 0
    assert lt_on["leantune_summary"] is not None and hf_on["leantune_summary"] is None
    report.flag_agreement(rows)
    assert [r["agreement"] for r in rows] == ["reference", "reference", "ok", "ok"]
    # a different seed changes weights and tokens: the agreement check can fail
    other = step.run_one_safe(RunSpec("leantune", tiny_config, seq=24, batch=2, gc=False, warmup=0, steps=1,
                                     device="cpu", seed=1))
    assert other["first_loss"] != lt_off["first_loss"]


def test_nf4_moe_build_quantises_experts_layer_by_layer(tmp_path, monkeypatch):
    """A MoE config: LoRA on attention and the expert stacks in every build; ``leantune+nf4`` puts the stacks in NF4
    one layer at a time (at each layer's quantisation no other layer holds a materialised bf16 stack), the codes
    those of the bf16 build's stacks (same seeded draws), and the frozen bytes count the codes, not placeholders."""
    import importlib

    from transformers import MixtralConfig

    from leantune import ops
    from leantune.bench.flops import frozen_weight_bytes

    quantize_module = importlib.import_module("leantune.quantize")  # the module, not leantune.quantize the function

    MixtralConfig(vocab_size=96, hidden_size=64, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2).save_pretrained(tmp_path / "moe")
    live = []
    original = quantize_module.quantize_experts

    def spy(module, name="experts"):
        live.append(sum(1 for m in model_holder[0].modules() if quantize_module.expert_stacks(m)
                        and not m.gate_up_proj.is_meta))
        return original(module, name)

    model_holder = []
    from transformers import AutoModelForCausalLM

    real_from_config = AutoModelForCausalLM.from_config
    monkeypatch.setattr(AutoModelForCausalLM, "from_config",
                        lambda *a, **k: model_holder.append(real_from_config(*a, **k)) or model_holder[-1])
    monkeypatch.setattr(quantize_module, "quantize_experts", spy)
    spec = dict(config=str(tmp_path / "moe"), seq=8, batch=1, gc=True, device="cpu")
    nf4, _ = step.build(RunSpec("leantune+nf4", **spec))
    assert live == [1, 1, 1]
    bf16, _ = step.build(RunSpec("hf+peft", **spec))
    for model in (nf4, bf16):
        assert sum("experts" in n and "lora_A" in n for n, _ in model.named_parameters()) == 6
    quantised = [m for m in nf4.modules() if hasattr(m, "nf4_stack")]
    dense = [m for m in bf16.modules() if type(m).__name__ == "MixtralExperts"]
    assert len(quantised) == len(dense) == 3
    for q, d in zip(quantised, dense):
        assert torch.equal(q.nf4_stack("gate_up_proj").codes, ops.quantize_nf4(d.gate_up_proj.detach()).codes)
    assert frozen_weight_bytes(nf4) < frozen_weight_bytes(bf16) / 2
    assert nf4.leantune_summary["counts"]["experts_lora"] == 3


def test_gpt_oss_builds_with_eager_attention_and_agrees(tmp_path):
    """gpt-oss's class takes no sdpa (the card's first gpt-oss run stopped there): the bench builds it with eager
    attention, and both sides run a step that agrees (leantune serves the sinks itself)."""
    from transformers import GptOssConfig

    config = GptOssConfig(vocab_size=96, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                          num_experts_per_tok=2, sliding_window=8, max_position_embeddings=64)
    config.save_pretrained(tmp_path / "gpt-oss")
    assert build.attention_implementation(config) == "eager"
    assert build.attention_implementation(LlamaConfig(**TINY)) == "sdpa"
    rows = [step.run_one_safe(RunSpec(impl, str(tmp_path / "gpt-oss"), seq=20, batch=1, gc=True, warmup=0, steps=1,
                                      device="cpu")) for impl in ("hf+peft", "leantune")]
    assert [r["status"] for r in rows] == ["ok", "ok"], [r.get("error") for r in rows]
    report.flag_agreement(rows)  # bf16 weights: the bench's own tolerance on the first loss and grad norm
    assert [r["agreement"] for r in rows] == ["reference", "ok"], rows


def test_hf_expert_implementations_build_and_agree(tmp_path, tiny_config, monkeypatch):
    """#29's other baselines: HF+PEFT with transformers' "batched_mm" and "eager" experts build with that
    implementation, run a step, and agree with the default "grouped_mm" HF+PEFT (same seeded weights); on a dense
    config they are skipped with a note naming the model type."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    Qwen3MoeConfig(vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
                   max_position_embeddings=64).save_pretrained(tmp_path / "moe")
    built = []
    real_from_config = AutoModelForCausalLM.from_config
    monkeypatch.setattr(AutoModelForCausalLM, "from_config",
                        lambda *a, **k: built.append(real_from_config(*a, **k)) or built[-1])
    impls = ("hf+peft", "hf+peft+batched_mm", "hf+peft+eager_experts")
    rows = [step.run_one_safe(RunSpec(impl, str(tmp_path / "moe"), seq=12, batch=1, gc=True, warmup=0, steps=1,
                                      device="cpu")) for impl in impls]
    assert [r["status"] for r in rows] == ["ok"] * 3, [r.get("error") for r in rows]
    assert [m.config._experts_implementation for m in built] == ["grouped_mm", "batched_mm", "eager"]
    report.flag_agreement(rows)
    assert [r["agreement"] for r in rows] == ["reference", "ok", "ok"], rows
    dense = step.run_one_safe(RunSpec("hf+peft+batched_mm", tiny_config, seq=8, batch=1, gc=False, warmup=0,
                                      steps=1, device="cpu"))
    assert dense["status"] == "skipped" and "'llama' has no expert stacks" in dense["error"], dense


def test_child_dry_run_with_dora_agrees_with_peft(tiny_config):
    """--dora: PEFT's DoRA adapters on both sides; the patched run's first loss and grad norm agree with PEFT's."""
    runs = [step.run_one_safe(RunSpec(impl, tiny_config, seq=16, batch=1, gc=False, warmup=0, steps=1, device="cpu",
                                      dora=True)) for impl in ("hf+peft", "leantune")]
    assert all(r["status"] == "ok" for r in runs), [r.get("error") for r in runs]
    peft_run, leantune_run = runs
    assert leantune_run["leantune_summary"]["counts"]["dora"] == 14
    report.flag_agreement(runs)  # the bench's own agreement bar, as for plain LoRA
    assert [r["agreement"] for r in runs] == ["reference", "ok"], runs[1].get("agreement")
    assert RunSpec("leantune", tiny_config, seq=16, batch=1, gc=False, dora=True).name.endswith("_dora")


def test_child_skips_liger_when_not_importable(tiny_config, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "liger_kernel", None)  # import fails even if installed
    r = step.run_one_safe(RunSpec("hf+peft+liger", tiny_config, seq=8, batch=1, gc=False, device="cpu"))
    assert r["status"] == "skipped" and "liger_kernel not importable" in r["error"]


def test_child_skips_torchao_when_not_importable(tiny_config, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "torchao", None)
    monkeypatch.setitem(__import__("sys").modules, "torchao.float8", None)
    r = step.run_one_safe(RunSpec("hf+peft+torchao", tiny_config, seq=8, batch=1, gc=False, device="cpu"))
    assert r["status"] == "skipped" and "torchao not importable" in r["error"]


@pytest.mark.parametrize("compiled", [False, True])
def test_torchao_baseline_converts_only_the_frozen_base_layers(tiny_config, monkeypatch, compiled):
    """hf+peft+torchao: torchao's converter sees every module, and its filter passes exactly the 7 x layers frozen
    PEFT base layers (no LoRA A/B, no lm_head); the rowwise recipe; +compile compiles each converted module. torchao
    itself is a stub here (the CI image has none): the card runs the real one."""
    import sys
    import types

    seen, compiled_modules = {}, []

    class Float8Linear(torch.nn.Linear):
        def compile(self, *args, **kwargs):
            compiled_modules.append(self)

    def convert(model, *, module_filter_fn, config):
        for fqn, module in list(model.named_modules()):
            if isinstance(module, torch.nn.Linear) and module_filter_fn(module, fqn):
                seen[fqn] = module
                module.__class__ = Float8Linear
        seen["recipe"] = config
        return model

    fake = types.ModuleType("torchao.float8")
    fake.Float8LinearConfig = types.SimpleNamespace(from_recipe_name=lambda name: name)
    fake.convert_to_float8_training = convert
    fake_linear = types.ModuleType("torchao.float8.float8_linear")
    fake_linear.Float8Linear = Float8Linear
    for name, module in (("torchao", types.ModuleType("torchao")), ("torchao.float8", fake),
                         ("torchao.float8.float8_linear", fake_linear)):
        monkeypatch.setitem(sys.modules, name, module)
    impl = "hf+peft+torchao+compile" if compiled else "hf+peft+torchao"
    model, config = build.build(RunSpec(impl, tiny_config, seq=8, batch=1, gc=False, device="cpu"))
    assert seen.pop("recipe") == "rowwise"
    layers = config.num_hidden_layers
    assert len(seen) == 7 * layers and all(fqn.endswith("base_layer") for fqn in seen)
    assert all(not p.requires_grad for m in seen.values() for p in m.parameters())
    assert compiled_modules == (list(seen.values()) if compiled else [])


def test_child_errors_are_results(tiny_config, tmp_path):
    r = step.run_one_safe(RunSpec("hf+peft", str(tmp_path / "missing"), seq=8, batch=1, gc=False, device="cpu"))
    assert r["status"] == "error" and "model config not found" in r["error"]
    with pytest.raises(harness.BenchError, match="unknown implementation 'hf'"):
        RunSpec("hf", tiny_config, seq=8, batch=1, gc=False)


def test_tiled_implementations_name_their_tile(tiny_config, monkeypatch):
    """``...+tiledN`` is the tiled implementation with N-token MLP tiles (``+tiled`` alone: build.TILE_TOKENS); other
    suffixes, tiles below 1 and untiled names with a tile are refused before anything runs."""
    from leantune.bench import build as bench_build

    assert bench_build.split_tile("leantune+offload+tiled2048") == ("leantune+offload+tiled", 2048)
    assert bench_build.split_tile("leantune+nf4+offload+tiled") == ("leantune+nf4+offload+tiled", 4096)
    assert bench_build.split_tile("leantune+offload") == ("leantune+offload", None)
    for bad in ("leantune+offload+tiled0", "hf+peft+tiled2048", "leantune+tiled2048", "leantune+offload+tiledx"):
        assert not bench_build.known_impl(bad)
        with pytest.raises(harness.BenchError, match="unknown implementation"):
            RunSpec(bad, tiny_config, seq=8, batch=1, gc=True)
    import leantune

    tiles = []
    real_patch = leantune.patch
    monkeypatch.setattr(leantune, "patch", lambda model, **kw: tiles.append(kw["tile_mlp"]) or real_patch(model, **kw))
    for impl in ("leantune+offload+tiled16", "leantune+offload+tiled", "leantune+offload"):
        r = step.run_one_safe(RunSpec(impl, tiny_config, seq=24, batch=1, gc=True, warmup=0, steps=1, device="cpu"))
        assert r["status"] == "ok", r.get("error")
    assert tiles == [16, bench_build.TILE_TOKENS, None]
    assert sorted(["leantune+offload+tiled", "leantune+offload+tiled2048", "leantune"], key=report._impl_rank) == [
        "leantune", "leantune+offload+tiled", "leantune+offload+tiled2048"]


def test_child_process_protocol(tiny_config, tmp_path):
    """One real subprocess: the spec goes in as JSON, the result comes back through the file."""
    spec = RunSpec("leantune", tiny_config, seq=16, batch=1, gc=True, warmup=0, steps=1, device="cpu")
    import dataclasses

    r = harness.run_child(["--one", json.dumps(dataclasses.asdict(spec))], tmp_path / "r.json", tmp_path / "r.log",
                      timeout_s=120)
    assert r["status"] == "ok", (r, (tmp_path / "r.log").read_text()[-2000:])
    assert r["name"] == "tiny_leantune_s16_b1_gcon" and r["wall_s"] > 0
    crashed = harness.run_child(["-c", "raise SystemExit('boom')"], tmp_path / "c.json", tmp_path / "c.log",
                            timeout_s=60, module="leantune.no_such_module")
    assert crashed["status"] == "crashed" and "exit 1" in crashed["error"] and "No module named" in crashed["error"]


@pytest.mark.parametrize("command", ["ops", "e2e", "max-context", "cpu", "report"])
def test_bench_help_shows_every_default(command, capsys):
    from leantune.cli import build_parser

    bench = next(a for a in build_parser()._actions if a.dest == "command").choices["bench"]
    sub = next(a for a in bench._actions if a.dest == "bench_command").choices[command]
    options = [a for a in sub._actions if a.option_strings and a.dest != "help"]
    assert options
    for action in options:
        assert "(default: " in action.help or "(required)" in action.help, action.option_strings


def test_ops_each_op_in_its_own_child_merged(tmp_path, monkeypatch):
    from leantune.bench import ops

    calls = []

    def fake_child(args, result, log, timeout_s, module):
        calls.append((module, args))
        op = args[1]
        if op == "rope":
            return {"status": "crashed", "error": "exit 1: boom", "wall_s": 1.0}
        row = {"op": op, "shape": "s", "impl": "leantune", "ms": 2.0, "extra_peak_gib": 0.5, "saved_gib": 0.25,
               "floor_ms": 1.0, "error": None, "pct_copy_ceiling": 50.0}
        if op == "swiglu":  # a row with the CUDA-graph time; rms_norm's is a row from before that column
            row.update(graph_ms=1.25, graph_error=None)
        return {"date": "d", "gpu": "H200", "versions": {"torch": "t", "triton": "tr", "transformers": "tf"},
                "ceilings": {"copy_bytes_per_s": 4e12, "matmul_flop_per_s": 7e14}, "rows": [row], "wall_s": 1.0}

    monkeypatch.setattr(ops, "run_child", fake_child)
    merged = ops.run_isolated(["rms_norm", "rope", "swiglu"], "leantune", tmp_path, log=lambda *a: None)
    assert [c[0] for c in calls] == ["leantune.bench.ops"] * 3
    assert calls[0][1] == ["--ops", "rms_norm", "--out", str(tmp_path / "ops_rms_norm.json"), "--impls", "leantune"]
    assert [r["op"] for r in merged["rows"]] == ["rms_norm", "swiglu"] and set(merged["ceilings_per_op"]) == {
        "rms_norm", "swiglu"}
    table = (tmp_path / "ops.md").read_text()
    assert "| rms_norm | s | leantune | 2.000 | — | 1.000 | 50% | 0.500 | 0.250 |" in table
    assert "| swiglu | s | leantune | 2.000 | 1.250 | 1.000 | 50% | 0.500 | 0.250 |" in table
    assert json.loads((tmp_path / "ops.json").read_text())["rows"] == merged["rows"]
    with pytest.raises(ValueError, match="unknown op 'nope'"):
        ops.run_isolated(["nope"], None, tmp_path)


def test_ops_markdown_keeps_a_failed_row_on_one_line():
    """CUDA error texts hold newlines and '|', which must not split the table row."""
    row = {"op": "rope", "shape": "s", "impl": "liger", "ms": math.nan, "graph_ms": math.nan, "graph_error": None,
           "extra_peak_gib": math.nan, "saved_gib": math.nan, "floor_ms": 1.0,
           "error": "AcceleratorError: CUDA error: illegal address\nCUDA kernel errors | might be asynchronous"}
    result = {"date": "d", "gpu": "H200", "versions": {"torch": "t", "triton": "tr", "transformers": "tf"},
              "ceilings": {"copy_bytes_per_s": 4e12, "matmul_flop_per_s": 7e14}, "rows": [row]}
    lines = report.ops_markdown(result).splitlines()
    assert lines[-1].startswith("| rope | s | liger (AcceleratorError: CUDA error: illegal address CUDA kernel errors "
                                "/ might be asynchronous) | nan | — |"), lines[-1]
    assert lines[-1].count("|") == lines[-2].count("|") == 10


def _maxctx(impl, probes, *, step=8192, lo=None, hi=None, complete=False):
    fit = [s for s, ok in probes if ok is True]
    fail = [s for s, ok in probes if ok is False]
    seqs = [s for s, _ in probes]
    return {"kind": "max_context", "model": "m", "layers": None, "impl": impl, "step": step,
            "lo": lo or min(seqs), "hi": hi or max(seqs), "best": max(fit, default=None),
            "first_fail": min(fail, default=None), "complete": complete, "probes": [list(p) for p in probes],
            "probe_details": [{"seq": s} for s, _ in probes]}


def test_max_context_results_of_several_calls_merge(tmp_path):
    calls = {"a": [_maxctx("leantune", [(319488, False)])],
             "b": [_maxctx("leantune", [(262144, True)]), _maxctx("hf+peft", [(65536, True), (73728, False)],
                                                                   step=8192, complete=True)],
             "c": [_maxctx("leantune", [(360448, None)], step=16384)]}
    for sub, results in calls.items():
        (tmp_path / sub).mkdir()
        for i, r in enumerate(results):
            (tmp_path / sub / f"maxctx_{i}.json").write_text(json.dumps(r))
    _, maxctx = report.load_results(tmp_path)
    assert [r["impl"] for r in maxctx] == ["hf+peft", "leantune"]
    lean = maxctx[1]
    assert (lean["best"], lean["first_fail"], lean["complete"], lean["step"]) == (262144, 319488, False, 8192)
    assert lean["probes"] == [[262144, True], [319488, False], [360448, None]] and lean["merged_from"] == 3
    assert len(lean["probe_details"]) == 3
    assert maxctx[0]["best"] == 65536 and maxctx[0]["complete"]  # one step apart
    # one step apart after merging: closed bracket
    closed = report.merge_max_context([_maxctx("x", [(196608, True)]), _maxctx("x", [(204800, False)])])
    assert closed[0]["complete"] and closed[0]["best"] == 196608


def test_max_context_merge_rejects_contradicting_probes():
    with pytest.raises(report.ReportError, match="262144 fits but 245760 does not"):
        report.merge_max_context([_maxctx("x", [(262144, True)]), _maxctx("x", [(245760, False)])])
    with pytest.raises(report.ReportError, match="262144 fits but 245760 does not"):  # within one file too
        report.merge_max_context([_maxctx("x", [(262144, True), (245760, False)])])


def test_a_memory_cap_is_its_own_search_and_workload():
    """A capped search (a smaller card) pools only with searches under the same cap, and says so in the tables."""
    capped = {**_maxctx("x", [(262144, False)]), "memory_cap_gib": 80.0}
    merged = report.merge_max_context([_maxctx("x", [(393216, True)]), capped])  # no contradiction: two searches
    assert sorted((r.get("memory_cap_gib"), r["best"], r["first_fail"]) for r in merged
                  if r.get("memory_cap_gib")) == [(80.0, None, 262144)]
    assert "(80 GiB cap)" in report.markdown([], merged)
    spec = RunSpec("leantune+nf4", "cfg", seq=8, batch=1, gc=True, memory_cap_gib=80)
    assert spec.name.endswith("_cap80")
    with pytest.raises(harness.BenchError, match="memory_cap_gib must be a positive number"):
        RunSpec("leantune", "cfg", seq=8, batch=1, gc=True, memory_cap_gib=-1)


def test_nf4_max_context_compares_to_the_bitsandbytes_baseline():
    merged = report.merge_max_context([_maxctx("hf+peft", [(65536, True)]), _maxctx("hf+peft+bnb", [(98304, True)]),
                                       _maxctx("leantune+nf4", [(294912, True)]),
                                       _maxctx("leantune", [(262144, True)])])
    mx = report.compare_max_context(merged)
    assert mx[("m", None, None, "leantune+nf4")] == 3.0  # vs hf+peft+bnb's 98,304
    assert mx[("m", None, None, "leantune")] == 4.0  # vs hf+peft's 65,536


def test_max_context_bracket_ends_close_the_search():
    all_fit = report.merge_max_context([_maxctx("x", [(8192, True), (16384, True)], lo=4096, hi=16384)])[0]
    assert all_fit["complete"] and all_fit["best"] == 16384 and all_fit["first_fail"] is None
    lo_fails = report.merge_max_context([_maxctx("x", [(8192, False)], lo=8192, hi=65536)])[0]
    assert lo_fails["complete"] and lo_fails["best"] is None
    open_top = report.merge_max_context([_maxctx("x", [(8192, True)], lo=8192, hi=65536)])[0]
    assert not open_top["complete"]


def test_report_draws_the_max_context_chart(tmp_path):
    (tmp_path / "hf.json").write_text(json.dumps(_maxctx("hf+peft", [(65536, True), (73728, False)])))
    (tmp_path / "lt.json").write_text(json.dumps(_maxctx("leantune", [(262144, True)])))
    text = report.write_report(tmp_path, log=lambda *_: None)
    assert "| m | leantune | 262144 (= --hi 262144: all fit) | — | 4.00 |" in text
    assert (tmp_path / "max_context.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --------------------------------------------------------------------------------- report: malformed result folders
def _write(folder, name, data):
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_bytes(data if isinstance(data, bytes) else json.dumps(data).encode())
    return path


@pytest.mark.parametrize("data, message", [
    (b"{bad", "not a readable JSON file"),
    (b"\xff\xfe{}", "not a readable JSON file"),
    ({**_row("hf+peft"), "seq": "4096"}, "field 'seq' must be int, got '4096'"),
    ({k: v for k, v in _row("hf+peft").items() if k != "model"}, "missing field 'model'"),
    ({**_row("hf+peft"), "gc": "off"}, "field 'gc' must be bool"),
    ({**_row("hf+peft"), "tokens_per_s": "fast"}, "field 'tokens_per_s' must be a number or null"),
    ({k: v for k, v in _row("hf+peft").items() if k != "status"}, "missing field 'status'"),
    ({**_maxctx("leantune", [(262144, True)]), "probes": "262144"}, "field 'probes' must be list"),
    ({**_maxctx("leantune", [(262144, True)]), "probes": [[262144]]}, "every probe must be"),
    ({**_maxctx("leantune", [(262144, True)]), "probes": [[262144, "yes"]]}, "every probe must be"),
    ({**_maxctx("leantune", [(262144, True)]), "probes": [["abc", True]]}, "every probe must be"),
    ({**_maxctx("leantune", [(262144, True)]), "step": 0}, "field 'step' must be positive"),
])
def test_report_rejects_malformed_results_and_keeps_results_md(tmp_path, data, message, capsys):
    _write(tmp_path, "good.json", _row("hf+peft", model="other"))
    bad = _write(tmp_path / "call2", "bad.json", data)
    (tmp_path / "results.md").write_text("# mine\n")
    assert cli_main(["bench", "report", "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and str(bad) in err and message in err
    assert (tmp_path / "results.md").read_text() == "# mine\n"


def test_report_refuses_duplicate_runs_of_one_workload(tmp_path):
    first = _write(tmp_path / "call1", "hf.json", _row("hf+peft"))
    second = _write(tmp_path / "call5", "hf.json", {**_row("hf+peft"), "tokens_per_s": 3000.0, "first_loss": 99.0})
    with pytest.raises(report.ReportError, match="two results for m_hf\\+peft_True") as info:
        report.load_results(tmp_path)
    assert str(first) in str(info.value) and str(second) in str(info.value)


@pytest.mark.parametrize("content", ["empty", "not results", "list"])
def test_report_without_results_writes_nothing(tmp_path, content, capsys):
    if content == "not results":
        _write(tmp_path, "other.json", {"hello": 1})
    elif content == "list":
        _write(tmp_path, "a.json", [1, 2])
    (tmp_path / "results.md").write_text("# mine\n")
    assert cli_main(["bench", "report", "--out", str(tmp_path)]) == 1
    captured = capsys.readouterr()
    assert "no benchmark results" in captured.err and (tmp_path / "results.md").read_text() == "# mine\n"
    if content != "empty":
        assert "skipped" in captured.out


def _ops_result(*rows):
    return {"date": "d", "gpu": "H200", "versions": {"torch": "t", "triton": "tr", "transformers": "tf"},
            "ceilings": {"copy_bytes_per_s": 4e12, "matmul_flop_per_s": 7e14}, "rows": list(rows)}


def _op_row(op, impl, ms, graph=None):
    row = {"op": op, "shape": "s", "impl": impl, "ms": ms, "extra_peak_gib": 0.5, "saved_gib": 0.25,
           "floor_ms": 1.0, "error": None, "pct_copy_ceiling": 100 / ms}
    return row if graph is None else {**row, "graph_ms": graph, "graph_error": None}


def test_report_rebuilds_op_tables(tmp_path, capsys):
    """`bench report` rebuilds the tables of `bench ops` results too. A folder's merged ops.json stands for its
    ops_NAME.json parts; each table is rewritten beside its JSON and gathered in results.md, also without any e2e
    result."""
    _write(tmp_path / "call1", "ops.json", _ops_result(_op_row("rope", "leantune", 2.0, 0.5),
                                                       _op_row("rope", "liger", 4.0)))
    _write(tmp_path / "call1", "ops_rope.json", _ops_result(_op_row("rope", "leantune", 2.0, 0.5)))
    _write(tmp_path / "old", "ops-run2.json", _ops_result(_op_row("rms_norm", "leantune", 1.0)))
    assert cli_main(["bench", "report", "--out", str(tmp_path)]) == 0
    text = (tmp_path / "results.md").read_text()
    assert "Ops (`call1/ops.json`)" in text and "Ops (`old/ops-run2.json`)" in text and "ops_rope" not in text
    assert "| rope | s | leantune | 2.000 | 0.500 | 1.000 | 50% | 0.500 | 0.250 |" in text
    assert "| rope | s | liger | 4.000 | — | 1.000 | 25% | 0.500 | 0.250 |" in text
    assert (tmp_path / "call1" / "ops.md").read_text().count("| rope |") == 2
    assert (tmp_path / "old" / "ops-run2.md").is_file() and not (tmp_path / "call1" / "ops_rope.md").exists()
    assert "skipped" not in capsys.readouterr().out


@pytest.mark.parametrize("breakage, match", [
    (lambda d: d.pop("ceilings"), "missing field 'ceilings'"),
    (lambda d: d["rows"][0].pop("impl"), "missing field 'impl'"),
    (lambda d: d["rows"][0].update(ms="fast"), "row field 'ms' must be a number"),
    (lambda d: d["rows"][0].update(graph_ms=True), "row field 'graph_ms' must be a number"),
    (lambda d: d["rows"].append(3), "every row must be an object"),
])
def test_report_names_a_malformed_op_result(tmp_path, breakage, match):
    data = _ops_result(_op_row("rope", "leantune", 2.0, 0.5))
    breakage(data)
    path = _write(tmp_path, "ops.json", data)
    (tmp_path / "results.md").write_text("# mine\n")
    with pytest.raises(report.ReportError, match=match) as info:
        report.write_report(tmp_path, log=lambda *a: None)
    assert str(path) in str(info.value) and (tmp_path / "results.md").read_text() == "# mine\n"


def test_report_output_path_errors(tmp_path, capsys):
    a_file = tmp_path / "afile"
    a_file.write_text("x")
    assert cli_main(["bench", "report", "--out", str(a_file)]) == 1
    assert "is a file, expected the directory" in capsys.readouterr().err
    _write(tmp_path / "res", "hf.json", _row("hf+peft"))
    (tmp_path / "res" / "results.md").mkdir()
    assert cli_main(["bench", "report", "--out", str(tmp_path / "res")]) == 1
    assert "results.md is a directory" in capsys.readouterr().err


def test_multiline_errors_stay_in_their_table_row_and_missing_ratios_print_a_dash():
    rows = [_row("hf+peft"), _row("leantune", status="error")]
    rows[1]["error"] = "RuntimeError: first line\nsecond | line"
    text = report.markdown(rows)
    row = [line for line in text.splitlines() if "| leantune |" in line]
    assert len(row) == 1 and "first line second / line" in row[0]
    rows = [{**_row("hf+peft"), "tokens_per_s": None}, _row("leantune")]
    assert "tokens/s x—" in report.format_compare(rows, [])


@pytest.mark.parametrize("field", ["tokens_per_s", "first_loss", "grad_norm"])
def test_ok_runs_must_record_their_numbers(tmp_path, field):
    _write(tmp_path, "x.json", {k: v for k, v in _row("hf+peft").items() if k != field})
    with pytest.raises(report.ReportError, match=f"missing field '{field}'"):
        report.load_results(tmp_path)
    _write(tmp_path, "x.json", {**_row("hf+peft"), "mfu": "high"})
    with pytest.raises(report.ReportError, match="field 'mfu' must be a number"):
        report.load_results(tmp_path)


def test_ops_short_calls_take_the_median_of_interleaved_rounds(monkeypatch):
    """The lent hosts' speed drifts within a run (1.80 vs 2.82 ms for the same code a minute apart): short calls get
    ROUNDS timings taken in turns over the implementations, and their median; long calls and failed rows one."""
    from leantune.bench import ops

    order, script = [], {"a": [4.0, 1.0], "b": [2.0, 9.0]}
    monkeypatch.setattr(ops, "harness_ms", lambda fn, case: (order.append(fn), script[fn].pop(0))[1])
    case = ops.Case("op", "s", [], None, bytes=10**9)
    ceilings = {"copy_bytes_per_s": 4e12, "matmul_flop_per_s": 7e14}

    def rows(*ms):
        out = [{"impl": impl, "ms": m, "error": None} for impl, m in zip("abc", ms)]
        for row in out:
            ops._rates(row, case, ceilings)
        return out

    short = rows(2.0, 3.0)
    ops._interleaved_rounds(short, {"a": "a", "b": "b"}, case, ceilings, rounds=3)
    assert order == ["a", "b", "a", "b"]  # in turns, not one implementation's rounds back to back
    assert [r["ms_rounds"] for r in short] == [[2.0, 4.0, 1.0], [3.0, 2.0, 9.0]]
    assert [r["ms"] for r in short] == [2.0, 3.0]
    assert short[1]["gb_per_s"] == pytest.approx(1e9 / 3e-3 / 1e9)
    assert "median of 3 timings" in report._rounds_note(short) and report._rounds_note(rows(1.0)) == ""

    order.clear()
    script.update(a=[4.0, 6.0], c=[])
    long = rows(2.0, harness.GRAPH_MAX_MS + 1)  # the device-bound row keeps its single timing (no interleaving cost)
    ops._interleaved_rounds(long, {"a": "a", "b": "b"}, case, ceilings, rounds=3)
    assert order == ["a", "a"] and long[0]["ms"] == 4.0 and "ms_rounds" not in long[1]
    order.clear()
    script["a"] = [4.0]
    failed = rows(2.0) + [{"impl": "b", "ms": math.nan, "error": "boom"}]
    ops._interleaved_rounds(failed, {"a": "a"}, case, ceilings, rounds=2)
    assert order == ["a"] and "ms_rounds" not in failed[1] and failed[0]["ms"] == 3.0  # median of [2.0, 4.0]

    def oom(fn, case):  # a later round that raises: the row keeps what was measured and says why it stopped
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(ops, "harness_ms", oom)
    broken = rows(2.0)
    ops._interleaved_rounds(broken, {"a": "a"}, case, ceilings, rounds=3)
    assert broken[0]["ms_rounds"] == [2.0] and broken[0]["rounds_error"].startswith("RuntimeError: CUDA out")


# ----------------------------------------------------------------------------------- bad values before any run
@pytest.mark.parametrize("argv, message", [
    (["ops", "--out", "AFILE"], "exists and is not a directory"),
    (["ops", "--out", "AFILE/sub"], "exists and is not a directory"),
    (["ops", "--budget-s", "-5"], "--budget-s must be a positive number of seconds, got -5.0"),
    (["ops", "--budget-s", "nan"], "--budget-s must be a positive number of seconds, got nan"),
    (["e2e", "--configs", "CONFIG", "--seq", "0"], "--seq must be >= 1, got 0"),
    (["e2e", "--configs", "CONFIG", "--batch", "0"], "--batch must be >= 1, got 0"),
    (["e2e", "--configs", "CONFIG", "--layers", "0"], "--layers must be >= 1, got 0"),
    (["e2e", "--configs", "CONFIG", "--matmul-tflops", "-5"], "--matmul-tflops must be a positive number"),
    (["e2e", "--configs", "AFILE"], "cannot read model config AFILE"),
    (["e2e", "--configs", "BADJSON"], "cannot read model config BADJSON"),
    (["max-context", "--config", "/nonexistent"], "model config not found: /nonexistent"),
    (["max-context", "--config", "CONFIG", "--layers", "-1"], "--layers must be >= 1, got -1"),
])
def test_bench_values_are_checked_before_anything_runs(argv, message, tmp_path, tiny_config, capsys, monkeypatch):
    """Each bad value is one error line before any child process starts or any file is written."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the checks come before the GPU is needed
    from leantune.bench import ops

    for module in (e2e, max_context, ops):
        monkeypatch.setattr(module, "run_child", lambda *a, **k: pytest.fail("a child process was started"))
    afile = tmp_path / "afile.txt"
    afile.write_text("keep")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    subs = {"CONFIG": tiny_config, "AFILE": str(afile), "BADJSON": str(bad)}
    argv = [subs.get(a, a.replace("AFILE", str(afile))) for a in argv]
    out = [] if "--out" in argv else ["--out", str(tmp_path / "out")]
    code = cli_main(["bench", *argv, *out])
    err = capsys.readouterr().err
    message = message.replace("AFILE", str(afile)).replace("BADJSON", str(bad))
    assert code == 1 and "Traceback" not in err and message in err, err
    assert afile.read_text() == "keep" and not (tmp_path / "out").exists()


def test_a_failing_rerun_keeps_the_earlier_result_and_exits_non_zero(tmp_path, tiny_config, capsys, monkeypatch):
    """A rerun that crashes or runs out of memory leaves the stored result of an earlier run in place, and a
    command where no run measured anything exits non-zero."""
    stored = {"status": "ok", "kept": True}
    result, log = tmp_path / "r.json", tmp_path / "r.log"
    result.write_text(json.dumps(stored))
    crashed = harness.run_child(["--bogus-flag"], result, log, 60)  # the e2e child rejects it: exit 2
    assert crashed["status"] == "crashed" and json.loads(result.read_text()) == stored
    src = tmp_path / "src.json"
    src.write_text(json.dumps({"status": "ok", "new": 1}))
    done = harness.run_child([str(src), str(result)], result, log, 60, module="json.tool")  # a child that succeeds
    assert done["new"] == 1 and json.loads(result.read_text()) == {"status": "ok", "new": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json", "r.log", "src.json", "tiny"]

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    real_run_child = harness.run_child

    def oom_child(args, result, log, timeout_s, **kw):  # a child that ends normally with an oom result
        src = tmp_path / "oom.json"
        src.write_text(json.dumps({"status": "oom", "error": "CUDA out of memory"}))
        return real_run_child([str(src), str(result)], result, log, timeout_s, module="json.tool", **kw)

    monkeypatch.setattr(e2e, "run_child", oom_child)
    out = tmp_path / "out"
    spec = RunSpec("leantune", tiny_config, 64, 1, True, 0, 1, 0)
    out.mkdir()
    good = {**_row("leantune", model="tiny", seq=64), "name": spec.name, "kept": True}
    (out / f"{spec.name}.json").write_text(json.dumps(good))
    code = cli_main(["bench", "e2e", "--configs", tiny_config, "--impls", "leantune", "--gc", "on", "--seq", "64",
                     "--batch", "1", "--warmup", "0", "--steps", "1", "--matmul-tflops", "700", "--out", str(out)])
    err = capsys.readouterr()
    assert json.loads((out / f"{spec.name}.json").read_text())["kept"] is True
    assert code == 1 and "no run produced a measurement (oom)" in err.err and "kept the earlier" in err.out
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []  # no scratch result left
    (out / ".new-stray.json").write_text(json.dumps(good))  # a child killed mid-run may leave one: not a result
    (out / ".old").mkdir()
    (out / ".old" / "res.json").write_text("{garbage")  # nor is anything in a hidden folder
    assert cli_main(["bench", "report", "--out", str(out)]) == 0


def test_check_names_a_device_or_backend_it_cannot_use(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for argv, message in ((["--device", "cuda"], "--device cuda: no CUDA device is visible"),
                          (["--device", ""], "--device must be cpu or cuda, got ''"),
                          (["--device", "meta"], "--device must be cpu or cuda, got 'meta'")):
        assert cli_main(["check", *argv]) == 1
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert cli_main(["check", "--device", "cuda:7"]) == 1
    assert "--device cuda:7: only 1 CUDA device(s) are visible" in capsys.readouterr().err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("LEANTUNE_BACKEND", "bogus")
    assert cli_main(["check"]) == 1
    assert "LEANTUNE_BACKEND must be auto, triton or torch; got 'bogus'" in capsys.readouterr().err
    monkeypatch.setenv("LEANTUNE_BACKEND", "torch")
    assert cli_main(["check"]) == 0
    out = capsys.readouterr().out
    names = ("rms_norm", "rope", "swiglu", "geglu", "cross_entropy", "linear_cross_entropy", "lora_linear",
             "lora_qkv", "lora_mlp", "dora_linear", "linear_log_probs", "linear_distillation_loss", "moe_experts")
    assert all(f"\n{name} " in out for name in names) and out.count("  ok") == len(names), out


# ------------------------------------------------------------------------------- several processes (gloo dry run)
@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3_text"])
def test_child_under_torchrun_on_cpu_reports_the_world(tiny_config, tmp_path, family):
    """`bench e2e --nproc 2 --distributed ddp|fsdp` launches each run under torchrun: both engines' runs (gloo, two
    CPU processes, one launch each) write one result from rank 0 with the world's tokens/s, and agree on the
    first-step loss (same weights; each rank its own tokens, the same in both launches). FSDP2's model is built on
    the meta device: qwen2's q/k/v biases and Gemma 3's embedding scale (a buffer) must be set as DDP's are."""
    from transformers import Gemma3TextConfig, Qwen2Config

    from leantune.bench.harness import run_child

    if family != "llama":
        shape = {k: v for k, v in TINY.items()}
        config = (Qwen2Config(**shape, use_sliding_window=False) if family == "qwen2" else
                  Gemma3TextConfig(**shape, head_dim=16, sliding_window=8))
        config.save_pretrained(tmp_path / family)
        tiny_config = str(tmp_path / family)
    results = {}
    for engine in ("ddp", "fsdp"):
        spec = RunSpec("leantune", tiny_config, seq=24, batch=2, gc=engine == "fsdp", warmup=0, steps=2,
                       device="cpu", nproc=2, distributed=engine)
        out = tmp_path / f"{engine}.json"
        r = run_child(["--one", json.dumps(dataclasses.asdict(spec))], out, tmp_path / f"{engine}.log", 300,
                      nproc=2)
        assert r.get("status") == "ok", (r, (tmp_path / f"{engine}.log").read_text()[-3000:])
        assert (r["world_size"], r["engine"], r["nproc"]) == (2, engine, 2)
        assert r["tokens_per_s"] > 0 and math.isfinite(r["first_loss"]) and math.isfinite(r["grad_norm"])
        assert spec.name.endswith(f"_{engine}2") and out.exists()
        results[engine] = r
    assert results["ddp"]["first_loss"] == pytest.approx(results["fsdp"]["first_loss"], rel=1e-5)
    assert results["ddp"]["grad_norm"] == pytest.approx(results["fsdp"]["grad_norm"], rel=1e-4)
    with pytest.raises(step.BenchError, match="several processes need"):
        RunSpec("leantune", tiny_config, seq=24, batch=2, gc=False, nproc=2)


def test_qlora_builds_layer_by_layer_match_the_whole_model_quantised(tiny_config):
    """leantune+nf4's layer-by-layer build holds exactly what building the bf16 model whole and calling
    leantune.quantize gives (same codes, same adapters, same loss); hf+peft+bnb quantises the same weights with
    bitsandbytes to the same codes, and its first step agrees with leantune+nf4's."""
    import gc

    from torch import nn

    import leantune
    from leantune.quantize import NF4Linear

    spec = RunSpec("leantune+nf4", tiny_config, seq=24, batch=2, gc=False, warmup=0, steps=1, device="cpu")
    layerwise, config = build.build(spec)
    gc.collect()  # no bf16 projection outlives its quantisation (the bf16 model never exists whole)
    kept = set(layerwise.modules())
    assert not [m for m in gc.get_objects() if type(m) is nn.Linear and m not in kept
                and m.weight.dtype == torch.bfloat16 and m.weight.shape[1] == config.hidden_size]
    whole, _ = build.build(dataclasses.replace(spec, impl="hf+peft"))
    leantune.quantize(whole, "nf4")
    leantune.patch(whole)
    ours, theirs = layerwise.state_dict(), whole.state_dict()
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name
    nf4 = [m for m in layerwise.modules() if isinstance(m, NF4Linear)]
    whole_nf4 = [m for m in whole.modules() if isinstance(m, NF4Linear)]
    assert len(nf4) == len(whole_nf4) == 7 * config.num_hidden_layers
    for a, b in zip(nf4, whole_nf4):  # NF4Linear's buffers are not in the state dict
        assert all(torch.equal(getattr(a, f), getattr(b, f)) for f in ("codes", "absmax_codes", "nested_absmax"))
    # every parameter and buffer materialised (the rotary frequencies too) and tied as built whole
    assert not any(t.is_meta for t in (*layerwise.parameters(), *layerwise.buffers()))
    hf = layerwise.get_base_model()
    assert hf.lm_head.weight is hf.model.embed_tokens.weight
    ids = torch.randint(0, config.vocab_size, (2, 24))
    with torch.no_grad():
        assert torch.equal(layerwise(input_ids=ids, labels=ids).loss, whole(input_ids=ids, labels=ids).loss)

    bnb = pytest.importorskip("bitsandbytes")
    hf_bnb, _ = build.build(dataclasses.replace(spec, impl="hf+peft+bnb"))
    linears = [m for m in hf_bnb.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(linears) == 7 * config.num_hidden_layers
    for theirs_q, ours_q in zip(linears, nf4):  # the same NF4 codes, bit for bit
        assert torch.equal(theirs_q.weight.data.view(-1), ours_q.codes.view(-1))
    rows = [step.run_one_safe(dataclasses.replace(spec, impl=impl)) for impl in ("hf+peft+bnb", "leantune+nf4")]
    assert [r["status"] for r in rows] == ["ok", "ok"], [r.get("error") for r in rows]
    report.flag_agreement(rows)
    assert [r["agreement"] for r in rows] == ["reference", "ok"]


def test_frozen_weight_bytes_of_4bit_models(tiny_config):
    """The NF4 models' frozen bytes: per projection of n weights, n / 2 bytes of codes, n / 64 uint8 absmax codes
    (held padded to whole 256-blocks) and one fp32 nested absmax per 256-block; plus the bf16 rest."""
    spec = RunSpec("leantune+nf4", tiny_config, seq=8, batch=1, gc=False, device="cpu")
    model, config = build.build(spec)
    sizes = [64 * 64, 32 * 64, 32 * 64, 64 * 64, 96 * 64, 96 * 64, 96 * 64] * config.num_hidden_layers
    nf4 = sum(n // 2 + 260 * -(-(n // 64) // 256) for n in sizes)
    bf16_rest = 2 * (97 * 64 + (2 * config.num_hidden_layers + 1) * 64)  # tied embedding, norms
    assert frozen_weight_bytes(model) == nf4 + bf16_rest
    pytest.importorskip("bitsandbytes")  # bitsandbytes keeps the absmax codes unpadded
    unpadded = nf4 - sum(256 * -(-(n // 64) // 256) - n // 64 for n in sizes)
    assert frozen_weight_bytes(build.build(dataclasses.replace(spec, impl="hf+peft+bnb"))[0]) == unpadded + bf16_rest


def test_frozen_weight_bytes_of_fp8_models(tiny_config):
    """The FP8 model's frozen bytes: per projection [out, in], out x in e4m3 codes and out fp32 scales; plus the bf16
    rest (tied embedding, norms)."""
    spec = RunSpec("leantune+fp8", tiny_config, seq=8, batch=1, gc=False, device="cpu")
    model, config = build.build(spec)
    shapes = [(64, 64), (32, 64), (32, 64), (64, 64), (96, 64), (96, 64), (64, 96)] * config.num_hidden_layers
    fp8 = sum(out * inp + 4 * out for out, inp in shapes)
    bf16_rest = 2 * (97 * 64 + (2 * config.num_hidden_layers + 1) * 64)
    assert frozen_weight_bytes(model) == fp8 + bf16_rest
