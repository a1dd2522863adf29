"""Run feedback: on disk, ``metrics.jsonl`` (one JSON object per step and per eval) and ``loss.png``; on the
console, status and warning lines (``say``) that leave the progress bar intact.

Both JSON files of a run are strict JSON: a non-finite number (a diverged loss, the grad norm with clipping off) is
written as ``null`` (``to_json``), since ``NaN``/``Infinity`` are not JSON and break other readers.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from tqdm.auto import tqdm

_SPEAKS = True  # False on every rank but 0 of a multi-process run


def speak(enabled: bool) -> None:
    """Whether :func:`say` prints in this process (a multi-process run lets rank 0 alone speak)."""
    global _SPEAKS
    _SPEAKS = enabled


def say(message: str) -> None:
    """A status or warning line on stderr that does not break the progress bar (rank 0 only)."""
    if _SPEAKS:
        tqdm.write(message, file=sys.stderr)


def one_line(exc: BaseException) -> str:
    """An exception's whole message on one line (transformers' messages span several lines)."""
    return " ".join(str(exc).split()) or type(exc).__name__


def finite_or_none(value):
    """``value`` with every non-finite float (in nested dicts and lists too) replaced by None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite_or_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_none(v) for v in value]
    return value


def to_json(value, **kwargs) -> str:
    """Strict JSON of ``value``: non-finite floats become null."""
    return json.dumps(finite_or_none(value), allow_nan=False, **kwargs)


class MetricsLog:
    """Append-only JSONL log; ``lines`` counts what is written so a checkpoint can record the position."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.lines = len(self.read()) if self.path.exists() else 0
        self.forward = None  # also called with each record logged (the --report-to reporters)

    def reset(self) -> None:
        self.path.write_text("")
        self.lines = 0

    def truncate(self, lines: int) -> None:
        """Keep the first ``lines`` records (those written before the checkpoint a run resumes from)."""
        kept = self.path.read_text().splitlines(keepends=True)[:lines] if self.path.exists() else []
        self.path.write_text("".join(kept))
        self.lines = len(kept)

    def log(self, record: dict) -> None:
        with self.path.open("a") as fh:
            fh.write(to_json(record) + "\n")
        self.lines += 1
        if self.forward is not None:
            self.forward(record)

    def read(self) -> list[dict]:
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]


def plot_losses(records: list[dict], path: Path) -> None:
    """Train loss per step and eval loss at each eval, on one axis, written to ``path`` (PNG, Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [(r["step"], r["loss"]) for r in records if r["type"] == "train" and r["loss"] is not None]
    evals = [(r["step"], r["eval_loss"]) for r in records if r["type"] == "eval" and r["eval_loss"] is not None]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    if train:
        ax.plot(*zip(*train), label="train loss", color="tab:blue", linewidth=1.2)
    if evals:
        ax.plot(*zip(*evals), "o-", label="eval loss (held out)", color="tab:orange")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (nats / target token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
