"""The model side of a run: which ``--model`` it is, its tokenizer, the causal LM itself, and the LoRA wrapper.

Every check here raises ``LeantuneError`` with one line naming the model path: a path of no known kind, a config that
is not a causal LM (checked from config.json before any weight is read), weights that do not fit config.json (a
missing tensor would be initialised at random), a tokenizer that is missing or empty, LoRA targets the model lacks.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..errors import LeantuneError
from ..patch import patch
from .config import TrainConfig
from .metrics import one_line, say

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")


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


def _damaged_gguf(path: Path) -> LeantuneError | None:
    """The error for a GGUF file that gguf's own reader cannot take apart (truncated or corrupt), else None (the
    file is whole: the load failed for another reason). Only called after a load failed: the reader parses every
    metadata entry (seconds for a 49k-token vocabulary)."""
    try:
        from gguf import GGUFReader

        GGUFReader(path)
    except ImportError:
        return None
    except Exception as reader_exc:  # numpy's reshape, struct or UnicodeDecodeError of a cut-off file
        size = path.stat().st_size
        return LeantuneError(f"model file {path} is truncated or corrupt ({size} bytes; the GGUF reader says: "
                             f"{one_line(reader_exc)[:200]}); download or convert it again")
    return None


def _unsupported(path: Path, exc: BaseException) -> LeantuneError:
    return LeantuneError(f"unsupported model type in {path}: {str(exc).splitlines()[0]}")


def check_causal_lm(kind: str, path: Path) -> None:
    """Refuse a config.json (of a folder or alone) that transformers cannot read, or that describes no causal LM.

    A config whose ``architectures`` names only other heads (``BertForMaskedLM``, ``T5ForConditionalGeneration``)
    is not a causal LM even when transformers has a causal-LM class for its model type: loading it as one would
    report its weights as missing. Without ``architectures`` the model type decides. A GGUF file is not checked
    here (transformers reads its architecture while loading it).
    """
    if kind == "gguf":
        return
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    try:
        config = AutoConfig.from_pretrained(path)
    except (ValueError, KeyError) as exc:
        raise _unsupported(path, exc) from None
    except OSError as exc:
        raise LeantuneError(f"cannot read the config of {path}: {one_line(exc)[:400]}") from None
    causal = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    architectures = list(getattr(config, "architectures", None) or [])
    if architectures:
        ok = any(name in causal or name.endswith("ForCausalLM") for name in architectures)
    else:
        ok = config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    if getattr(config, "is_encoder_decoder", False):
        ok = False
    if not ok:
        named = f"architectures {', '.join(architectures)}" if architectures else "no causal-LM class"
        raise LeantuneError(f"{path} is not a causal LM (model type {config.model_type!r}, {named}); leantune "
                            "trains decoder-only models such as Llama, Mistral, Qwen2 or Gemma")


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def resolve_dtype(name: str, device: str) -> torch.dtype:
    """``--dtype``: bf16, fp16 or fp32 as named; ``auto`` is bf16 on CUDA and fp32 on the CPU."""
    if name == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return DTYPES[name]


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
        if kind == "gguf" and (damaged := _damaged_gguf(path)) is not None:
            raise damaged from None
        raise LeantuneError(f"cannot load the tokenizer of {path}: {one_line(exc)}") from None
    if len(tokenizer) < 2:
        if kind == "gguf":
            raise LeantuneError(f"no tokenizer in {path}: it holds an empty vocabulary")
        raise LeantuneError(missing + (f" (the tokenizer files there load as a vocabulary of {len(tokenizer)} "
                                       "token)" if has_files else ""))
    if kind == "gguf":
        _gguf_special_tokens(tokenizer, path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _gguf_special_tokens(tokenizer, path: Path) -> None:
    """The end-of-sequence token the GGUF file names (transformers 5.17's GGUF tokenizer reading can give the bos
    token in its place: training then appended bos where eos belongs), and no bos token where leantune's GGUF
    export wrote the eos id as a stand-in for a tokenizer without one (``gguf_export.BOS_STAND_IN_KEY``)."""
    from gguf import GGUFReader

    from .gguf_export import BOS_STAND_IN_KEY

    fields = GGUFReader(path).fields

    def value(key):
        field = fields.get(key)
        return None if field is None or not field.data else field.parts[field.data[0]].tolist()[0]

    eos = value("tokenizer.ggml.eos_token_id")
    if isinstance(eos, int) and 0 <= eos < len(tokenizer) and tokenizer.eos_token_id != eos:
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(eos)
    if value(BOS_STAND_IN_KEY):
        if tokenizer.pad_token_id is not None and tokenizer.pad_token_id == tokenizer.bos_token_id:
            tokenizer.pad_token = tokenizer.eos_token
        tokenizer.bos_token = None


def use_chat_template(tokenizer, path: str | None) -> None:
    """Give ``tokenizer`` the Jinja chat template in file ``path`` (None: keep its own). The template must render a
    user and an assistant turn; raises LeantuneError naming the file otherwise. The tokenizer saved with the run
    carries it."""
    if path is None:
        return
    file = Path(path)
    try:
        template = file.read_text(encoding="utf-8-sig")
    except FileNotFoundError:
        raise LeantuneError(f"--chat-template {file}: file not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        why = getattr(exc, "strerror", None) or "not UTF-8 text"
        raise LeantuneError(f"--chat-template {file}: cannot read it ({why})") from None
    probe = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    try:
        rendered = tokenizer.apply_chat_template(probe, chat_template=template, tokenize=False)
    except Exception as exc:  # jinja2's TemplateSyntaxError, UndefinedError, ...: one line
        raise LeantuneError(f"--chat-template {file}: not a usable Jinja chat template "
                            f"({one_line(exc)[:200]})") from None
    if "hello" not in rendered:
        raise LeantuneError(f"--chat-template {file}: the template does not render the messages' content (a "
                            "conversation of 'hi' and 'hello' rendered without 'hello')")
    if getattr(tokenizer, "chat_template", None):
        say(f"leantune: --chat-template {file} replaces the tokenizer's own chat template")
    tokenizer.chat_template = template


def fp8_checkpoint(kind: str, path: Path) -> dict | None:
    """The ``quantization_config`` of a Hugging Face folder whose config.json declares FP8 weights (``quant_method``
    ``"fp8"``: e4m3 weights beside block scales, as DeepSeek-V3 and Qwen3-FP8 ship them), else None."""
    if kind != "hf":
        return None
    try:
        raw = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None  # check_causal_lm says what is wrong with it
    quant = raw.get("quantization_config") if isinstance(raw, dict) else None
    return quant if isinstance(quant, dict) and quant.get("quant_method") == "fp8" else None


def check_quantize(kind: str, path: Path, quantize: str | None) -> None:
    """An FP8 checkpoint trains with ``--quantize fp8`` only: its weights stay FP8 (requantised per output
    channel); another setting would train on a different base than the one it ships."""
    quant = fp8_checkpoint(kind, path)
    if quant is not None and quantize != "fp8":
        raise LeantuneError(f"{path} ships FP8 weights (quantization_config: quant_method fp8, weight_block_size "
                            f"{quant.get('weight_block_size')}): train it with --quantize fp8"
                            + (f", not --quantize {quantize}" if quantize else ""))


def _check_fp8_tiles(path: Path, quant: dict) -> None:
    """Without a CUDA device transformers 5.17 dequantises an FP8 checkpoint itself, taking the tile size as the
    weight's dims over the scale grid's: right only for dims that are multiples of ``weight_block_size`` (a 200-row
    weight with 2 scale rows would get 100-row tiles, silently wrong). Refuse such a checkpoint before loading it
    (from the safetensors headers)."""
    from safetensors import safe_open

    block = quant.get("weight_block_size")
    if block is None:
        return
    index = path / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else \
        ["model.safetensors"]
    for file in files:
        if not (path / file).is_file():
            continue  # transformers reports a missing file
        with safe_open(str(path / file), framework="pt") as fh:
            for key in fh.keys():
                shape = fh.get_slice(key).get_shape()
                if key.endswith("_scale_inv") or len(shape) != 2 or fh.get_slice(key).get_dtype() != "F8_E4M3":
                    continue
                if shape[0] % block[0] or shape[1] % block[1]:
                    raise LeantuneError(f"cannot load the FP8 weights of {path} without a CUDA device: {key} is "
                                        f"{shape[0]} x {shape[1]}, not a multiple of the {block[0]} x {block[1]} "
                                        "blocks, which transformers' CPU dequantisation mis-scales")


def _from_fp8_checkpoint(model, dtype: torch.dtype, path: Path):
    """A model transformers loaded in fp32 from an FP8 checkpoint with its decoder linears in leantune's FP8
    (``quantize(model, "fp8")``: each block-scaled weight dequantised in fp32 and requantised per output channel,
    compute dtype ``dtype``) and every other parameter in ``dtype``. Loading in fp32 makes the codes the same on
    every host: with a CUDA device transformers keeps its own FP8 linears (converted from their blocks here),
    without one it dequantises into ``nn.Linear`` weights of the load dtype, in fp32 the same products."""
    from ..quantize import quantize

    try:
        done = quantize(model, "fp8", dtype=dtype)
    except ValueError as exc:
        raise LeantuneError(f"cannot load the FP8 weights of {path}: {str(exc).splitlines()[0]}") from None
    left = next((name for name, t in model.named_parameters() if t.dtype.itemsize == 1 and t.is_floating_point()),
                None)
    if left is not None:  # e.g. transformers' FP8Experts of a mixture-of-experts release, on a CUDA host
        raise LeantuneError(f"cannot load the FP8 weights of {path}: {left} is FP8 in a layer leantune cannot hold "
                            "in FP8 yet (only the decoder's linear layers; FP8 experts are not supported)")
    with torch.no_grad():  # parameters only: the FP8 codes and scales are buffers, RoPE's inv_freq stays fp32
        for param in model.parameters():
            if param.is_floating_point() and param.dtype != dtype:
                param.data = param.data.to(dtype)
    # leantune holds the quantised weights now: transformers' quantizer (kept on a CUDA host) and its flags go, so
    # PEFT and save_pretrained see a plain model
    _drop_hf_quantizer(model)
    # transformers keeps the conversions it loaded with and reverses them on save_pretrained: its dequantisation
    # would turn into a block requantisation of an export's merged weights
    conversions = []
    for conversion in getattr(model, "_weight_conversions", None) or []:
        operations = getattr(conversion, "operations", None)
        if operations is not None:
            kept = [op for op in operations if type(op).__name__ != "Fp8Dequantize"]
            if not kept:
                continue
            conversion.operations = kept
        conversions.append(conversion)
    if hasattr(model, "_weight_conversions"):
        model._weight_conversions = conversions
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config
    model.config.dtype = dtype
    say(f"leantune: {done['layers']} FP8 linear layers of {path.name} (block-scaled e4m3) requantised per output "
        f"channel: {done['bytes_after'] / 2**30:.2f} GiB of frozen weights")
    return model


def _drop_hf_quantizer(model) -> None:
    """transformers' quantizer and its flags off a model whose weights are now dense or leantune's (a GGUF file's,
    dequantised at load; an FP8 checkpoint's, requantised): PEFT and ``save_pretrained`` then see a plain model
    (a GGUF-loaded one is "not serializable" to transformers, so an export of its run failed)."""
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    for module in model.modules():
        if getattr(getattr(module, "config", None), "_is_quantized", False):
            module.config._is_quantized = False
    for name in ("hf_quantizer", "quantization_method"):
        if getattr(model, name, None) is not None:
            setattr(model, name, None)
    if getattr(model, "is_quantized", False):
        model.is_quantized = False
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config


def load_model(kind: str, path: Path, dtype: torch.dtype, device: str, seed: int):
    """A causal LM on ``device`` in ``dtype``; a config.json is initialised randomly (seeded) directly on device;
    ``device="meta"``: the model of a stored folder built from its config.json alone, without storage. A folder
    that ships FP8 weights (``fp8_checkpoint``) comes with its decoder linears as leantune ``FP8Linear`` layers.

    Raises LeantuneError for a model that is not a causal LM, an unsupported model type or unreadable weights.
    """
    from safetensors import SafetensorError
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as transformers_logging

    check_causal_lm(kind, path)
    try:
        if device == "meta":  # a rank that receives rank 0's weights (distributed.wrap's from_main)
            with torch.device("meta"):
                return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=dtype)
        if kind == "config":
            config = AutoConfig.from_pretrained(path)
            torch.manual_seed(seed)
            with torch.device(device):
                model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        elif kind == "gguf":
            model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
            _drop_hf_quantizer(model)  # its weights are dense (dequantised at load)
        else:
            verbosity = transformers_logging.get_verbosity()
            transformers_logging.set_verbosity_error()  # its load report table: the checks below say it in a line
            try:
                fp8 = fp8_checkpoint(kind, path) is not None
                if fp8 and not torch.cuda.is_available():
                    _check_fp8_tiles(path, fp8_checkpoint(kind, path))
                model, info = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32 if fp8 else dtype,
                                                                   output_loading_info=True,
                                                                   ignore_mismatched_sizes=True)
            finally:
                transformers_logging.set_verbosity(verbosity)
            _check_loading_info(path, info)
            if fp8:
                model = _from_fp8_checkpoint(model, dtype, path)
    except (ValueError, KeyError) as exc:
        if kind == "gguf" and (damaged := _damaged_gguf(path)) is not None:
            raise damaged from None
        raise _unsupported(path, exc) from None
    except (OSError, RuntimeError, SafetensorError) as exc:  # missing, truncated or mismatched weights
        raise LeantuneError(f"cannot load model {path}: {one_line(exc)[:400]}") from None
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
        say(f"leantune: warning: {path} holds weights its config.json has no place for, ignored: "
            f"{some(info['unexpected_keys'])}")


def expert_parameter_targets(model) -> list[str]:
    """The 3-D expert weights of a mixture-of-experts ``model`` as PEFT's ``target_parameters`` names them,
    ``experts.<parameter>`` (e.g. ``experts.gate_up_proj``, ``experts.down_proj``), sorted; [] for a dense model.

    transformers 5 keeps a MoE block's experts as ``[E, ., .]`` parameters of one ``...experts`` module, not as
    linear layers, so ``target_modules`` cannot reach them; PEFT wraps them by parameter name instead."""
    return sorted({f"experts.{p}" for n, m in model.named_modules() if n.rsplit(".", 1)[-1] == "experts"
                   for p, w in m.named_parameters(recurse=False) if w.dim() == 3})


def lora_config(model, config: TrainConfig):
    """PEFT's ``LoraConfig`` of a run, its ``--target-modules`` checked against ``model``'s module names and its
    ``--lora-r`` against the widest linear layer (both before PEFT allocates anything).

    A MoE model's expert stacks (:func:`expert_parameter_targets`) go to PEFT's ``target_parameters``: all of them under
    ``all-linear`` (PEFT's own ``all-linear`` reaches them in some families only, e.g. Qwen3-MoE but not gpt-oss),
    and a listed name that is an expert stack's parameter (``gate_up_proj``, ``down_proj``) selects those stacks
    beside any linear layers of that name."""
    from peft import LoraConfig

    stacks = expert_parameter_targets(model)
    targets, parameters = config.target_modules, stacks
    if targets != "all-linear":
        targets = [name.strip() for name in targets.split(",") if name.strip()]
        modules = dict(model.named_modules())
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in modules.items() if isinstance(m, torch.nn.Linear)})
        parameters = [s for s in stacks if s.rsplit(".", 1)[-1] in targets]
        # PEFT's rule for a list: a module matches a key when its name is the key or ends with "." + key; PEFT
        # itself only complains when no key matches, so a typo next to a valid name would be silently dropped.
        matches = {t: [m for n, m in modules.items() if n == t or n.endswith("." + t)] for t in targets}
        unmatched = [t for t in targets if not matches[t] and f"experts.{t}" not in parameters]
        if unmatched or not targets:
            stacks_named = f"; its expert stacks are {', '.join(s.split('.')[-1] for s in stacks)}" if stacks else ""
            raise LeantuneError(f"--target-modules: {', '.join(repr(t) for t in unmatched) or '(none)'} not found "
                                f"in the model; its linear layers are {', '.join(linear)}{stacks_named}")
        for t in targets:  # a block (e.g. self_attn) matches by name, but LoRA goes on layers, not on blocks
            if matches[t] and all(next(m.children(), None) is not None for m in matches[t]):
                raise LeantuneError(f"--target-modules: {t!r} names {type(matches[t][0]).__name__} blocks, not layers "
                                    f"LoRA can wrap; its linear layers are {', '.join(linear)}")
        # PEFT takes a name that matches only an expert stack as a module name it cannot find: leave it out there
        targets = [t for t in targets if matches[t]] or None
    widest = max((min(m.in_features, m.out_features) for m in model.modules() if isinstance(m, torch.nn.Linear)),
                 default=0)
    if config.lora_r > widest:  # [r, in] and [out, r] per layer
        raise LeantuneError(f"--lora-r {config.lora_r} is larger than every linear layer of the model allows: the "
                            f"widest has min(in, out) = {widest}, and a rank above it is not low-rank")
    return LoraConfig(r=config.lora_r, lora_alpha=config.lora_alpha, lora_dropout=config.lora_dropout,
                      target_modules=targets, target_parameters=parameters or None, bias="none",
                      task_type="CAUSAL_LM", use_dora=config.dora, use_rslora=config.rslora)


def wrap_lora(model, config: TrainConfig):
    """``--quantize`` (when given), PEFT LoRA on ``config.target_modules`` (adapters in fp32, PEFT's default), then
    ``leantune.patch``."""
    from peft import get_peft_model

    lora = lora_config(model, config)
    model.config.use_cache = False
    if config.gradient_checkpointing == "on":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if config.quantize is not None:  # before PEFT, as QLoRA loads: DoRA's magnitudes start from the quantised W
        _quantize(model, config.quantize)
    torch.manual_seed(config.seed)
    try:
        model = get_peft_model(model, lora)
    except ValueError as exc:
        message = str(exc).splitlines()[0]
        if "ParamWrapper" in message:  # PEFT's LoRA on 3-D MoE expert stacks (target_parameters)
            message += (" (PEFT puts LoRA on a MoE model's expert stacks through target_parameters, which takes no "
                         "DoRA and no lora_dropout: drop --dora / --lora-dropout, or name the projections to adapt "
                         "with --target-modules, e.g. q_proj,k_proj,v_proj,o_proj, which leaves the experts out)")
        raise LeantuneError(f"cannot apply LoRA: {message}") from None
    if config.patch == "on":
        try:
            model = patch(model, offload_checkpoints=config.offload_checkpoints, tile_mlp=config.tile_mlp,
                          strict=True)  # an uncovered model type raises: the message below instead of a warning
        except ValueError as exc:  # a family without a patch table still trains, with HF's modules
            say(f"leantune: warning: not patched ({str(exc).splitlines()[0]}); training with HF's modules")
    return model


def _quantize(model, quant_type: str) -> None:
    """``leantune.quantize`` of the run's model, said in one line (errors as LeantuneError)."""
    from ..quantize import quantize

    try:
        done = quantize(model, quant_type)
    except ValueError as exc:
        raise LeantuneError(f"--quantize {quant_type}: {str(exc).splitlines()[0]}") from None
    if torch.device(next(model.parameters()).device).type == "cuda":
        torch.cuda.empty_cache()  # the 16-bit weights just replaced
    what = {"nf4": "NF4", "fp8": "FP8 (e4m3, one scale per output channel; experimental)",
            "nf4-fp8": "NF4 with FP8 compute (experimental)"}[quant_type]
    experts = f" and {done['experts']} MoE experts modules" if done.get("experts") else ""
    # fp8 has no expert path (the grouped expert GEMMs take 16-bit or NF4 stacks): most of a MoE's weights stay
    kept = (f"; the MoE expert stacks stay in {next(model.parameters()).dtype} (--quantize nf4 quantises them)"
            if quant_type == "fp8" and expert_parameter_targets(model) else "")
    if done["layers"]:  # none: an FP8 checkpoint's layers, converted (and said) at load
        say(f"leantune: {done['layers']} linear layers{experts} in {what}: {done['bytes_before'] / 2**30:.2f} GiB "
            f"of frozen weights -> {done['bytes_after'] / 2**30:.2f} GiB{kept}")
