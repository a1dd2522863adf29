"""``leantune export --format gguf``: a merged Llama-architecture model written as one GGUF file with the ``gguf``
package (no llama.cpp binaries).

What is written is what transformers' GGUF reader (``transformers/modeling_gguf_pytorch_utils.py`` and
``integrations/ggml.py``, 5.17) and llama.cpp read for the ``llama`` architecture:

- metadata ``general.*`` and ``llama.*`` (context length, widths, layer count, heads, ``rope.freq_base``,
  ``rope.dimension_count`` = head_dim, RMSNorm eps, vocab size);
- tensors named by gguf's own HF-to-GGUF name map (``token_embd``, ``blk.N.attn_q``, ..., ``output_norm``,
  ``output``); ``output.weight`` only when the head is not tied to the embeddings (the reader infers tying from its
  absence). The q and k projections are stored with llama.cpp's rotary row order: within each head, rows
  ``[0, 2, 4, ..., 1, 3, 5, ...]`` of the HF order (HF rotates the two halves of a head, GGML adjacent pairs); the
  reader undoes exactly this;
- the tokenizer as ``tokenizer.ggml.*``: a byte-level BPE (``model = "gpt2"``: tokens in id order, token types,
  merges, bos/eos/unk/pad ids, ``add_bos_token``) and ``tokenizer.chat_template``. Ids the tokenizer does not name
  (an embedding padded past the vocabulary) become ``[PAD<id>]`` tokens of type UNUSED;
- ``leantune.export``: JSON naming the adapter and base, the marker by which ``--overwrite`` knows a previous
  export.

Tensor types (``--dtype``): f32, f16, bf16, or q8_0 (blocks of 32 weights sharing one f16 scale, ``d = max|w| / 127``,
``q = round(w / d)``) for 2-D weights whose rows are a multiple of 32 (others f16). 1-D tensors (the norms) stay
f32, as llama.cpp stores them.

A model outside that reading (another architecture, rope scaling, biases, an activation other than SiLU, a
tokenizer that is not byte-level BPE) is refused with one line naming what differs: the file would load with
different logits.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import numpy as np
import torch

from ..errors import LeantuneError
from .signals import SignalsDeferred

GGUF_DTYPES = ("f16", "bf16", "q8_0", "f32")
MARKER_KEY = "leantune.export"
# set when the tokenizer has no bos token: the bos id written is the eos id's stand-in (see _write_tokenizer)
BOS_STAND_IN_KEY = "leantune.tokenizer.bos_stand_in"
Q8_BLOCK = 32


def check_gguf_target(target: Path, overwrite: bool, base_model: Path) -> None:
    """Refuse a ``--out`` that is not a ``.gguf`` path, a folder, the run's base model, an existing file without
    ``overwrite``, and with it a file that is not a leantune GGUF export (no ``leantune.export`` key)."""
    if target.suffix != ".gguf":
        raise LeantuneError(f"--out {target}: a GGUF export is one file; give a path ending in .gguf")
    if target.is_dir():
        raise LeantuneError(f"export target {target} is a directory; give a file path ending in .gguf")
    probe = target.parent
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    if not probe.is_dir():
        raise LeantuneError(f"export target {target}: {probe} exists and is not a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise LeantuneError(f"export target {target}: cannot write in {probe}")
    if target.exists() and base_model.exists() and os.path.samefile(target, base_model):
        raise LeantuneError(f"export target {target} is the run's base model; choose another --out")
    if not target.exists():
        return
    if not overwrite:
        raise LeantuneError(f"export target {target} exists; pass --overwrite to replace a previous export")
    if not _is_leantune_gguf(target):
        raise LeantuneError(f"export target {target} is not a leantune GGUF export (no {MARKER_KEY} key); "
                            "--overwrite only replaces a previous export: choose another --out")


def _is_leantune_gguf(path: Path) -> bool:
    from gguf import GGUFReader

    try:
        return MARKER_KEY in GGUFReader(path).fields
    except Exception:  # not a GGUF file at all (gguf raises ValueError, struct errors, ...): not ours
        return False


def check_gguf_model(model, tokenizer) -> None:
    """Raise LeantuneError when the merged model or its tokenizer is not what the GGUF ``llama`` reading rebuilds."""
    config = model.config
    differs = []
    if config.model_type != "llama":
        differs.append(f"model type {config.model_type!r} (GGUF export writes the 'llama' architecture)")
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        differs.append(f"rope type {rope.get('rope_type')!r} (the GGUF reading knows no rope scaling)")
    if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
        differs.append("biases on the attention or MLP projections")
    if getattr(config, "hidden_act", "silu") != "silu":
        differs.append(f"activation {config.hidden_act!r} (llama is SiLU)")
    if differs:
        raise LeantuneError(f"cannot export this model as GGUF: {'; '.join(differs)}; use --format hf")
    _byte_level_bpe(tokenizer)


def _byte_level_bpe(tokenizer) -> dict:
    """The tokenizer.json of a byte-level BPE tokenizer, else LeantuneError."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise LeantuneError("cannot export this tokenizer as GGUF: it has no fast (tokenizer.json) form; use "
                            "--format hf")
    spec = json.loads(backend.to_str())
    byte_level = "ByteLevel" in json.dumps(spec.get("pre_tokenizer"))
    if spec["model"]["type"] != "BPE" or not byte_level:
        raise LeantuneError(f"cannot export this tokenizer as GGUF: it is {spec['model']['type']} without a "
                            "byte-level pre-tokenizer (GGUF export writes byte-level BPE, as Llama 3, SmolLM2 and "
                            "Qwen use); use --format hf")
    return spec


