"""``leantune export``: merge a run's adapter into its base model and write a standalone Hugging Face folder.

(Named ``merge`` rather than ``export`` so that the module never shadows, or is shadowed by, the function
``leantune.train.export``.)

``--format gguf`` writes one .gguf file instead (``gguf_export``: Llama architecture, f16/bf16/q8_0/f32), under the
same rules: a temporary file renamed into place, and ``--overwrite`` replaces only a previous GGUF export.

The base is rebuilt exactly as training loaded it (a config.json base re-initialised with the run's seed; a
``--quantize nf4`` / ``fp8`` run's base quantised and dequantised, an FP8 checkpoint's from its requantised codes)
and merged in fp32; the weights are stored in the dtype of the base folder's safetensors weights when that is
16-bit (an FP8 checkpoint: of its unquantised tensors; else fp32). A run stopped before it wrote its adapter is
exported from its last checkpoint (said in one line). The folder is written beside ``--out`` and moved into place,
with a marker file; a failure, Ctrl-C or SIGTERM leaves no partial folder and the previous export in place, and
``--overwrite`` replaces only a previous export.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

import torch

from ..errors import LeantuneError
from . import checkpoint
from .config import TrainConfig
from .metrics import one_line, say
from .model import load_model, load_tokenizer, lora_config
from .run_folder import kept_run_hint, model_changes, model_fingerprint, nearest_existing, read_run_info, remove
from .signals import SignalsDeferred, TerminateAborts

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
    written in it, as the base was stored; for an FP8 checkpoint that of its unquantised tensors, the compute
    dtype), else None: fp32, .bin weights, a GGUF or a random init (fp32)."""
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
        with safe_open(str(weights), framework="pt") as fh:  # an FP8 checkpoint's fp32 block scales aside
            dtypes = {fh.get_slice(key).get_dtype() for key in fh.keys() if not key.endswith("_scale_inv")}
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


def _dequantised_base(model, trained_dtype: torch.dtype, quant_type: str = "nf4") -> None:
    """Every weight ``leantune.quantize`` puts in NF4 / FP8 replaced, in place, by its quantised value (quantised
    from the dtype the run trained in, dequantised in fp32): a QLoRA / FP8 run's export is the dequantised base
    plus the adapter. An FP8 checkpoint's layers (``FP8Linear`` from the loader, the codes training used) become
    ``nn.Linear`` layers of their fp32 dequantisation, so PEFT merges into them. NF4 with FP8 compute: the e4m3
    codes its GEMMs read, dequantised. MoE expert stacks are NF4 in an NF4 or NF4-FP8 run (FP8 keeps them in the
    compute dtype)."""
    from ..ops import dequantize_fp8, dequantize_nf4, dequantize_nf4_fp8, quantize_fp8, quantize_nf4, with_fp8_compute
    from ..quantize import EXPERT_STACKS, dequantize, expert_stacks, quantized_linears

    with torch.no_grad():
        for name, linear in quantized_linears(model):
            if quant_type == "fp8":
                fp8 = quantize_fp8(linear.weight.to(trained_dtype), name=name)
                linear.weight.copy_(dequantize_fp8(fp8, torch.float32))
            elif quant_type == "nf4-fp8":
                nf4 = with_fp8_compute(quantize_nf4(linear.weight.to(trained_dtype), name=name))
                linear.weight.copy_(dequantize_fp8(dequantize_nf4_fp8(nf4), torch.float32))
            else:
                nf4 = quantize_nf4(linear.weight.to(trained_dtype), name=name)
                linear.weight.copy_(dequantize_nf4(nf4, dtype=torch.float32))
        for name, module in model.named_modules():  # MoE expert stacks, one 3-D NF4 weight each (leantune.quantize)
            if quant_type in ("nf4", "nf4-fp8") and expert_stacks(module):
                for stack in EXPERT_STACKS:
                    weight = getattr(module, stack)
                    nf4 = quantize_nf4(weight.to(trained_dtype), name=f"{name}.{stack}")
                    weight.copy_(dequantize_nf4(nf4, dtype=torch.float32))
    dequantize(model, dtype=torch.float32)  # an FP8 checkpoint's layers: the codes training used, in fp32


