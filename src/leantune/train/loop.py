"""The training loop of ``leantune train``, read top to bottom: load, wrap in LoRA, patch, train, evaluate, save.

Gradient accumulation: the K micro-batches of a step share one divisor, the number of target tokens of the whole
step (``num_items_in_batch`` at the model boundary), so the summed micro-batch losses are the token mean over the
step and the gradients equal those of one batch K times larger (``accumulate_gradients``).

Data order: step s of epoch e = s // steps_per_epoch takes rows ``perm_e[i*B*K:(i+1)*B*K]`` of a permutation seeded
with ``seed + e``, so the data position is the step number and a resumed run sees exactly the rows it would have.

Reproducibility: on CPU (fp32) a run, and a run resumed from any checkpoint, ends with bit-identical weights for the
same thread count. On CUDA, bf16 results are reproducible up to the run-to-run noise of atomic adds (weight-gradient
reductions in the Triton kernels and in cuBLAS split-K) and of SDPA's backward; the data order and LoRA init stay
exact.

Output dir: every user error is raised before anything in it is written or removed. A run counts as a run (and needs
``--overwrite`` or ``--resume``) once it has a checkpoint, the adapter or summary.json; a run that failed before its
first checkpoint left only run.json/metrics.jsonl, cannot be resumed, and is simply replaced by the next run. Only
leantune's own files (``RUN_FILES``) are ever replaced, and only next to a run.json that leantune wrote; the replaced
run is moved into ``.replaced-*``, put back if the new run fails or is stopped before its first checkpoint, and
deleted only when the new run finishes (a kill keeps it; a later run deletes it only with ``--overwrite`` or
``--resume``); a folder of other files needs ``--overwrite`` and keeps them. ``--resume`` continues only the same run:
the settings that fix the adapter, the base model and the data rows (``RESUME_FIXED``) must match run.json, and the
checkpoint may not be past the requested steps. A lock file with the pid keeps a second run out of a folder in use.
Ctrl-C or SIGTERM finishes the step and saves a checkpoint. Non-finite losses are recorded as null (strict JSON) with
a warning.
"""

from __future__ import annotations

import json
import math
import os
import resource
import shutil
import signal
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from . import checkpoint
from .config import LeantuneError, TrainConfig
from .data import PackedData, chitchat_path, load_dataset
from .metrics import MetricsLog, plot_losses, to_json

RUN_FILES = ("adapter", "tokenizer", "checkpoints", "metrics.jsonl", "loss.png", "summary.json", "run.json")
LOCK = ".leantune.lock"  # pid of the run writing into the folder
REPLACED = ".replaced-"  # prefix of the folder that keeps a replaced run until the new one finishes
# settings a resumed run must share with the run it continues: the adapter's shape and scaling, the base weights,
# the data rows each step takes, and the optimizer settings its saved state holds (--max-steps, clipping, eval and
# save intervals may change)
RESUME_FIXED = ("model", "data", "seq_len", "batch_size", "grad_accum", "lora_r", "lora_alpha", "lora_dropout",
                "target_modules", "seed", "eval_size", "max_examples",
                "lr", "weight_decay", "warmup_steps", "min_lr_ratio")  # these four live in the optimizer state


def _say(message: str) -> None:
    """A status or warning line on stderr that does not break the progress bar."""
    tqdm.write(message, file=sys.stderr)


# ---------------------------------------------------------------------------------------------------------------
# Model loading


def resolve_model(spec: str | None) -> tuple[str, Path]:
    """Classify ``--model``: ``("hf", folder)``, ``("gguf", file)`` or ``("config", config.json)``.

    ``None`` is the embedded SmolLM2-135M-Instruct (converted once from its GGUF by ``leantune.assets``).
    Raises LeantuneError for a missing path or one that is none of the three kinds.
    """
    if spec is None:
        from .. import assets

        try:
            return "hf", assets.smollm2_path()
        except (FileNotFoundError, ImportError) as exc:
            raise LeantuneError(f"the embedded model is unavailable: {exc}") from None
    path = Path(spec)
    if not path.exists():
        raise LeantuneError(f"model not found: {spec}")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise LeantuneError(f"unsupported model folder {spec}: no config.json (expected a Hugging Face folder)")
        return "hf", path
    if path.suffix == ".gguf":
        return "gguf", path
    if path.suffix == ".json":
        return "config", path
    raise LeantuneError(f"unsupported model path {spec}: expected a Hugging Face folder, a .gguf file or a config.json")


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")


def _one_line(exc: BaseException) -> str:
    """An exception's whole message on one line (transformers' messages span several lines)."""
    return " ".join(str(exc).split()) or type(exc).__name__


