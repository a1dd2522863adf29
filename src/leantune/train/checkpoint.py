"""Atomic training checkpoints: adapter weights, optimizer, scheduler, RNG states and the data position.

Layout: ``OUTPUT/checkpoints/step-000123/`` with ``adapter_model.safetensors``, ``optimizer.pt``, ``scheduler.pt``,
``rng.pt`` and ``state.json`` (``step``, ``metrics_lines``: the metrics.jsonl lines written up to this step, and
``initial_eval_loss`` for the divergence guard). A checkpoint is written into a temporary sibling directory and
renamed into place, so a crash never leaves a partial one under a final name; once the new one is in place the
oldest beyond ``--keep-checkpoints`` are deleted (never the ``protected`` one: the divergence guard's last good one).

A damaged file (truncated, garbage, missing) is a one-line LeantuneError naming it and the earlier checkpoints kept
(``damaged``); every file is read and checked before a resumed run writes anything, and nothing is deleted.

Several processes (``distributed.py``): every rank takes part in gathering the full adapter and optimizer state
(``torch.distributed.checkpoint.state_dict``: whole tensors, whatever the engine sharded), rank 0 writes them, and
``rng.pt`` holds every rank's RNG states in rank order. The files do not depend on the engine or the world size:
``adapter_model.safetensors`` has PEFT's keys, ``optimizer.pt`` the parameters' names. Every rank reads them back.
"""

from __future__ import annotations

import hashlib
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
from ..errors import LeantuneError
from ..quantize import quantized_storage_hidden
from .metrics import finite_or_none, one_line

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
    with quantized_storage_hidden(model):  # the frozen quantised base: not copied, not saved
        state = get_model_state_dict(model, options=_FULL)
    if not state:
        return {}
    return {k: v.detach().contiguous() for k, v in
            get_peft_model_state_dict(model, state_dict=state, save_embedding_layers=False).items()}


def save_adapter(model, folder: Path, world: World = World()) -> None:
    """The adapter as PEFT's folder (``save_pretrained``), written from whole tensors: every rank calls it (the
    tensors are gathered), rank 0 writes."""
    with quantized_storage_hidden(model):  # the frozen quantised base: not copied, not saved
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
                    world: World = World(), *, keep: int = 1, protected: Path | None = None,
                    extra: dict | None = None) -> Path:
    """Write the checkpoint for ``step`` atomically; returns its directory. Then only the newest ``keep`` (and
    ``protected``) remain; ``extra`` goes into state.json. With several processes every rank calls it (the state is
    gathered collectively) and rank 0 writes."""
    adapter = adapter_state(model)
    optimizer_state = get_optimizer_state_dict(model, optimizer, options=_FULL)
    for group in optimizer_state.get("param_groups", ()):  # a captured step's lr is a device tensor: a number here
        if torch.is_tensor(group.get("lr")):
            group["lr"] = float(group["lr"])
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
    torch.save(_host_numbers(scheduler.state_dict()), tmp / "scheduler.pt")
    torch.save(rng, tmp / "rng.pt")
    state = {**(extra or {}), "step": step, "metrics_lines": metrics_lines,
             "sha256": {name: _sha256(tmp / name) for name in DIGESTED}}
    (tmp / "state.json").write_text(json.dumps(finite_or_none(state), allow_nan=False))  # strict JSON
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    older = [p for p in sorted(root.glob("step-*")) if p != final]
    for old in older[:max(0, len(older) - (keep - 1))]:
        if protected is None or old != Path(protected):
            shutil.rmtree(old)
    barrier(world)
    return final


def _host_numbers(state: dict) -> dict:
    """A scheduler's state with its lists of lr tensors (``_last_lr`` of a captured step's optimizer) as floats,
    so the files are the same whether the steps were captured or not."""
    return {k: [float(x) if torch.is_tensor(x) else x for x in v] if isinstance(v, list) else v
            for k, v in state.items()}


def _keep_implementation(optimizer, load) -> None:
    """``load()`` an optimizer state, keeping how this optimizer steps: the saved param groups carry the saving
    run's ``fused`` / ``capturable`` / ``foreach`` flags (an eager run's, resumed with --cuda-graphs, or the
    reverse), and a capturable or fused AdamW keeps its ``step`` counts on the parameters' device (the others on
    the CPU). A tensor lr (a captured step's) stays a tensor, given the loaded value."""
    keys = ("fused", "capturable", "foreach", "differentiable")
    own = [({k: g[k] for k in keys if k in g}, g["lr"]) for g in optimizer.param_groups]
    load()
    for group, (flags, lr) in zip(optimizer.param_groups, own):
        group.update(flags)
        if torch.is_tensor(lr):
            lr.fill_(float(group["lr"]))
            group["lr"] = lr
        on_device = flags.get("capturable") or flags.get("fused")
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].to(dtype=torch.float32, device=p.device if on_device else "cpu")


def checkpoints(output: Path) -> list[Path]:
    """The complete checkpoints under ``output``, oldest first."""
    return sorted((Path(output) / CHECKPOINTS).glob("step-*"))


def latest_checkpoint(output: Path) -> Path | None:
    """The newest complete checkpoint under ``output``, or None."""
    found = checkpoints(output)
    return found[-1] if found else None


def damaged(file: Path, reason: str, *, export: bool = False) -> LeantuneError:
    """The one-line error for a damaged checkpoint file: which file, why, and the earlier checkpoints to go back to
    (``export``: the message of ``leantune export``, which takes a checkpoint folder as ``--adapter``)."""
    folder = Path(file).parent
    earlier = [p for p in checkpoints(folder.parent.parent) if p.name < folder.name]
    if earlier and export:
        todo = (f"export an earlier checkpoint with --adapter {earlier[-1]} (kept: "
                f"{', '.join(p.name for p in earlier)})")
    elif earlier:
        todo = (f"to resume from an earlier checkpoint (kept: {', '.join(p.name for p in earlier)}), move {folder} "
                f"out of {folder.parent}: --resume continues from the newest one left")
    else:
        todo = "no earlier checkpoint is kept (--keep-checkpoints); start the run again"
    return LeantuneError(f"checkpoint file {file} is truncated or corrupt ({reason}); {todo}; nothing was deleted")