def _tokenizer_fields(writer, tokenizer, vocab_size: int) -> None:
    from gguf import TokenType

    spec = _byte_level_bpe(tokenizer)
    vocab = tokenizer.backend_tokenizer.get_vocab(with_added_tokens=True)
    if vocab and max(vocab.values()) >= vocab_size:
        raise LeantuneError(f"cannot export as GGUF: the tokenizer has ids up to {max(vocab.values())}, the "
                            f"model's embedding only {vocab_size} rows")
    added = {tok["content"]: tok["special"] for tok in spec.get("added_tokens", [])}
    tokens, types = [], []
    by_id = {i: t for t, i in vocab.items()}
    for i in range(vocab_size):
        token = by_id.get(i)
        if token is None:
            tokens.append(f"[PAD{i}]")
            types.append(TokenType.UNUSED)
        else:
            tokens.append(token)
            types.append(TokenType.NORMAL if token not in added else
                         TokenType.CONTROL if added[token] else TokenType.USER_DEFINED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"].get("merges") or []]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    if merges:
        writer.add_token_merges(merges)
    else:  # gguf writes no empty array; without merges transformers' reader needs scores (and finds no merges)
        writer.add_token_scores([0.0] * len(tokens))
    ids = {name: getattr(tokenizer, f"{name}_token_id", None) for name in ("bos", "eos", "unk", "pad")}
    probe = tokenizer("a").input_ids
    adds_bos = bool(probe) and ids["bos"] is not None and probe[0] == ids["bos"]
    if ids["bos"] is None:
        # transformers' GGUF tokenizer reading (5.17) looks the bos id up whenever an eos id is given and fails
        # without one; the eos id stands in, never prepended (add_bos_token false, as the tokenizer does), and the
        # marker tells leantune's reading (train.model.load_tokenizer) to drop it: a chat template that emits
        # bos_token would otherwise start with the eos token
        ids["bos"] = ids["eos"]
        writer.add_bool(BOS_STAND_IN_KEY, True)
    for name, add in (("bos", writer.add_bos_token_id), ("eos", writer.add_eos_token_id),
                      ("unk", writer.add_unk_token_id), ("pad", writer.add_pad_token_id)):
        if ids[name] is not None:
            add(int(ids[name]))
    writer.add_add_bos_token(adds_bos)
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str) and template:
        writer.add_chat_template(template)