def export(adapter: str, out: str, *, overwrite: bool = False, format: str = "hf", dtype: str | None = None) -> Path:
    """Merge a trained adapter into its base model and save a standalone HF folder (model + tokenizer), or with
    ``format="gguf"`` one GGUF file (``leantune.train.gguf_export``: Llama architecture, ``out`` ends in .gguf).

    ``adapter`` is a run directory (holding ``run.json`` and ``adapter/``) or its ``adapter/`` folder; a run
    directory without ``adapter/`` (stopped by Ctrl-C or SIGTERM) is exported from its last checkpoint. See the
    module docstring for how the base is rebuilt, the stored dtype, tied embeddings and the atomic write. Raises
    LeantuneError for a missing adapter (or a run stopped before its first checkpoint), an ``out`` that is a file or
    the base model, or an ``out`` that is not empty (without ``overwrite``; with it, only a previous export is
    replaced, never a folder of other files; for GGUF, only a previous GGUF export). ``dtype``: the stored
    tensors, ``f16``/``bf16``/``f32`` (both formats) or ``q8_0`` (GGUF); default: the base checkpoint's 16-bit
    dtype, else fp32 for hf and f16 for GGUF. Bad ``format``/``dtype`` raise LeantuneError naming the option.
    """
    if format not in ("hf", "gguf"):
        raise LeantuneError(f"--format must be hf or gguf, got {format!r}")
    if format == "hf" and str(out).lower().endswith(".gguf"):  # a folder named x.gguf is not what was meant
        raise LeantuneError(f"--out {out} ends in .gguf but --format is hf (a Hugging Face folder): use --format "
                            "gguf, or a folder name")
    from .gguf_export import GGUF_DTYPES

    allowed = GGUF_DTYPES if format == "gguf" else ("f16", "bf16", "f32")
    if dtype is not None and dtype not in allowed:
        raise LeantuneError(f"--dtype must be one of {', '.join(allowed)} for --format {format}, got {dtype!r}")
    with TerminateAborts():
        return _export(adapter, out, overwrite, format, dtype)


def _adapter_source(src: Path) -> tuple[Path, Path, Path | None]:
    """``(run folder, adapter folder, checkpoint)`` of ``--adapter``: the checkpoint is set (and the adapter folder
    absent) for a run that stopped before writing its adapter, or for a checkpoint folder named as ``--adapter``
    (``RUN/checkpoints/step-N``: an earlier checkpoint, or the last good one of a diverged run)."""
    if src.parent.name == checkpoint.CHECKPOINTS and src.name.startswith("step-") and src.is_dir():
        if read_run_info(src.parent.parent) is None:
            raise LeantuneError(f"no leantune run.json in {src.parent.parent}: export needs the run of {src}")
        checkpoint.checkpoint_step(src, export=True)  # a damaged state.json: one error line
        return src.parent.parent, src / "adapter", src
    run_dir = src if (src / "run.json").is_file() else src.parent
    adapter_dir = src / "adapter" if (src / "adapter").is_dir() else src
    if (adapter_dir / "adapter_config.json").is_file():
        if not (run_dir / "run.json").is_file():
            raise LeantuneError(f"no run.json next to {adapter_dir}: export needs the run directory that made it")
        return run_dir, adapter_dir, None
    info = read_run_info(src)
    if info is None:
        raise LeantuneError(f"no adapter in {src}: expected a run directory or its adapter/ folder")
    found = checkpoint.latest_checkpoint(src)
    if found is None:
        raise LeantuneError(f"no adapter in {src}: the run was stopped before its first checkpoint, so there is "
                            f"nothing to export; run it again{kept_run_hint(src)}")
    step = checkpoint.checkpoint_step(found, export=True)
    say(f"leantune: the run in {src} was stopped at step {step} of {info.get('total_steps', '?')} before writing "
        f"its adapter; exporting its last checkpoint (step {step}); 'leantune train --resume' with the run's "
        "settings continues it")
    return run_dir, src / "adapter", found


def _check_adapter_file(run_dir: Path, adapter_dir: Path) -> None:
    """A damaged ``adapter_model.safetensors`` of the adapter folder as one error line that names the run's
    checkpoints, which hold the same tensors (the last one is the finished adapter)."""
    from safetensors.torch import load_file

    file = adapter_dir / "adapter_model.safetensors"
    try:
        load_file(str(file))
    except Exception as exc:  # safetensors' own error kinds, or OSError
        kept = checkpoint.checkpoints(run_dir)
        todo = (f"export a checkpoint with --adapter {kept[-1]} (kept: {', '.join(p.name for p in kept)})" if kept
                else "no checkpoint of the run is kept to export instead; train it again")
        raise LeantuneError(f"adapter file {file} is truncated or corrupt ({one_line(exc)[:200]}); {todo}; nothing "
                            "was deleted") from None


_TORCH_DTYPES = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}


def _check_target(target: Path, overwrite: bool, base_model: Path, format: str) -> None:
    if format == "gguf":
        from .gguf_export import check_gguf_target

        check_gguf_target(target, overwrite, base_model)
    else:
        _check_export_target(target, overwrite, base_model)


