"""Atomic training checkpoints: adapter weights, optimizer, scheduler, RNG states and the data position.

Layout: ``OUTPUT/checkpoints/step-000123/`` with ``adapter_model.safetensors``, ``optimizer.pt``, ``scheduler.pt``,
``rng.pt`` and ``state.json`` (``step``, ``metrics_lines``: the metrics.jsonl lines written up to this step). A
checkpoint is written into a temporary sibling directory and renamed into place, so a crash never leaves a partial
one under a final name; older checkpoints are deleted after the new one is in place.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch
from peft import get_peft_model_state_dict, set_peft_model_state_dict
from safetensors.torch import load_file, save_file

CHECKPOINTS = "checkpoints"


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(output: Path, step: int, model, optimizer, scheduler, metrics_lines: int) -> Path:
    """Write the checkpoint for ``step`` atomically; returns its directory."""
    root = Path(output) / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:06d}"
    tmp = root / f".tmp-step-{step:06d}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    state = get_peft_model_state_dict(model, save_embedding_layers=False)
    weights = {k: v.detach().contiguous() for k, v in state.items()}
    save_file(weights, str(tmp / "adapter_model.safetensors"))
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
    torch.save(_rng_state(), tmp / "rng.pt")
    (tmp / "state.json").write_text(json.dumps({"step": step, "metrics_lines": metrics_lines}))
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    for old in root.glob("step-*"):
        if old != final:
            shutil.rmtree(old)
    return final


def latest_checkpoint(output: Path) -> Path | None:
    """The newest complete checkpoint under ``output``, or None."""
    found = sorted((Path(output) / CHECKPOINTS).glob("step-*"))
    return found[-1] if found else None


def checkpoint_step(path: Path) -> int:
    """The optimizer step a checkpoint was saved at (its ``state.json``)."""
    return int(json.loads((Path(path) / "state.json").read_text())["step"])


def load_checkpoint(path: Path, model, optimizer, scheduler) -> dict:
    """Restore everything saved by ``save_checkpoint`` in place; returns ``state.json``'s dict."""
    device = next(p.device for p in model.parameters())
    set_peft_model_state_dict(model, load_file(str(path / "adapter_model.safetensors"), device=str(device)))
    optimizer.load_state_dict(torch.load(path / "optimizer.pt", map_location=device, weights_only=True))
    scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))
    _set_rng_state(torch.load(path / "rng.pt", weights_only=False))
    return json.loads((path / "state.json").read_text())