def load_tokenizer(kind: str, path: Path):
    """The tokenizer that goes with ``resolve_model``'s result; a bare config.json borrows the default one.

    Raises LeantuneError when the folder has no tokenizer: no tokenizer file, a failed load, or a tokenizer of
    fewer than 2 tokens (transformers can build an empty one, which would otherwise surface much later as an
    "empty dataset"), and for a tokenizer that is there but does not load.
    """
    from transformers import AutoTokenizer

    folder = path if kind == "hf" else path.parent
    missing = f"no tokenizer in {folder}: expected tokenizer.json or tokenizer.model/tokenizer_config.json"
    has_files = any((folder / name).is_file() for name in TOKENIZER_FILES)
    try:
        if kind == "gguf":
            tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        elif kind == "config" and not any((path.parent / n).is_file() for n in ("tokenizer.json",
                                                                                  "tokenizer_config.json")):
            tokenizer = load_tokenizer(*resolve_model(None))
        else:
            tokenizer = AutoTokenizer.from_pretrained(folder)
    except LeantuneError:
        raise
    except Exception as exc:  # transformers raises many kinds here; none of them is worth a traceback
        if kind != "gguf" and not has_files:
            raise LeantuneError(missing) from None
        raise LeantuneError(f"cannot load the tokenizer of {path}: {_one_line(exc)}") from None
    if len(tokenizer) < 2:
        if kind == "gguf":
            raise LeantuneError(f"no tokenizer in {path}: it holds an empty vocabulary")
        raise LeantuneError(missing + (f" (the tokenizer files there load as a vocabulary of {len(tokenizer)} "
                                       "token)" if has_files else ""))
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(kind: str, path: Path, dtype: torch.dtype, device: str, seed: int):
    """A causal LM on ``device`` in ``dtype``; a config.json is initialised randomly (seeded) directly on device.

    Raises LeantuneError for an unsupported model type or unreadable weights.
    """
    from safetensors import SafetensorError
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as transformers_logging

    try:
        if kind == "config":
            config = AutoConfig.from_pretrained(path)
            torch.manual_seed(seed)
            with torch.device(device):
                model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        elif kind == "gguf":
            model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
        else:
            verbosity = transformers_logging.get_verbosity()
            transformers_logging.set_verbosity_error()  # its load report table: the checks below say it in a line
            try:
                model, info = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, output_loading_info=True,
                                                                   ignore_mismatched_sizes=True)
            finally:
                transformers_logging.set_verbosity(verbosity)
            _check_loading_info(path, info)
    except (ValueError, KeyError) as exc:
        raise LeantuneError(f"unsupported model type in {path}: {str(exc).splitlines()[0]}") from None
    except (OSError, RuntimeError, SafetensorError) as exc:  # missing, truncated or mismatched weights
        raise LeantuneError(f"cannot load model {path}: {_one_line(exc)[:400]}") from None
    return model.to(device)


def _check_loading_info(path: Path, info: dict) -> None:
    """Weights that do not fit config.json are an error: a missing tensor would be initialised at random and a
    mismatched one replaced (transformers only prints a table); tensors the model has no place for are a warning."""
    def some(keys):
        keys = sorted(str(k[0] if isinstance(k, tuple) else k) for k in keys)
        return ", ".join(keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")

    if info.get("mismatched_keys"):
        key, stored, expected = sorted(info["mismatched_keys"], key=str)[0]
        raise LeantuneError(f"cannot load model {path}: the weights do not match its config.json ({key} is "
                            f"{tuple(stored)} in the checkpoint, {tuple(expected)} in the model; "
                            f"{len(info['mismatched_keys'])} tensors differ)")
    if info.get("missing_keys"):
        raise LeantuneError(f"cannot load model {path}: its config.json asks for weights the checkpoint lacks "
                            f"({some(info['missing_keys'])}); they would be initialised at random")
    if info.get("unexpected_keys"):
        _say(f"leantune: warning: {path} holds weights its config.json has no place for, ignored: "
             f"{some(info['unexpected_keys'])}")


def wrap_lora(model, config: TrainConfig):
    """PEFT LoRA on ``config.target_modules`` (adapters in fp32, PEFT's default), then ``leantune.patch``."""
    from peft import LoraConfig, get_peft_model

    targets = config.target_modules
    if targets != "all-linear":
        targets = [name.strip() for name in targets.split(",") if name.strip()]
        names = [name for name, _ in model.named_modules()]
        # PEFT's rule for a list: a module matches a key when its name is the key or ends with "." + key; PEFT
        # itself only complains when no key matches, so a typo next to a valid name would be silently dropped.
        unmatched = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]
        if unmatched or not targets:
            linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                             if isinstance(m, torch.nn.Linear)})
            raise LeantuneError(f"--target-modules: {', '.join(repr(t) for t in unmatched) or '(none)'} not found "
                                f"in the model; its linear layers are {', '.join(linear)}")
    widest = max((min(m.in_features, m.out_features) for m in model.modules() if isinstance(m, torch.nn.Linear)),
                 default=0)
    if config.lora_r > widest:  # checked before PEFT allocates [r, in] and [out, r] per layer
        raise LeantuneError(f"--lora-r {config.lora_r} is larger than every linear layer of the model allows: the "
                            f"widest has min(in, out) = {widest}, and a rank above it is not low-rank")
    model.config.use_cache = False
    if config.gradient_checkpointing == "on":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lora = LoraConfig(r=config.lora_r, lora_alpha=config.lora_alpha, lora_dropout=config.lora_dropout,
                      target_modules=targets, bias="none", task_type="CAUSAL_LM")
    torch.manual_seed(config.seed)
    try:
        model = get_peft_model(model, lora)
    except ValueError as exc:
        raise LeantuneError(f"cannot apply LoRA: {str(exc).splitlines()[0]}") from None
    if config.patch == "on":
        import leantune

        patch = getattr(leantune, "patch", None)
        if patch is not None and not callable(patch):  # the subpackage, when __init__ does not re-export it
            patch = getattr(patch, "patch", None)
        if patch is None:
            _say("leantune: warning: leantune.patch is not available; training with the unpatched modules")
        else:
            try:
                model = patch(model)
                model._leantune_patched = True
            except ValueError as exc:  # a family without a patch table still trains, with HF's modules
                _say(f"leantune: warning: not patched ({str(exc).splitlines()[0]}); training with HF's modules")
    return model