DIGESTED = ("adapter_model.safetensors", "optimizer.pt", "scheduler.pt", "rng.pt")  # state.json's "sha256"


def _sha256(file: Path) -> str:
    digest = hashlib.sha256()
    with open(file, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def _read(file: Path, reader, *, export: bool = False, sha256: dict | None = None):
    """``reader(file)``, any failure to read or decode it a ``damaged`` error (the reader only reads); with
    ``sha256`` (state.json's, absent in checkpoints of an older leantune) the file's digest must match first:
    damage inside a file that still decodes (a flipped byte in the optimizer state) is caught too."""
    if not file.is_file():
        raise damaged(file, "missing", export=export)
    expected = (sha256 or {}).get(file.name)
    if expected is not None and _sha256(file) != expected:
        raise damaged(file, "its SHA-256 differs from the one saved with it", export=export)
    try:
        return reader(file)
    except Exception as exc:  # safetensors, torch's zip reader, pickle and json each raise their own kinds
        raise damaged(file, one_line(exc)[:200], export=export) from None


def _state(file: Path) -> dict:
    state = json.loads(file.read_text(encoding="utf-8"))
    if not (isinstance(state, dict) and isinstance(state.get("step"), int)
            and isinstance(state.get("metrics_lines"), int) and state["step"] >= 0):
        raise ValueError("not a leantune state.json: expected integer step and metrics_lines")
    return state


def read_state(path: Path, *, export: bool = False) -> dict:
    """A checkpoint's ``state.json`` (``step``, ``metrics_lines``, ...); a damaged one is a LeantuneError."""
    return _read(Path(path) / "state.json", _state, export=export)


def checkpoint_step(path: Path, *, export: bool = False) -> int:
    """The optimizer step a checkpoint was saved at (its ``state.json``)."""
    return read_state(path, export=export)["step"]


def read_adapter(path: Path, *, export: bool = False, sha256: dict | None = None) -> dict:
    """The adapter tensors of a checkpoint (PEFT's keys); a damaged file is a LeantuneError (``sha256``: as
    ``_read``; None: state.json's, read here)."""
    path = Path(path)
    if sha256 is None:
        sha256 = read_state(path, export=export).get("sha256")
    return _read(path / "adapter_model.safetensors", lambda f: load_file(str(f)), export=export, sha256=sha256)


def _optimizer(file: Path) -> dict:
    state = torch.load(file, map_location="cpu", weights_only=True)
    if not (isinstance(state, dict) and isinstance(state.get("state"), dict) and "param_groups" in state):
        raise ValueError("not an optimizer state dict")
    return state


def read_checkpoint(path: Path) -> dict:
    """Every file of a checkpoint, read and checked (nothing applied yet): ``adapter``, ``optimizer``,
    ``scheduler``, ``rng``, ``state``. Raises the ``damaged`` LeantuneError for the first unreadable file."""
    path = Path(path)
    state = read_state(path)
    digests = state.get("sha256") if isinstance(state.get("sha256"), dict) else None
    return {"state": state, "adapter": read_adapter(path, sha256=digests or {}),
            "optimizer": _read(path / "optimizer.pt", _optimizer, sha256=digests),
            "scheduler": _read(path / "scheduler.pt", lambda f: torch.load(f, weights_only=True), sha256=digests),
            "rng": _read(path / "rng.pt", lambda f: torch.load(f, weights_only=False), sha256=digests)}


def load_checkpoint(path: Path, model, optimizer, scheduler, world: World = World(),
                    stored: dict | None = None) -> dict:
    """Restore everything saved by ``save_checkpoint`` in place (every rank reads the files, or passes what
    ``read_checkpoint`` returned as ``stored``); returns ``state.json``'s dict. The world size must be the one that
    saved it (checked by the caller from run.json). Raises LeantuneError for a damaged file or an adapter of
    another shape."""
    path = Path(path)
    stored = stored if stored is not None else read_checkpoint(path)
    names = _peft_names(model)
    missing = sorted(set(names) - set(stored["adapter"]))
    if missing:
        raise LeantuneError(f"{path / 'adapter_model.safetensors'} lacks {len(missing)} adapter tensors "
                            f"({missing[0]}, ...): it was saved for another adapter")
    try:
        set_model_state_dict(model, {names[key]: stored["adapter"][key] for key in names}, options=_LOAD)
    except RuntimeError as exc:  # a tensor of another shape
        raise damaged(path / "adapter_model.safetensors", one_line(exc)[:200]) from None
    optimizer_state = stored["optimizer"]
    try:
        if all(isinstance(key, int) for key in optimizer_state["state"]):  # written by leantune 0.1 (one process)
            _keep_implementation(optimizer, lambda: optimizer.load_state_dict(optimizer_state))
        else:
            _keep_implementation(optimizer, lambda: set_optimizer_state_dict(model, optimizer, optimizer_state,
                                                                             options=_LOAD))
        scheduler.load_state_dict(stored["scheduler"])
        rng = stored["rng"]
        _set_rng_state(rng[world.rank] if isinstance(rng, list) else rng)  # a dict: saved by one plain process
    except (KeyError, ValueError, TypeError, RuntimeError, IndexError) as exc:
        raise damaged(path / "optimizer.pt", f"its state does not fit this run: {one_line(exc)[:200]}") from None
    return stored["state"]
