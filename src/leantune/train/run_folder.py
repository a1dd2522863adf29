"""The run folder (``--output``): what may be written, replaced or resumed there, and by whom.

- Every user error is raised before anything in the folder is written or removed (``check_output``,
  ``check_resume``, ``check_resume_steps``), and decided again under the lock just before the run claims it.
- A folder counts as a run (``holds_run``: replacing it needs ``--overwrite``, continuing it ``--resume``) once its
  leantune ``run.json`` sits beside a checkpoint, the adapter or summary.json. A run that failed before its first
  checkpoint left only run.json/metrics.jsonl, cannot be resumed, and is simply replaced by the next run.
- Only leantune's own files (``RUN_FILES``) are ever replaced, and only next to a run.json leantune wrote
  (``read_run_info``); a folder of other files needs ``--overwrite`` and keeps them, and a file of theirs with the
  name of a run output is never replaced.
- A replaced run is moved into ``.replaced-*`` (``set_aside``), put back (``put_back``) if the new run fails or is
  stopped before its first checkpoint, and deleted only when the new run finishes; a kill keeps it, and a later run
  deletes it only with ``--overwrite`` or ``--resume``.
- ``--resume`` continues only the same run and reads its settings from run.json (``resume_base``): an option not
  given is the run's own; the settings in ``RESUME_FIXED`` and the step count (which fixes the learning-rate
  schedule) that are given must match, and every one that differs is named in one error (``check_resume``).
- A lock file holding the pid (``LOCK``) keeps a second run out of a folder in use; a dead run's lock is stale.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import uuid
from pathlib import Path

from ..errors import LeantuneError
from . import checkpoint
from .config import FIELDS, TrainConfig, coerce
from .metrics import say
from .reporting import FOLDERS as REPORT_FOLDERS

RUN_FILES = ("adapter", "tokenizer", "checkpoints", "metrics.jsonl", "loss.png", "summary.json", "run.json",
             *REPORT_FOLDERS)
LOCK = ".leantune.lock"  # pid of the run writing into the folder
REPLACED = ".replaced-"  # prefix of the folder that keeps a replaced run until the new one finishes
# settings a resumed run must share with the run it continues: the adapter's shape and scaling, the base weights,
# the data rows each step takes, and the optimizer settings its saved state holds (clipping, eval and save
# intervals may change; the step count is checked by check_resume_steps, once the data says what it is)
RESUME_FIXED = ("model", "data", "seq_len", "batch_size", "grad_accum", "lora_r", "lora_alpha", "lora_dropout", "dora",
                "rslora",
                "target_modules", "seed", "eval_size", "max_examples", "quantize",
                "text_column", "messages_column", "prompt_column", "completion_column", "chat_template", "eval_data",
                "eval_split", "dtype",  # these fix the rows, the held-out split and the weights' dtype
                "lr", "weight_decay", "warmup_steps", "min_lr_ratio")  # these four live in the optimizer state


def read_run_info(output: Path) -> dict | None:
    """``run.json`` of ``output`` when leantune wrote it (``"tool": "leantune"``, or the keys every leantune
    run.json has), else None: a user's file of that name is never taken for a run of ours."""
    try:
        info = json.loads((output / "run.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    if not isinstance(info, dict) or not isinstance(info.get("config"), dict):
        return None
    if info.get("tool") == "leantune" or {"model_kind", "model_path", "total_steps"} <= info.keys():
        return info
    return None


def holds_run(output: Path) -> bool:
    """A leantune run worth keeping: its ``run.json`` plus something a crash cannot be the only source of (a
    complete checkpoint, the adapter or the summary). A run that died before its first checkpoint does not count."""
    return read_run_info(output) is not None and (
        (output / "adapter").exists() or (output / "summary.json").exists()
        or checkpoint.latest_checkpoint(output) is not None)


def replaced_runs(output: Path) -> list[Path]:
    """The ``.replaced-*`` folders of ``output`` that hold a run leantune moved aside (a user's folder of that name,
    without a leantune run.json, is the user's)."""
    return [p for p in output.glob(REPLACED + "*") if p.is_dir() and read_run_info(p) is not None]


def kept_run_hint(output: Path) -> str:
    """``; a previous run is kept in ...`` when ``output`` holds a run leantune moved aside to replace it and the
    replacing run died before finishing (an OOM kill, a preemption): where it is and how to get it back. Else ""."""
    kept = sorted(replaced_runs(output))
    if not kept:
        return ""
    return (f"; the run it was replacing is kept in {kept[-1]} (move its files back into {output} to use or resume "
            "it)")


def nearest_existing(path: Path) -> Path:
    """``path`` (made absolute) or its nearest existing parent: where a folder that does not exist yet would be
    created, and what must be a writable directory for that."""
    probe = path.absolute()
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    return probe


def _check_writable(output: Path) -> None:
    """The output folder (or the first existing folder above it, where it will be created) is a folder that can be
    written: checked before the model is loaded, not discovered as a traceback after."""
    probe = nearest_existing(output)
    if not probe.is_dir():
        raise LeantuneError(f"output path {output}: {probe} is a file, not a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise LeantuneError(f"output path {output}: {probe} is not writable")


# ---------------------------------------------------------------------------------------------------------------
# The lock


def _lock_holder(output: Path) -> int | None:
    """pid of another live process holding ``output``'s lock, else None (no lock, ours, or a dead run's)."""
    try:
        pid = int((output / LOCK).read_text().strip())
    except (OSError, ValueError):
        return None
    if pid == os.getpid():
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:  # alive, another user's
        pass
    return pid


def _in_use(output: Path) -> LeantuneError:
    return LeantuneError(f"output dir {output} is in use by another leantune run (pid {_lock_holder(output)}); wait "
                         f"for it or choose another --output (if that pid is no leantune run, delete {output / LOCK})")


def acquire_lock(output: Path) -> None:
    """Create ``output``'s lock file atomically with this pid; a stale one (dead pid) is replaced once."""
    for _ in range(2):
        try:
            fd = os.open(output / LOCK, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            if _lock_holder(output) is not None:
                raise _in_use(output) from None
            (output / LOCK).unlink(missing_ok=True)  # a dead run's (or our own earlier) lock
            continue
        with os.fdopen(fd, "w") as f:
            f.write(str(os.getpid()))
        return
    raise _in_use(output)


def release_lock(output: Path) -> None:
    try:
        if (output / LOCK).read_text().strip() == str(os.getpid()):
            (output / LOCK).unlink()
    except OSError:
        pass


# ---------------------------------------------------------------------------------------------------------------
# What a run may do with the folder


def run_settings(run_json: Path) -> dict | None:
    """The settings a leantune ``run.json`` holds, as ``{option: value}``: every option but ``output``, ``resume``
    and ``overwrite``, the model and data as the absolute paths the run recorded (None for the embedded ones: they
    are resolved again). Options it does not know (an older leantune) are absent. None when ``run_json`` is not a
    leantune run.json."""
    run_json = Path(run_json)
    info = read_run_info(run_json.parent) if run_json.name == "run.json" else None
    if info is None:
        return None
    values = {}
    for name, value in info["config"].items():
        if name in FIELDS and name not in ("output", "resume", "overwrite"):  # the folder may have been moved
            values[name] = coerce(name, value, f"{name} in {run_json}")
    for name in ("model", "data"):
        if values.get(name) is not None and isinstance(info.get(f"{name}_path"), str):
            values[name] = info[f"{name}_path"]
    return values


def resume_base(output: Path, base: TrainConfig) -> TrainConfig:
    """``base`` with the settings of the run in ``output`` (``run_settings`` of its run.json), so that ``--resume``
    needs no option retyped; ``base`` itself without a leantune run.json (``check_output`` then says there is
    nothing to resume)."""
    values = run_settings(Path(output) / "run.json")
    return base if values is None else TrainConfig(**{**base.to_dict(), **values})


def check_resume(config: TrainConfig, output: Path, model_path: Path, data_path: Path) -> dict:
    """The run being resumed (its run.json) when ``config`` keeps every ``RESUME_FIXED`` setting and its step
    count; else one LeantuneError naming every setting that differs (this run's value and the saved one). Checked
    before the model is loaded or anything is written."""
    info = read_run_info(output)
    if info is None:
        raise LeantuneError(f"--resume: {output / 'run.json'} is missing or not a leantune run's; cannot check that "
                            "this run continues it")
    before, now = info["config"], config.to_dict()
    differ, hint = [], ""
    for name in RESUME_FIXED:
        # a setting newer than the run (e.g. --dora) had its default there
        old, new = before.get(name, FIELDS[name].default), now.get(name)
        if name in ("model", "data"):  # the files, however they were spelled (relative, absolute, ..)
            old, new = info.get(f"{name}_path"), str((model_path if name == "model" else data_path).resolve())
            same = old is not None and Path(old).resolve() == Path(new)
        else:
            same = old == new
        if not same:
            shown = ["off" if v is None and name == "quantize" else v for v in (new, old)]  # as the CLI spells it
            differ.append(f"--{name.replace('_', '-')} {shown[0]} (saved: {shown[1]})")
            if name in ("model", "data") and old is not None and not Path(old).is_absolute():
                hint = ("; run.json of an older leantune holds the paths relative to where that run started: "
                        "resume from there")
    planned = info.get("total_steps")
    if config.max_steps is not None and planned is not None and config.max_steps != planned:
        differ.append(f"--max-steps {config.max_steps} (saved: {planned} steps)")
    elif config.max_steps is None and before.get("max_steps") is None and before.get("epochs") != config.epochs:
        differ.append(f"--epochs {config.epochs} (saved: {before.get('epochs')})")
    if differ:
        verb, pronoun = ("differs", "it") if len(differ) == 1 else ("differ", "them")
        raise LeantuneError(f"--resume: {', '.join(differ)} {verb} from the run being resumed (in "
                            f"{output / 'run.json'}{hint}); leave {pronoun} out (--resume reads the run's own "
                            "settings) or start a new --output")
    return info


def _sample(digest, file: Path) -> None:
    """Feed ``digest`` a file's size and its first and last MiB (at most 2 MiB read, whatever its size)."""
    size = file.stat().st_size if file.exists() else -1
    digest.update(f"{size};".encode())
    if size > 0:
        with open(file, "rb") as f:
            digest.update(f.read(1 << 20))
            if size > 2 << 20:
                f.seek(-(1 << 20), os.SEEK_END)
                digest.update(f.read())


def data_fingerprint(paths) -> str:
    """A short digest of the data files' sizes and contents (their first and last MiB; a saved dataset folder: every
    file's name and size), recorded in run.json so that ``--resume`` notices data replaced under the same path.
    Cheap at any size: at most 2 MiB read a file."""
    digest = hashlib.sha256()
    for path in map(Path, paths):
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        for file in files:
            if path.is_dir():
                size = file.stat().st_size if file.exists() else -1
                digest.update(f"{file.relative_to(path)}:{size};".encode())
            else:
                digest.update(f"{file.name}:".encode())
                _sample(digest, file)
    return digest.hexdigest()[:16]


# what defines the weights and the tokens of a model folder (generation_config.json, READMEs: not)
_MODEL_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")


def model_fingerprint(path: Path) -> dict[str, str]:
    """``{file name: short digest of its size, first and last MiB}`` of the base model's files (a folder: its
    config, tokenizer and weight files; a .gguf or config.json: that file), recorded in run.json so that
    ``--resume`` and ``leantune export`` notice a base replaced or edited under the same path. A re-initialised or
    fine-tuned weight file differs in its first MiB of tensor data; at most 2 MiB read a file."""
    path = Path(path)
    files = ([p for p in path.iterdir() if p.is_file() and (p.name in _MODEL_FILES or p.suffix in _WEIGHT_SUFFIXES)]
             if path.is_dir() else [path])
    prints = {}
    for file in sorted(files):
        digest = hashlib.sha256()
        _sample(digest, file)
        prints[file.name] = digest.hexdigest()[:16]
    return prints


def model_changes(saved: dict | None, current: dict[str, str]) -> list[str]:
    """The files whose digest differs between run.json's ``saved`` fingerprint and ``current`` (added and removed
    ones too), sorted; [] when they agree or a run of an older leantune recorded none."""
    if not saved:
        return []
    return sorted(name for name in saved.keys() | current.keys() if saved.get(name) != current.get(name))


def check_resume_data(info: dict, fingerprint: str) -> None:
    """Raise LeantuneError when the data files at the resumed run's paths are not the ones it started on (by
    :func:`data_fingerprint`) or its base model's files changed (by :func:`model_fingerprint`); runs of an older
    leantune, which recorded none, are not checked."""
    saved = info.get("data_fingerprint")
    if saved is not None and saved != fingerprint:
        raise LeantuneError(f"--resume: the data at {info.get('data_path')} changed since the run started (its size "
                            "or contents differ); resuming would continue the schedule on other examples and compare "
                            "eval losses of another held-out set: restore the file or start a new --output")
    if info.get("model_fingerprint") and info.get("model_path"):
        changed = model_changes(info["model_fingerprint"], model_fingerprint(Path(info["model_path"])))
        if changed:
            raise LeantuneError(f"--resume: the base model at {info['model_path']} changed since the run started "
                                f"({', '.join(changed)} differ); its adapter was trained on the old one: restore it "
                                "or start a new --output")


def check_resume_steps(info: dict, resume_from: Path, total_steps: int) -> int:
    """The step ``resume_from`` was saved at, when this run's step count is the resumed run's: the warmup and the
    cosine decay are laid out over the step count, so another count would make the learning rate jump at the
    resumed step. Raises LeantuneError for a checkpoint past ``total_steps`` or any other step count."""
    saved_step = checkpoint.checkpoint_step(resume_from)  # a damaged state.json: one error line
    if saved_step > total_steps:
        raise LeantuneError(f"--resume: the checkpoint {resume_from.name} is at step {saved_step}, past this run's "
                            f"{total_steps} steps (--max-steps / --epochs); ask for at least {saved_step}")
    planned = info.get("total_steps")
    if planned is not None and planned != total_steps:
        raise LeantuneError(f"--resume: this run would have {total_steps} steps (--max-steps / --epochs), the run "
                            f"being resumed has {planned}; its learning-rate schedule (warmup, then cosine decay to "
                            f"step {planned}) continues only with the same count: resume with --max-steps {planned} "
                            "or start a new --output")
    return saved_step


def check_output(config: TrainConfig) -> Path | None:
    """Refuse to clobber a run or a folder of other files; returns the checkpoint to resume from (None: fresh run).

    A fresh run may go into: a missing or empty folder; an incomplete run (``run.json`` and other leantune files
    only, from a run that failed before its first checkpoint: there is nothing to resume, so it is replaced without
    ``--overwrite``); with ``--overwrite``, a finished run, or a folder with other files as long as none of them has
    the name of a file leantune writes. Only leantune's own files (``RUN_FILES``) are ever replaced.
    """
    output = Path(config.output)
    if not str(config.output).strip():
        raise LeantuneError("--output must name a directory, got an empty path")
    if output.exists() and not output.is_dir():
        raise LeantuneError(f"output path {output} exists and is not a directory")
    if output.is_symlink() and not output.exists():
        raise LeantuneError(f"output path {output} is a symlink to a missing target ({os.readlink(output)})")
    _check_writable(output)
    if output.is_dir() and _lock_holder(output) is not None:
        raise _in_use(output)
    if config.resume:
        found = checkpoint.latest_checkpoint(output)
        if found is None:
            raise LeantuneError(f"nothing to resume: no checkpoint in {output}{kept_run_hint(output)}")
        return found
    if not output.is_dir():
        return None
    if holds_run(output):
        if not config.overwrite:
            raise LeantuneError(f"output dir {output} already holds a run; pass --overwrite to replace it or "
                                "--resume to continue it")
        return None
    ours = {p.name for p in replaced_runs(output)} | {LOCK}
    entries = {p.name for p in output.iterdir()} - ours
    if "run.json" in entries and entries <= set(RUN_FILES) and read_run_info(output) is not None:
        if replaced_runs(output):  # a replacing run died: say where the run it replaced still is
            say(f"leantune: replacing the incomplete run in {output}{kept_run_hint(output)}")
        return None  # an incomplete run of ours
    if entries and not config.overwrite:
        raise LeantuneError(f"output dir {output} is not empty and holds no leantune run; choose another --output "
                            "or pass --overwrite to write the run next to its files (they are kept)")
    clashes = sorted(entries & set(RUN_FILES))
    if clashes:
        raise LeantuneError(f"output dir {output} holds files that are not from a leantune run but have the names "
                            f"of its outputs ({', '.join(clashes)}); choose another --output")
    return None


# ---------------------------------------------------------------------------------------------------------------
# Replacing a run, and putting it back


def remove(path: Path) -> None:
    """Delete a file or a folder tree if it exists (a symlink is removed, never followed)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)  # best effort: a cleanup must not mask the error that called it
    else:
        path.unlink(missing_ok=True)


def set_aside(output: Path, replaced: list) -> None:
    """Move the files of the run being replaced into a new ``.replaced-*`` folder; ``replaced`` receives
    ``(folder, names)`` before the folder and the first move exist, so a stop at any point is undone by
    ``put_back``."""
    previous = [name for name in RUN_FILES if (output / name).exists()]
    if not previous:
        return
    kept = output / f"{REPLACED}{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}"
    replaced.append((kept, previous))
    kept.mkdir()
    for name in previous:
        os.replace(output / name, kept / name)
    say(f"leantune: the run being replaced is kept in {kept} until this run finishes")


def new_run_has_checkpoint(output: Path, kept: Path, previous: list[str]) -> bool:
    """Whether ``output``'s checkpoints are the new run's (the previous run's may not have been moved aside yet)."""
    if checkpoint.CHECKPOINTS in previous and not (kept / checkpoint.CHECKPOINTS).exists():
        return False
    return checkpoint.latest_checkpoint(output) is not None


def put_back(output: Path, kept: Path, previous: list[str]) -> None:
    """Undo the move of a replaced run: the new run failed or was stopped before its first checkpoint, so it left
    nothing to resume, and the run it was replacing (``previous``: its file names, some perhaps not moved yet when
    the stop came) is the folder's run again."""
    for name in RUN_FILES:
        new, old = output / name, kept / name
        if name in previous and not old.exists():  # never moved: it is still the previous run's own file
            continue
        remove(new)  # the new run's
        if old.exists():
            os.replace(old, new)
    shutil.rmtree(kept, ignore_errors=True)
    say(f"leantune: the run this one was replacing is back in {output}")


def delete_replaced(output: Path, replaced: list, asked: bool) -> None:
    """A finished run no longer needs the run it replaced. Older kept runs go only when this run was ``asked`` to
    replace or continue (a fresh run into a crashed run's folder never deletes what that run had kept aside)."""
    for kept in replaced_runs(output) if asked else [k for k, _ in replaced]:
        shutil.rmtree(kept, ignore_errors=True)