# ---------------------------------------------------------------------------------------------------------------
# One step


def accumulate_gradients(model, micro_batches: list[PackedData], device: str) -> float:
    """Forward and backward every micro-batch, each loss divided by the step's total target tokens.

    Gradients accumulate in ``.grad``; returns the step's mean loss per target token (the sum of the micro losses).
    With K micro-batches of B rows this equals one batch of K*B rows (loss and gradients; tested).
    """
    num_items = sum(batch.num_targets() for batch in micro_batches)
    num_items_t = torch.tensor(max(num_items, 1), device=device)
    total = 0.0
    for batch in micro_batches:
        loss = model(input_ids=batch.input_ids.to(device), position_ids=batch.position_ids.to(device),
                     labels=batch.labels.to(device), num_items_in_batch=num_items_t, use_cache=False).loss
        loss.backward()
        total += loss.item()
    return total


@torch.no_grad()
def evaluate(model, data: PackedData, batch_size: int, device: str) -> float:
    """Mean loss per target token over ``data`` (no dropout)."""
    was_training = model.training
    model.eval()
    num_items = torch.tensor(max(data.num_targets(), 1), device=device)
    total = 0.0
    for start in range(0, len(data), batch_size):
        batch = data.select(slice(start, start + batch_size))
        total += model(input_ids=batch.input_ids.to(device), position_ids=batch.position_ids.to(device),
                       labels=batch.labels.to(device), num_items_in_batch=num_items, use_cache=False).loss.item()
    model.train(was_training)
    return total


def cosine_schedule(optimizer, total_steps: int, warmup_steps: int, min_lr_ratio: float):
    """Linear warmup from lr/warmup to lr, then cosine decay to ``min_lr_ratio * lr`` at ``total_steps``."""

    def factor(step: int) -> float:  # step = optimizer steps taken so far
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def step_rows(step: int, n_rows: int, rows_per_step: int, seed: int) -> torch.Tensor:
    """Row indices of optimizer step ``step`` (data position = step; see the module docstring)."""
    steps_per_epoch = n_rows // rows_per_step
    epoch, index = divmod(step, steps_per_epoch)
    perm = torch.randperm(n_rows, generator=torch.Generator().manual_seed(seed + epoch))
    return perm[index * rows_per_step:(index + 1) * rows_per_step]


# ---------------------------------------------------------------------------------------------------------------
# The run


class Aborted(KeyboardInterrupt):
    """A second Ctrl-C or SIGTERM: stop at once (``signum`` gives the CLI its exit status, 128 + signum)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class _SignalHandlers:
    """Context manager installing ``_handle`` for ``SIGNALS`` (only the main thread can) and putting the previous
    handlers back on exit (SIG_DFL for one installed from C, which Python cannot reinstall)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __enter__(self):
        self.previous = {}
        if threading.current_thread() is threading.main_thread():
            self.previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}
        return self

    def _handle(self, signum, frame):
        raise NotImplementedError

    def __exit__(self, *exc):
        for sig, previous in self.previous.items():
            signal.signal(sig, signal.SIG_DFL if previous is None else previous)
        return False


class _GracefulInterrupt(_SignalHandlers):
    """First Ctrl-C or SIGTERM (``docker stop``, a scheduler's preemption): finish the current step, save a
    checkpoint, stop. A second one: abort at once."""

    def __enter__(self):
        self.requested = False
        self.signum = None  # the first signal, for the exit status (128 + signum, as a shell reports it)
        return super().__enter__()

    def _handle(self, signum, frame):
        if self.requested:
            raise Aborted(signum)
        self.requested, self.signum = True, signum
        _say(f"leantune: {signal.Signals(signum).name}: finishing the current step (or the final eval) and saving "
             "(again to abort)")