def _to_llama_cpp_rotary_order(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """HF's rotate-half row order of a q/k projection ``[heads * head_dim, in]`` to GGML's adjacent-pair order:
    within a head, row ``2j`` of the result is HF row ``j`` and row ``2j + 1`` is HF row ``j + head_dim / 2``."""
    rows = weight.shape[0]
    half = rows // heads // 2
    return weight.reshape(heads, 2, half, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def _tensor_data(weight: torch.Tensor, dtype: str):
    """``(array, raw_dtype)`` for GGUFWriter.add_tensor: numpy's own dtype for f32/f16, gguf's quantised bytes for
    bf16 and q8_0 (q8_0 falls back to f16 for rows that are not a multiple of 32 long)."""
    from gguf import GGMLQuantizationType, quants

    array = weight.detach().to(torch.float32).contiguous().numpy()
    if weight.dim() == 1 or dtype == "f32":
        return array, None
    if dtype == "f16" or (dtype == "q8_0" and array.shape[-1] % Q8_BLOCK):
        return array.astype(np.float16), None
    qtype = GGMLQuantizationType.BF16 if dtype == "bf16" else GGMLQuantizationType.Q8_0
    return quants.quantize(array, qtype), qtype


def _write_gguf(path: Path, model, tokenizer, dtype: str, marker: dict) -> None:
    from gguf import MODEL_ARCH, GGUFWriter, LlamaFileType, get_tensor_name_map

    config = model.config
    layers = config.num_hidden_layers
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer = GGUFWriter(str(path), "llama")
    writer.add_name(str(getattr(config, "_name_or_path", "") or "leantune export"))
    writer.add_file_type({"f32": LlamaFileType.ALL_F32, "f16": LlamaFileType.MOSTLY_F16,
                          "bf16": LlamaFileType.MOSTLY_BF16, "q8_0": LlamaFileType.MOSTLY_Q8_0}[dtype])
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_dimension_count(head_dim)
    if head_dim * config.num_attention_heads != config.hidden_size:  # llama.cpp reads a head_dim of its own here
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta", getattr(config, "rope_theta", None))
    if theta is None:
        raise LeantuneError("cannot export as GGUF: the model's config names no rope_theta")
    writer.add_rope_freq_base(float(theta))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_vocab_size(config.vocab_size)
    writer.add_string(MARKER_KEY, json.dumps(marker))
    _tokenizer_fields(writer, tokenizer, config.vocab_size)

    names = get_tensor_name_map(MODEL_ARCH.LLAMA, layers)
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    tied = head is not None and embed is not None and head.weight is embed.weight
    for hf_name, tensor in model.state_dict().items():
        module_name, suffix = hf_name.rsplit(".", 1)
        gguf_name = names.get_name(module_name)
        if gguf_name is None:
            raise LeantuneError(f"cannot export as GGUF: no GGUF name for the tensor {hf_name}")
        if tied and gguf_name == "output":
            continue  # no output.weight: the reader then ties the head to token_embd
        if module_name.endswith("self_attn.q_proj"):
            tensor = _to_llama_cpp_rotary_order(tensor, config.num_attention_heads)
        elif module_name.endswith("self_attn.k_proj"):
            tensor = _to_llama_cpp_rotary_order(tensor, config.num_key_value_heads)
        array, raw_dtype = _tensor_data(tensor, dtype)
        writer.add_tensor(f"{gguf_name}.{suffix}", array, raw_dtype=raw_dtype)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()


def write_gguf_export(target: Path, model, tokenizer, dtype: str, marker: dict) -> None:
    """Write the GGUF file beside ``target`` under a hidden temporary name and rename it into place (replacing a
    previous export in one step); on any failure, Ctrl-C or SIGTERM the temporary file is removed and ``target`` is
    untouched. Write errors (full disk, permissions) become one LeantuneError line."""
    tmp = target.with_name(f".{target.name}.tmp-{uuid.uuid4().hex[:8]}")  # named before it exists: always cleaned
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        _write_gguf(tmp, model, tokenizer, dtype, marker)
        os.replace(tmp, target)
    except BaseException as exc:
        with SignalsDeferred():
            tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise LeantuneError(f"cannot write the export to {target}: {exc.strerror or exc}") from None
        raise