def merged_run(adapter: str):
    """``(merged model in fp32 on the CPU, tokenizer)`` of a run directory or its ``adapter/`` folder (a stopped
    run: its last checkpoint), as ``export`` merges it; ``leantune chat --adapter`` talks to it."""
    run_dir, adapter_dir, saved = _adapter_source(Path(adapter))
    return _merged_model(run_dir, adapter_dir, saved, _run_info(run_dir))


def _run_info(run_dir: Path) -> dict:
    run = read_run_info(run_dir)
    if run is None:
        raise LeantuneError(f"{run_dir / 'run.json'} is damaged or not a leantune run's: export needs it to rebuild "
                            "the base model")
    return run


def _merged_model(run_dir: Path, adapter_dir: Path, saved: Path | None, run: dict):
    from peft import PeftModel, get_peft_model, set_peft_model_state_dict

    kind, model_path = run["model_kind"], Path(run["model_path"])
    if not model_path.exists():
        raise LeantuneError(f"the base model of this run is gone: {model_path}")
    changed = model_changes(run.get("model_fingerprint"), model_fingerprint(model_path))
    if changed:  # the adapter merged into another base would be another model, silently
        raise LeantuneError(f"the base model of this run changed since it trained: {model_path} "
                            f"({', '.join(changed)} differ); restore the weights it trained on to export it")
    tokenizer_dir = run_dir / "tokenizer"
    tokenizer = (load_tokenizer("hf", tokenizer_dir) if tokenizer_dir.is_dir()
                 else load_tokenizer(kind, model_path))
    base = load_model(kind, model_path, torch.float32, "cpu", run["config"]["seed"])
    if run["config"].get("quantize") in ("nf4", "fp8", "nf4-fp8"):  # the adapter learnt on that base: merge into it
        _dequantised_base(base, getattr(torch, run["dtype"].removeprefix("torch.")), run["config"]["quantize"])
    if saved is None:
        _check_adapter_file(run_dir, adapter_dir)
        peft_model = PeftModel.from_pretrained(base, adapter_dir)
    else:  # a checkpoint holds the adapter's tensors; its shape and targets are the run's settings
        stored = checkpoint.read_adapter(saved, export=True)
        peft_model = get_peft_model(base, lora_config(base, TrainConfig(**run["config"])))
        set_peft_model_state_dict(peft_model, stored)
    _untie_embeddings(peft_model)
    return peft_model.merge_and_unload(), tokenizer  # in fp32; export stores it in the base's own 16-bit dtype


def _export(adapter: str, out: str, overwrite: bool, format: str = "hf", dtype: str | None = None) -> Path:
    run_dir, adapter_dir, saved = _adapter_source(Path(adapter))
    if not str(out).strip():
        raise LeantuneError("--out must name a folder (a .gguf file for --format gguf), got an empty path")
    # absolute and normalised: "." has no name to put a temporary folder beside, and "missing/../folder" must be
    # checked as the folder it names
    target = Path(os.path.abspath(out))
    if target.is_symlink():  # replace the folder it points to, not the link
        target = target.resolve()
    run = _run_info(run_dir)
    kind, model_path = run["model_kind"], Path(run["model_path"])
    _check_target(target, overwrite, model_path, format)
    merged, tokenizer = _merged_model(run_dir, adapter_dir, saved, run)
    marker = {"adapter": str((saved or adapter_dir).resolve()), "base_model": str(model_path)}
    if format == "gguf":
        from .gguf_export import check_gguf_model, write_gguf_export

        check_gguf_model(merged, tokenizer)
        if dtype is None:
            dtype = {torch.bfloat16: "bf16"}.get(_checkpoint_dtype(kind, model_path), "f16")
        _check_target(target, overwrite, model_path, format)  # again: the file may have changed while merging
        write_gguf_export(target, merged.eval(), tokenizer, dtype, {**marker, "dtype": dtype})
        return target
    saved_dtype = _TORCH_DTYPES[dtype] if dtype else _checkpoint_dtype(kind, model_path) or torch.float32
    merged = merged.to(saved_dtype)
    merged.config.dtype = saved_dtype  # config.json says what the weights are (the base's may say otherwise)
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
        with SignalsDeferred():
            if old.exists() and not target.exists():
                os.replace(old, target)  # the previous export first: the rest is only tidying up
            shutil.rmtree(tmp, ignore_errors=True)
        _export_error(target, exc)
        raise
    with SignalsDeferred():  # done: a Ctrl-C now must not leave a full copy of the old model behind
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
        with SignalsDeferred():
            for path in (*(target / name for name in names), tmp):
                remove(path)
        _export_error(target, exc)
        raise