class _TerminateAborts(_SignalHandlers):
    """SIGTERM raises :class:`Aborted` (as Ctrl-C raises KeyboardInterrupt) while a command writes files, so that its
    cleanup runs (a replaced run put back, a half-written export removed) instead of the process dying mid-write."""

    SIGNALS = (signal.SIGTERM,)

    def _handle(self, signum, frame):
        raise Aborted(signum)


class _SignalsDeferred(_SignalHandlers):
    """Ctrl-C and SIGTERM only noted (not acted on) while a cleanup moves files back, so that a second signal cannot
    cut the cleanup itself short. Handlers, not a signal mask: Python runs handlers in the main thread whichever
    thread the kernel delivers to (torch keeps worker threads, which a mask of the main thread does not cover). The
    cleanups this guards run while an abort is already under way, so a noted signal changes nothing after them."""

    def __enter__(self):
        self.noted = []
        return super().__enter__()

    def _handle(self, signum, frame):
        self.noted.append(signum)


@dataclass
class RunResult:
    """What ``train`` returns: the summary dict, whether it stopped early (and on which signal), and the output
    directory."""

    summary: dict
    interrupted: bool = False
    stop_signal: int | None = None  # signal.SIGINT or signal.SIGTERM when interrupted
    output: Path = field(default_factory=Path)
    model: object = None  # the trained PeftModel (for callers in the same process, e.g. tests)


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


def _replaced_runs(output: Path) -> list[Path]:
    """The ``.replaced-*`` folders of ``output`` that hold a run leantune moved aside (a user's folder of that name,
    without a leantune run.json, is the user's)."""
    return [p for p in output.glob(REPLACED + "*") if p.is_dir() and read_run_info(p) is not None]


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


def _acquire_lock(output: Path) -> None:
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


def _release_lock(output: Path) -> None:
    try:
        if (output / LOCK).read_text().strip() == str(os.getpid()):
            (output / LOCK).unlink()
    except OSError:
        pass


def check_resume(config: TrainConfig, output: Path, model_path: Path, data_path: Path) -> dict:
    """The run being resumed (its run.json) when ``config`` keeps every ``RESUME_FIXED`` setting; else a
    LeantuneError naming the first that differs. Checked before the model is loaded or anything is written."""
    info = read_run_info(output)
    if info is None:
        raise LeantuneError(f"--resume: {output / 'run.json'} is missing or not a leantune run's; cannot check that "
                            "this run continues it")
    before, now = info["config"], config.to_dict()
    for name in RESUME_FIXED:
        old, new = before.get(name), now.get(name)
        if name in ("model", "data"):  # the files, however they were spelled (relative, absolute, ..)
            old, new = info.get(f"{name}_path"), str((model_path if name == "model" else data_path).resolve())
            same = old is not None and Path(old).resolve() == Path(new)
        else:
            same = old == new
        if not same:
            flag = "--" + name.replace("_", "-")
            relative = name in ("model", "data") and old is not None and not Path(old).is_absolute()
            hint = ("; run.json of an older leantune holds it relative to where that run started: resume from there"
                    if relative else "")
            raise LeantuneError(f"--resume: {flag} {new} differs from the run being resumed ({old}, in "
                                f"{output / 'run.json'}{hint}); resume with the run's settings or start a new --output")
    return info


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
            raise LeantuneError(f"nothing to resume: no checkpoint in {output}")
        return found
    if not output.is_dir():
        return None
    if holds_run(output):
        if not config.overwrite:
            raise LeantuneError(f"output dir {output} already holds a run; pass --overwrite to replace it or "
                                "--resume to continue it")
        return None
    ours = {p.name for p in _replaced_runs(output)} | {LOCK}
    entries = {p.name for p in output.iterdir()} - ours
    if "run.json" in entries and entries <= set(RUN_FILES) and read_run_info(output) is not None:
        return None  # an incomplete run of ours
    if entries and not config.overwrite:
        raise LeantuneError(f"output dir {output} is not empty and holds no leantune run; choose another --output "
                            "or pass --overwrite to write the run next to its files (they are kept)")
    clashes = sorted(entries & set(RUN_FILES))
    if clashes:
        raise LeantuneError(f"output dir {output} holds files that are not from a leantune run but have the names "
                            f"of its outputs ({', '.join(clashes)}); choose another --output")
    return None


def _loss_text(loss: float | None) -> str:
    return f"{loss:.4f}" if loss is not None and math.isfinite(loss) else "non-finite"


def _peak_memory_gib(device: str) -> float:
    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB; process peak RSS


def train(config: TrainConfig, *, progress: bool = True, on_step=None) -> RunResult:
    """Run ``leantune train`` with ``config`` (already validated); see the module docstring.

    ``on_step(step)`` is called after each optimizer step (tests use it to simulate Ctrl-C). Raises LeantuneError
    for every user error before anything in ``config.output`` is written or removed. While it writes there, the
    folder holds a lock file with this process's pid: a second run into it is refused.
    """
    replaced: list = []  # (the .replaced-* folder, the names of the previous run) once this run starts moving it
    output = Path(config.output)
    try:
        with _TerminateAborts():
            try:
                return _train(config, progress, on_step, replaced)
            except BaseException:
                with _SignalsDeferred():
                    if replaced and not _new_run_has_checkpoint(output, *replaced[0]):
                        _put_back(output, *replaced[0])
                raise
    finally:
        _release_lock(output)


