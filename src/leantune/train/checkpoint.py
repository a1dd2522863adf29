"""Atomic training checkpoints: adapter weights, optimizer, scheduler, RNG states and the data position.

Layout: ``OUTPUT/checkpoints/step-000123/`` with ``adapter_model.safetensors``, ``optimizer.pt``, ``scheduler.pt``,
``rng.pt`` and ``state.json`` (``step``, ``metrics_lines``: the metrics.jsonl lines written up to this step). A
checkpoint is written into a temporary sibling directory and renamed into place, so a crash never leaves a partial
one under a final name; older checkpoints are deleted after the new one is in place.

Several processes (``distributed.py``): every rank takes part in gathering the full adapter and optimizer state
(``torch.distributed.checkpoint.state_dict``: whole tensors, whatever the engine sharded), rank 0 writes them, and
``rng.pt`` holds every rank's RNG states in rank order. The files do not depend on the engine or the world size:
``adapter_model.safetensors`` has PEFT's keys, ``optimizer.pt`` the parameters' names. Every rank reads them back.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch
from peft import get_peft_model_state_dict
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from ..distributed import World, barrier, gather_objects

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


# Whole tensors of the trainable parameters only (the frozen base is never copied), on the CPU, on rank 0.
_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
_LOAD = StateDictOptions(full_state_dict=True, strict=False)


def adapter_state(model) -> dict:
    """The adapter's whole tensors under PEFT's keys (``model``: the PeftModel, sharded or not; every rank must call
    it; non-main ranks get an empty dict)."""
    state = get_model_state_dict(model, options=_FULL)
    if not state:
        return {}
    return {k: v.detach().contiguous() for k, v in
            get_peft_model_state_dict(model, state_dict=state, save_embedding_layers=False).items()}


def save_adapter(model, folder: Path, world: World = World()) -> None:
    """The adapter as PEFT's folder (``save_pretrained``), written from whole tensors: every rank calls it (the
    tensors are gathered), rank 0 writes."""
    state = get_model_state_dict(model, options=_FULL)
    if world.main:
        model.save_pretrained(folder, state_dict=state, save_embedding_layers=False)
    barrier(world)


def _peft_names(model) -> dict:
    """PEFT's key of each trainable parameter -> the parameter's name in ``model``, by PEFT's own renaming."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    tags = {n: torch.tensor(i) for i, n in enumerate(names)}
    renamed = get_peft_model_state_dict(model, state_dict=tags, save_embedding_layers=False)
    return {key: names[int(tag)] for key, tag in renamed.items()}


def save_checkpoint(output: Path, step: int, model, optimizer, scheduler, metrics_lines: int,
                    world: World = World()) -> Path:
    """Write the checkpoint for ``step`` atomically; returns its directory. With several processes every rank
    calls it (the state is gathered collectively) and rank 0 writes."""
    adapter = adapter_state(model)
    optimizer_state = get_optimizer_state_dict(model, optimizer, options=_FULL)
    rng = gather_objects(_rng_state(), world)
    root = Path(output) / CHECKPOINTS
    final = root / f"step-{step:06d}"
    if not world.main:
        barrier(world)  # the files are in place when every rank leaves
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-step-{step:06d}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    save_file(adapter, str(tmp / "adapter_model.safetensors"))
    torch.save(optimizer_state, tmp / "optimizer.pt")
    torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
    torch.save(rng, tmp / "rng.pt")
    (tmp / "state.json").write_text(json.dumps({"step": step, "metrics_lines": metrics_lines}))
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    for old in root.glob("step-*"):
        if old != final:
            shutil.rmtree(old)
    barrier(world)
    return final


def latest_checkpoint(output: Path) -> Path | None:
    """The newest complete checkpoint under ``output``, or None."""
    found = sorted((Path(output) / CHECKPOINTS).glob("step-*"))
    return found[-1] if found else None


def checkpoint_step(path: Path) -> int:
    """The optimizer step a checkpoint was saved at (its ``state.json``)."""
    return int(json.loads((Path(path) / "state.json").read_text())["step"])


def load_checkpoint(path: Path, model, optimizer, scheduler, world: World = World()) -> dict:
    """Restore everything saved by ``save_checkpoint`` in place (every rank reads the files); returns
    ``state.json``'s dict. The world size must be the one that saved it (checked by the caller from run.json)."""
    stored = load_file(str(path / "adapter_model.safetensors"))
    names = _peft_names(model)
    missing = sorted(set(names) - set(stored))
    if missing:
        raise ValueError(f"{path / 'adapter_model.safetensors'} lacks {len(missing)} adapter tensors ({missing[0]}, "
                         "...): it was saved for another adapter")
    set_model_state_dict(model, {names[key]: stored[key] for key in names}, options=_LOAD)
    optimizer_state = torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True)
    if all(isinstance(key, int) for key in optimizer_state["state"]):  # written by leantune 0.1 (one process)
        optimizer.load_state_dict(optimizer_state)
    else:
        set_optimizer_state_dict(model, optimizer, optimizer_state, options=_LOAD)
    scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))
    rng = torch.load(path / "rng.pt", weights_only=False)
    _set_rng_state(rng[world.rank] if isinstance(rng, list) else rng)  # a dict: saved by one plain process
    return json.loads((path / "state.json").read_text())
