"""Run feedback on disk: ``metrics.jsonl`` (one JSON object per step and per eval) and ``loss.png``."""

from __future__ import annotations

import json
from pathlib import Path


class MetricsLog:
    """Append-only JSONL log; ``lines`` counts what is written so a checkpoint can record the position."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.lines = len(self.read()) if self.path.exists() else 0

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
            fh.write(json.dumps(record) + "\n")
        self.lines += 1

    def read(self) -> list[dict]:
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]


def plot_losses(records: list[dict], path: Path) -> None:
    """Train loss per step and eval loss at each eval, on one axis, written to ``path`` (PNG, Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [(r["step"], r["loss"]) for r in records if r["type"] == "train"]
    evals = [(r["step"], r["eval_loss"]) for r in records if r["type"] == "eval"]
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