def _remove(path: Path) -> None:
    """Delete a file or a folder tree if it exists (a symlink is removed, never followed)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)  # best effort: a cleanup must not mask the error that called it
    else:
        path.unlink(missing_ok=True)


def _new_run_has_checkpoint(output: Path, kept: Path, previous: list[str]) -> bool:
    """Whether ``output``'s checkpoints are the new run's (the previous run's may not have been moved aside yet)."""
    if checkpoint.CHECKPOINTS in previous and not (kept / checkpoint.CHECKPOINTS).exists():
        return False
    return checkpoint.latest_checkpoint(output) is not None


def _put_back(output: Path, kept: Path, previous: list[str]) -> None:
    """Undo the move of a replaced run: the new run failed or was stopped before its first checkpoint, so it left
    nothing to resume, and the run it was replacing (``previous``: its file names, some perhaps not moved yet when
    the stop came) is the folder's run again."""
    for name in RUN_FILES:
        new, old = output / name, kept / name
        if name in previous and not old.exists():  # never moved: it is still the previous run's own file
            continue
        _remove(new)  # the new run's
        if old.exists():
            os.replace(old, new)
    shutil.rmtree(kept, ignore_errors=True)
    _say(f"leantune: the run this one was replacing is back in {output}")


def _train(config: TrainConfig, progress: bool, on_step, replaced: list[Path]) -> RunResult:
    output = Path(config.output)
    resume_from = check_output(config)
    device = config.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise LeantuneError("--device cuda: no CUDA device is available")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32

    kind, model_path = resolve_model(config.model)
    tokenizer = load_tokenizer(kind, model_path)
    data_path = Path(config.data) if config.data else chitchat_path()
    if resume_from is not None:
        check_resume(config, output, model_path, data_path)
    train_data, eval_data, data_info = load_dataset(data_path, tokenizer, config.seq_len, config.eval_size,
                                                    config.seed, config.max_examples)
    rows_per_step = config.batch_size * config.grad_accum
    steps_per_epoch = len(train_data) // rows_per_step
    if steps_per_epoch == 0:
        raise LeantuneError(f"the training split has {len(train_data)} sequences of {config.seq_len} tokens, fewer "
                            f"than one step's --batch-size x --grad-accum = {rows_per_step}")
    total_steps = config.max_steps or max(1, math.ceil(config.epochs * steps_per_epoch))
    warmup = config.warmup_steps if config.warmup_steps is not None else max(1, round(0.05 * total_steps))
    if resume_from is not None:
        saved_step = checkpoint.checkpoint_step(resume_from)
        if saved_step > total_steps:
            raise LeantuneError(f"--resume: the checkpoint {resume_from.name} is at step {saved_step}, past this run's "
                                f"{total_steps} steps (--max-steps / --epochs); ask for at least {saved_step}")
    model = load_model(kind, model_path, dtype, device, config.seed)
    if len(tokenizer) > model.get_input_embeddings().num_embeddings:
        raise LeantuneError(f"the tokenizer has {len(tokenizer)} tokens but the model's vocabulary only "
                            f"{model.get_input_embeddings().num_embeddings}")
    context = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    if isinstance(context, int) and config.seq_len > context:
        _say(f"leantune: warning: --seq-len {config.seq_len} is longer than the model's context "
             f"(max_position_embeddings = {context}); positions beyond it were never trained")
    model = wrap_lora(model, config)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay,
                                  fused=device == "cuda")
    scheduler = cosine_schedule(optimizer, total_steps, warmup, config.min_lr_ratio)

    # Everything the user could get wrong has been checked: from here on the output dir is ours. A fresh run
    # clears leantune's own files (check_output allowed it: --overwrite or an incomplete run), never others.
    output.mkdir(parents=True, exist_ok=True)
    _acquire_lock(output)
    if resume_from is None:
        check_output(config)  # another run may have finished here while this one loaded: decide again, locked
        # the files of the run being replaced are kept aside until this run finishes
        previous = [name for name in RUN_FILES if (output / name).exists()]
        if previous:
            kept = output / f"{REPLACED}{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}"
            replaced.append((kept, previous))  # before the folder and the first move: a stop at any point is undone
            kept.mkdir()
            for name in previous:
                os.replace(output / name, kept / name)
            _say(f"leantune: the run being replaced is kept in {kept} until this run finishes")
    for partial in (output / checkpoint.CHECKPOINTS).glob(".tmp-*"):  # a save cut short by a kill
        shutil.rmtree(partial, ignore_errors=True)
    if data_info["truncated"]:
        _say(f"leantune: warning: {data_info['truncated']} of {data_info['examples']} examples were longer "
                   f"than --seq-len {config.seq_len} and were truncated")
    # absolute paths: export and --resume may run from another working directory
    run_info = {"tool": "leantune", "config": config.to_dict(), "model_kind": kind,
                "model_path": str(model_path.resolve()), "data_path": str(data_path.resolve()), "data": data_info,
                "device": device, "dtype": str(dtype), "total_steps": total_steps, "warmup_steps": warmup}
    (output / "run.json").write_text(to_json(run_info, indent=2))

    start_step = 0
    metrics = MetricsLog(output / "metrics.jsonl")
    if resume_from is not None:
        state = checkpoint.load_checkpoint(resume_from, model, optimizer, scheduler)
        start_step = state["step"]
        metrics.truncate(state["metrics_lines"])
        _say(f"leantune: resuming from {resume_from} (step {start_step} of {total_steps})")
    else:
        metrics.reset()
        torch.manual_seed(config.seed)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()

    if start_step == 0:
        metrics.log({"type": "eval", "step": 0, "eval_loss": evaluate(model, eval_data, config.batch_size, device)})
    train_tokens, train_seconds, interrupted, diverged = 0, 0.0, False, False
    bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step", disable=not progress,
               dynamic_ncols=True)
    with _GracefulInterrupt() as interrupt:
        for step in range(start_step, total_steps):
            t0 = time.perf_counter()
            rows = step_rows(step, len(train_data), rows_per_step, config.seed)
            micro_batches = [train_data.select(rows[k * config.batch_size:(k + 1) * config.batch_size])
                             for k in range(config.grad_accum)]
            loss = accumulate_gradients(model, micro_batches, device)
            grad_norm = (torch.nn.utils.clip_grad_norm_(params, config.max_grad_norm).item()
                         if config.max_grad_norm > 0 else float("nan"))
            lr = scheduler.get_last_lr()[0]
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            if device == "cuda":
                torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
            tokens = sum(b.input_ids.numel() for b in micro_batches)
            train_tokens += tokens
            train_seconds += seconds
            done = step + 1
            metrics.log({"type": "train", "step": done, "loss": loss, "lr": lr, "grad_norm": grad_norm,
                         "tokens": tokens, "tokens_per_s": tokens / seconds})
            if not math.isfinite(loss) and not diverged:
                diverged = True
                _say(f"leantune: warning: the training loss became non-finite ({loss}) at step {done}; the run "
                     "diverged (try a lower --lr or --max-grad-norm); metrics record it as null")
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", tok_s=f"{tokens / seconds:.0f}")
            if config.eval_every and done % config.eval_every == 0 and done < total_steps:
                eval_loss = evaluate(model, eval_data, config.batch_size, device)
                metrics.log({"type": "eval", "step": done, "eval_loss": eval_loss})
                _say(f"step {done}: eval loss {eval_loss:.4f}")
            if on_step is not None:
                on_step(done)
            if interrupt.requested:
                checkpoint.save_checkpoint(output, done, model, optimizer, scheduler, metrics.lines)
                interrupted = True
                break
            if config.save_every and done % config.save_every == 0 and done < total_steps:
                checkpoint.save_checkpoint(output, done, model, optimizer, scheduler, metrics.lines)
    bar.close()
    if interrupted:
        _say(f"leantune: stopped at step {done}; checkpoint saved in {output / checkpoint.CHECKPOINTS}; "
                   "continue with --resume")
        return RunResult({"steps": done}, interrupted=True, stop_signal=interrupt.signum, output=output,
                         model=model)

    # the last step saved before the final eval (a kill during it loses no step); a first Ctrl-C / SIGTERM from here
    # on lets the run finish its eval and files, a second aborts
    with _GracefulInterrupt():
        checkpoint.save_checkpoint(output, total_steps, model, optimizer, scheduler, metrics.lines)
        final_eval = evaluate(model, eval_data, config.batch_size, device)
        metrics.log({"type": "eval", "step": total_steps, "eval_loss": final_eval})
        model.save_pretrained(output / "adapter", save_embedding_layers=False)
        tokenizer.save_pretrained(output / "tokenizer")
    records = metrics.read()
    evals = [r for r in records if r["type"] == "eval"]
    summary = {
        "steps": total_steps,
        "initial_eval_loss": evals[0]["eval_loss"],
        "final_eval_loss": final_eval,
        "tokens_per_s": train_tokens / train_seconds if train_seconds else None,
        "peak_memory_gib": _peak_memory_gib(device),
        "peak_memory_kind": "torch.cuda.max_memory_allocated" if device == "cuda" else "process peak RSS",
        "train_tokens_this_session": train_tokens,
        "train_seconds_this_session": train_seconds,
        "device": device,
        "dtype": str(dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "patched": getattr(model, "_leantune_patched", False),
        "model": str(model_path),
        "data": str(data_path),
        **{k: data_info[k] for k in ("train_rows", "eval_rows", "truncated")},
    }
    (output / "summary.json").write_text(to_json(summary, indent=2))
    # this run finished: the run it replaced is no longer needed. Older kept runs go only when this run was asked to
    # replace or continue (a fresh run into a crashed run's folder never deletes what that run had kept aside).
    for kept in _replaced_runs(output) if config.overwrite or resume_from is not None else [k for k, _ in replaced]:
        shutil.rmtree(kept, ignore_errors=True)
    plot_losses(records, output / "loss.png")
    if not math.isfinite(final_eval):
        _say(f"leantune: warning: the final eval loss is non-finite ({final_eval}); summary.json records null")
    print(f"leantune: eval loss {_loss_text(evals[0]['eval_loss'])} -> {_loss_text(final_eval)} after "
          f"{total_steps} step{'s' if total_steps != 1 else ''}; wrote {output}")
    return RunResult(summary, output=output, model=model)


# ---------------------------------------------------------------------------------------------------------------
# Export


EXPORT_MARKER = "leantune_export.json"


def _check_export_target(target: Path, overwrite: bool, base_model: Path) -> None:
    """Refuse a file, the run's base model, a non-empty folder without ``overwrite``, and with it any folder that is
    not a leantune export (one holding the marker file: a model folder of save_pretrained's files is not one)."""
    existing = nearest_existing(target)
    if not existing.is_dir():
        raise LeantuneError(f"export target {target}: {existing} exists and is not a directory")
    base = base_model.resolve()
    if target.resolve() in (base, base.parent if base.is_file() else base):
        raise LeantuneError(f"export target {target} is the run's base model; choose another --out")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise LeantuneError(f"export target {target}: cannot write in {existing}")
    if not target.is_dir() or not any(target.iterdir()):
        return
    if not overwrite:
        raise LeantuneError(f"export target {target} is not empty; pass --overwrite to replace a previous export")
    if not (target / EXPORT_MARKER).is_file():
        raise LeantuneError(f"export target {target} holds files that are not a leantune export (no "
                            f"{EXPORT_MARKER}); --overwrite only replaces a previous export: choose another --out")


def _checkpoint_dtype(kind: str, path: Path) -> torch.dtype | None:
    """The dtype of a Hugging Face folder's floating-point safetensors weights when it is 16-bit (an export is
    written in it, as the base was stored), else None: fp32, .bin weights, a GGUF or a random init (fp32)."""
    from safetensors import SafetensorError, safe_open

    if kind != "hf":
        return None
    index = path / "model.safetensors.index.json"
    try:
        if index.is_file():
            first = sorted(set(json.loads(index.read_text())["weight_map"].values()))[0]
            weights = path / first
        else:
            weights = path / "model.safetensors"
        if not weights.is_file():
            return None
        with safe_open(str(weights), framework="pt") as fh:
            dtypes = {fh.get_slice(key).get_dtype() for key in fh.keys()}
    except (OSError, ValueError, KeyError, IndexError, SafetensorError):  # unreadable here: write fp32
        return None
    floats = dtypes & {"F32", "F16", "BF16", "F64"}
    return {frozenset({"BF16"}): torch.bfloat16, frozenset({"F16"}): torch.float16}.get(frozenset(floats))


def _untie_embeddings(peft_model) -> None:
    """Give the output projection its own copy of a weight it shares with the input embeddings when a LoRA sits on
    either of them, so that merging changes only the adapted one (merged into the shared matrix, an lm_head adapter
    would change the input embeddings too, and an embed_tokens adapter the output logits). The merged model's
    config then says the embeddings are not tied."""
    model = peft_model.get_base_model()
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    if head is None or embed is None:
        return
    head_owner, embed_owner = getattr(head, "base_layer", head), getattr(embed, "base_layer", embed)
    adapted = head_owner is not head or embed_owner is not embed
    if not adapted or head_owner.weight is not embed_owner.weight:
        return
    head_owner.weight = torch.nn.Parameter(embed_owner.weight.detach().clone(), requires_grad=False)
    for config in {id(c): c for c in (model.config, model.config.get_text_config())}.values():
        config.tie_word_embeddings = False


def export(adapter: str, out: str, *, overwrite: bool = False) -> Path:
    """Merge a trained adapter into its base model and save a standalone HF folder (model + tokenizer).

    ``adapter`` is a run directory (holding ``run.json`` and ``adapter/``) or its ``adapter/`` folder. The base is
    rebuilt exactly as training loaded it (a config.json base re-initialised with the run's seed) and merged in fp32;
    the weights are stored in the dtype of the base folder's safetensors weights when that is 16-bit (else fp32). A
    LoRA on lm_head or embed_tokens of tied embeddings is merged into an untied copy. The folder is written next to
    ``out`` and moved into place, with a marker file ``leantune_export.json``; a failure, Ctrl-C or SIGTERM leaves
    no partial folder and the previous export in place. Raises LeantuneError for a missing adapter, an ``out`` that
    is a file or the base model, or an ``out`` that is not empty (without ``overwrite``; with it, only a previous
    export is replaced, never a folder of other files).
    """
    with _TerminateAborts():
        return _export(adapter, out, overwrite)


def _export(adapter: str, out: str, overwrite: bool) -> Path:
    from peft import PeftModel

    src = Path(adapter)
    run_dir = src if (src / "run.json").is_file() else src.parent
    adapter_dir = src / "adapter" if (src / "adapter").is_dir() else src
    if not (adapter_dir / "adapter_config.json").is_file():
        raise LeantuneError(f"no adapter in {adapter}: expected a run directory or its adapter/ folder")
    if not (run_dir / "run.json").is_file():
        raise LeantuneError(f"no run.json next to {adapter_dir}: export needs the run directory that made it")
    if not str(out).strip():
        raise LeantuneError("--out must name a folder, got an empty path")
    # absolute and normalised: "." has no name to put a temporary folder beside, and "missing/../folder" must be
    # checked as the folder it names
    target = Path(os.path.abspath(out))
    if target.is_symlink():  # replace the folder it points to, not the link
        target = target.resolve()
    run = json.loads((run_dir / "run.json").read_text())
    kind, model_path = run["model_kind"], Path(run["model_path"])
    _check_export_target(target, overwrite, model_path)
    if not model_path.exists():
        raise LeantuneError(f"the base model of this run is gone: {model_path}")
    tokenizer_dir = run_dir / "tokenizer"
    tokenizer = (load_tokenizer("hf", tokenizer_dir) if tokenizer_dir.is_dir()
                 else load_tokenizer(kind, model_path))
    base = load_model(kind, model_path, torch.float32, "cpu", run["config"]["seed"])
    peft_model = PeftModel.from_pretrained(base, adapter_dir)
    _untie_embeddings(peft_model)
    merged = peft_model.merge_and_unload()  # in fp32, then stored in the base checkpoint's own 16-bit dtype
    saved_dtype = _checkpoint_dtype(kind, model_path) or torch.float32
    merged = merged.to(saved_dtype)
    merged.config.dtype = saved_dtype  # config.json says what the weights are (the base's may say otherwise)
    marker = {"adapter": str(adapter_dir.resolve()), "base_model": str(model_path)}
    _check_export_target(target, overwrite, model_path)  # again: the folder may have changed while merging
    if target.is_dir() and not any(target.iterdir()):
        _write_into_empty(target, merged, tokenizer, marker)
    else:
        _write_beside(target, merged, tokenizer, marker)
    return target


def _save_export(folder: Path, merged, tokenizer, marker: dict) -> None:
    merged.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (folder / EXPORT_MARKER).write_text(json.dumps(marker, indent=2))


def _export_error(target: Path, exc: BaseException) -> None:
    """A write failure (full disk, permissions) as one error line; anything else (Ctrl-C, SIGTERM) as it is."""
    from safetensors import SafetensorError

    if isinstance(exc, (OSError, SafetensorError)):
        raise LeantuneError(f"cannot write the export to {target}: {getattr(exc, 'strerror', None) or exc}") \
            from None


def _write_beside(target: Path, merged, tokenizer, marker: dict) -> None:
    """Write next to ``target`` and rename into place; a previous export is set aside until then and put back on any
    failure or stop. The hidden folders' names are fixed before they exist, so a stop at any point is cleaned up."""
    token = uuid.uuid4().hex[:8]
    tmp, old = (target.with_name(f".{target.name}.{kind}-{token}") for kind in ("tmp", "old"))
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
        _save_export(tmp, merged, tokenizer, marker)
        if target.exists():
            os.replace(target, old)
        os.replace(tmp, target)
    except BaseException as exc:
        with _SignalsDeferred():
            if old.exists() and not target.exists():
                os.replace(old, target)  # the previous export first: the rest is only tidying up
            shutil.rmtree(tmp, ignore_errors=True)
        _export_error(target, exc)
        raise
    with _SignalsDeferred():  # done: a Ctrl-C now must not leave a full copy of the old model behind
        shutil.rmtree(old, ignore_errors=True)


def _write_into_empty(target: Path, merged, tokenizer, marker: dict) -> None:
    """An existing empty folder keeps its identity (it may be the shell's working directory or a mount point):
    write into a hidden folder inside it, then move the files up; on failure remove only what this export made."""
    tmp = target / f".leantune-export-{uuid.uuid4().hex[:8]}"
    names: list[str] = []
    try:
        tmp.mkdir()
        _save_export(tmp, merged, tokenizer, marker)
        names = sorted(os.listdir(tmp))  # the folder was empty: each of these names in it is this export's
        for name in names:
            os.replace(tmp / name, target / name)
        tmp.rmdir()
    except BaseException as exc:
        with _SignalsDeferred():
            for path in (*(target / name for name in names), tmp):
                _remove(path)
        _export_error(target, exc)
        raise
