"""``--report-to``: the run's metrics sent to TensorBoard, Weights & Biases or MLflow, besides ``metrics.jsonl``.

The names follow Hugging Face Trainer's ``report_to`` (a comma list; ``none``: only metrics.jsonl). Every reporter
writes into the run folder unless the user's environment points it elsewhere, so nothing leaves the machine by
default:

- ``tensorboard``: event files in ``OUTPUT/tensorboard`` (``torch.utils.tensorboard``, which needs the
  ``tensorboard`` package); a resumed run purges the events past its checkpoint's step.
- ``wandb``: ``mode="offline"`` into ``OUTPUT/wandb`` unless ``WANDB_MODE`` is set (``wandb sync`` uploads later).
- ``mlflow``: a local file store ``OUTPUT/mlruns`` unless ``MLFLOW_TRACKING_URI`` is set.

Each logged record becomes scalars named ``train/loss``, ``train/learning_rate``, ``train/grad_norm``,
``train/tokens_per_s``, ``train/step_seconds``, ``train/gpu_memory_gib`` and ``train/gpu_peak_memory_gib`` (CUDA
only: ``torch.cuda.memory_allocated`` / ``max_memory_allocated`` in GiB, read on the host without a sync) and
``eval/loss``, at the record's optimizer step. Non-finite values are skipped (a diverged loss is in metrics.jsonl
as null). Only rank 0 reports. A missing library is a LeantuneError naming the package, raised before the run
writes anything.
"""

from __future__ import annotations

import importlib.util
import math
import os
from pathlib import Path

from ..errors import LeantuneError
from .metrics import one_line

REPORTERS = ("tensorboard", "wandb", "mlflow")
FOLDERS = ("tensorboard", "wandb", "mlruns")  # what the reporters write into the run folder (leantune's files)
# metrics.jsonl key -> reported name
_NAMES = {"train": {"loss": "train/loss", "lr": "train/learning_rate", "grad_norm": "train/grad_norm",
                    "tokens_per_s": "train/tokens_per_s", "step_seconds": "train/step_seconds",
                    "gpu_memory_gib": "train/gpu_memory_gib", "gpu_peak_memory_gib": "train/gpu_peak_memory_gib"},
          "eval": {"eval_loss": "eval/loss"}}


def parse_report_to(value: str) -> tuple[str, ...]:
    """``"tensorboard,wandb"`` -> ``("tensorboard", "wandb")``; ``"none"`` -> ``()``. Raises LeantuneError for an
    unknown name, a repeated one, or ``none`` beside others."""
    names = [name.strip().lower() for name in str(value).split(",")]
    if names == ["none"]:
        return ()
    unknown = [name for name in names if name not in REPORTERS]
    if unknown or len(set(names)) != len(names):
        raise LeantuneError(f"--report-to must be none or a comma list of {', '.join(REPORTERS)} (each once), got "
                            f"{value!r}")
    return tuple(names)


def check_installed(report_to: str) -> None:
    """A LeantuneError naming the package to install for the first reporter of ``report_to`` (the option's string)
    whose library is missing."""
    for name in parse_report_to(report_to):
        if importlib.util.find_spec(name) is None:
            raise LeantuneError(f"--report-to {name}: the {name} package is not installed; pip install {name}")


def scalars(record: dict) -> dict[str, float]:
    """The reported names and finite values of one metrics.jsonl record (see the module docstring)."""
    names = _NAMES.get(record.get("type"), {})
    out = {}
    for key, name in names.items():
        value = record.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out[name] = float(value)
    return out


class _TensorBoard:
    def __init__(self, output: Path, start_step: int, config: dict):
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: TensorBoard drops the earlier session's events from this step on (they were redone)
        self.writer = SummaryWriter(str(output / "tensorboard"), purge_step=start_step or None)
        self.writer.add_text("config", "\n".join(f"    {k} = {v!r}" for k, v in config.items()), start_step)

    def log(self, values: dict, step: int) -> None:
        for name, value in values.items():
            self.writer.add_scalar(name, value, step)

    def close(self) -> None:
        self.writer.close()


class _WandB:
    def __init__(self, output: Path, start_step: int, config: dict):
        import wandb

        self.wandb = wandb
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "leantune"), name=output.resolve().name,
                              dir=str(output), config=config, mode=os.environ.get("WANDB_MODE", "offline"))

    def log(self, values: dict, step: int) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


class _MLflow:
    def __init__(self, output: Path, start_step: int, config: dict):
        import mlflow

        self.mlflow = mlflow
        if not os.environ.get("MLFLOW_TRACKING_URI"):
            mlflow.set_tracking_uri((output / "mlruns").resolve().as_uri())
        mlflow.set_experiment(os.environ.get("MLFLOW_EXPERIMENT_NAME", "leantune"))
        self.run = mlflow.start_run(run_name=output.resolve().name)
        mlflow.log_params({k: str(v)[:500] for k, v in config.items()})

    def log(self, values: dict, step: int) -> None:
        self.mlflow.log_metrics(values, step=step)

    def close(self) -> None:
        self.mlflow.end_run()


_CLASSES = {"tensorboard": _TensorBoard, "wandb": _WandB, "mlflow": _MLflow}


class Reporters:
    """The reporters of ``--report-to`` (``report_to``: the option's string) for one session of a run (rank 0):
    ``log(record)`` takes the metrics.jsonl record (it carries its ``type`` and ``step``), ``close()`` flushes
    them. Nothing for ``none``."""

    def __init__(self, report_to: str, output: Path, start_step: int, config: dict):
        check_installed(report_to)
        self.active = []
        name = None
        try:
            for name in parse_report_to(report_to):
                self.active.append(_CLASSES[name](Path(output), start_step, config))
        except Exception as exc:  # each library has its own errors (a bad WANDB_MODE, an unreachable server)
            self.close()
            raise LeantuneError(f"--report-to {name}: cannot start it: {one_line(exc)[:300]}") from None
        except BaseException:
            self.close()
            raise

    def log(self, record: dict) -> None:
        values = scalars(record)
        if values:
            for reporter in self.active:
                reporter.log(values, int(record["step"]))

    def close(self) -> None:
        while self.active:
            self.active.pop().close()
