"""``--report-to``: TensorBoard event files in the run folder hold the metrics of metrics.jsonl; a missing library or
a bad name is one error line before anything is written."""

from __future__ import annotations

import json
import math

import cli_support
import pytest
from cli_support import assert_error, run_cli, train_args

from leantune.errors import LeantuneError
from leantune.train.reporting import check_installed, parse_report_to, scalars

tiny = cli_support.tiny  # the fixture: a tiny model and chat data


def test_report_to_tensorboard_writes_the_metrics_into_the_run_folder(tiny, tmp_path, capsys):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "out"
    code, err = run_cli(capsys, *train_args(tiny, out, "--max-steps", "3", "--eval-every", "2",
                                            "--report-to", "tensorboard"))
    assert code == 0, err
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    expected = {}  # tag -> [(step, value)] from metrics.jsonl
    for record in records:
        for tag, value in scalars(record).items():
            expected.setdefault(tag, []).append((record["step"], value))
    assert set(expected) == {"train/loss", "train/learning_rate", "train/grad_norm", "train/tokens_per_s",
                             "train/step_seconds", "eval/loss"}  # GPU memory only on CUDA
    assert set(events.Tags()["scalars"]) == set(expected)
    for tag, points in expected.items():
        got = [(e.step, e.value) for e in events.Scalars(tag)]
        assert [s for s, _ in got] == [s for s, _ in points], tag
        for (_, value), (_, want) in zip(got, points):  # events hold float32
            assert math.isclose(value, want, rel_tol=2**-23, abs_tol=0.0), (tag, value, want)
    assert [s for s, _ in expected["eval/loss"]] == [0, 2, 3]


def test_report_to_names_and_missing_libraries(tiny, tmp_path, capsys, monkeypatch):
    assert parse_report_to("none") == () and parse_report_to("TensorBoard, mlflow") == ("tensorboard", "mlflow")
    for bad in ("tensorbord", "none,wandb", "wandb,wandb", ""):
        with pytest.raises(LeantuneError, match="--report-to must be none or a comma list"):
            parse_report_to(bad)
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(LeantuneError, match="the wandb package is not installed; pip install wandb"):
        check_installed("wandb")
    code, err = run_cli(capsys, *train_args(tiny, tmp_path / "out", "--report-to", "wandb"))
    assert_error(code, err, "--report-to wandb: the wandb package is not installed; pip install wandb")
    assert not (tmp_path / "out").exists()
    code, err = run_cli(capsys, *train_args(tiny, tmp_path / "out", "--report-to", "tensorboard,foo"))
    assert_error(code, err, "--report-to must be none or a comma list")


def test_scalars_skip_non_finite_and_unknown_values():
    record = {"type": "train", "step": 3, "loss": float("nan"), "lr": 1e-3, "grad_norm": None, "tokens": 7,
              "step_seconds": 0.5}
    assert scalars(record) == {"train/learning_rate": 1e-3, "train/step_seconds": 0.5}
    assert scalars({"type": "eval", "step": 0, "eval_loss": 2.5}) == {"eval/loss": 2.5}


def _fake_module(monkeypatch, name, **attributes):
    import importlib.machinery
    import sys
    import types

    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    for key, value in attributes.items():
        setattr(module, key, value)
    monkeypatch.setitem(sys.modules, name, module)
    return module


def test_wandb_and_mlflow_stay_offline_in_the_run_folder_by_default(tmp_path, monkeypatch):
    """Stand-ins for the two libraries record what leantune asks of them: wandb in offline mode into the run folder,
    MLflow on a file store inside it; WANDB_MODE / MLFLOW_TRACKING_URI, when set, are the user's choice."""
    from leantune.train.reporting import Reporters

    calls = []

    class Run:
        def log(self, values, step):
            calls.append(("wandb.log", step, values))

        def finish(self):
            calls.append(("wandb.finish",))

    _fake_module(monkeypatch, "wandb", init=lambda **kw: calls.append(("wandb.init", kw)) or Run())
    _fake_module(monkeypatch, "mlflow", set_tracking_uri=lambda uri: calls.append(("mlflow.uri", uri)),
                 set_experiment=lambda name: calls.append(("mlflow.experiment", name)),
                 start_run=lambda **kw: calls.append(("mlflow.start", kw)),
                 log_params=lambda params: calls.append(("mlflow.params", params)),
                 log_metrics=lambda values, step: calls.append(("mlflow.log", step, values)),
                 end_run=lambda: calls.append(("mlflow.end",)))
    for name in ("WANDB_MODE", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(name, raising=False)
    out = tmp_path / "run"
    reporters = Reporters("wandb,mlflow", out, 0, {"lr": 1e-3})
    reporters.log({"type": "train", "step": 1, "loss": 2.0, "lr": 1e-3, "tokens": 9})
    reporters.close()
    init = calls[0][1]
    assert init["mode"] == "offline" and init["dir"] == str(out) and init["config"] == {"lr": 1e-3}
    assert ("mlflow.uri", (out / "mlruns").resolve().as_uri()) in calls
    expected = {"train/loss": 2.0, "train/learning_rate": 1e-3}
    assert ("wandb.log", 1, expected) in calls and ("mlflow.log", 1, expected) in calls
    assert calls[-2:] == [("mlflow.end",), ("wandb.finish",)]  # closed in reverse order

    calls.clear()
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://tracking.example")
    Reporters("wandb,mlflow", out, 0, {}).close()
    assert calls[0][1]["mode"] == "online" and not [c for c in calls if c[0] == "mlflow.uri"]


def test_a_reporter_that_fails_to_start_is_one_error_line(tmp_path, monkeypatch):
    from leantune.train.reporting import Reporters

    def refuse(**kwargs):
        raise RuntimeError("api key\nmissing")

    _fake_module(monkeypatch, "wandb", init=refuse)
    with pytest.raises(LeantuneError, match="--report-to wandb: cannot start it: api key missing"):
        Reporters("wandb", tmp_path, 0, {})
