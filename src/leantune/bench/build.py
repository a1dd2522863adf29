"""The model of one benchmark run: a config's model in bf16 with PEFT LoRA, set up as one implementation runs it.

Every implementation gets the same weights: the model is built from its config, then every matrix is re-drawn from
(seed, parameter name) (:func:`seeded_init`), so the weights depend neither on the module classes (Liger swaps some)
nor on the order they were built in. LoRA: r=16, alpha=32 on all 7 projections (a MoE config: also its expert
stacks, PEFT ``target_parameters`` ``mlp.experts.gate_up_proj`` / ``down_proj``), ``init_lora_weights=False``
(non-zero B, so every gradient is non-trivial), adapters in fp32 (PEFT's default), sdpa attention (eager for a model
class that does not take sdpa, gpt-oss: :func:`attention_implementation`), gradient
checkpointing non-reentrant with ``enable_input_require_grads``.

Implementations: ``hf+peft`` (HF modules, eager), ``hf+peft+liger`` (``apply_liger_kernel_to_llama()`` before the
model is built; skipped when liger_kernel is not importable), ``hf+peft+batched_mm`` and ``hf+peft+eager_experts``
(MoE configs only: HF+PEFT with transformers' ``experts_implementation`` "batched_mm" or "eager", a Python loop
over experts, instead of its default "grouped_mm"), ``hf+peft+torchao`` and ``hf+peft+torchao+compile`` (the FP8
peer: torchao's float8 rowwise training on the frozen base layers, eager or each layer compiled,
:func:`_torchao_float8`; skipped when torchao is not importable), ``leantune`` (``leantune.patch`` after
``get_peft_model``), ``leantune+offload`` (checkpointed layer inputs in pinned host memory),
``leantune+offload+tiled`` (also the MLP over 4096-token tiles, ``+tiledN`` over N-token ones; both need
checkpointing), ``leantune+graph`` and ``leantune+nf4+graph`` (the same models, each step replayed from CUDA graphs by
``leantune.graphs.CapturedStep``: the step's loop differs, not the build), and the QLoRA ones:
``leantune+nf4`` (the decoder's frozen linears in leantune's NF4, then ``leantune.patch``; with ``+offload+tiled``
also the long-context switches) and ``hf+peft+bnb``
(bitsandbytes ``Linear4bit``, nf4, blocksize 64, double quantisation, bf16 compute: what
``BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
bnb_4bit_compute_dtype=torch.bfloat16)`` loads, with PEFT's ``lora.bnb.Linear4bit`` on top; embeddings, norms and
``lm_head`` stay bf16 as in ``leantune+nf4``, so the two differ only in their kernels (neither gets
``prepare_model_for_kbit_training``'s fp32 upcasts). ``leantune+fp8`` (experimental, issue #26): the same
layer-by-layer build with the frozen linears as leantune's ``FP8Linear`` (e4m3, per-output-channel scales), then
``leantune.patch``; from the second forward on, the RMSNorm and GLU kernels write the per-token e4m3 codes of the
q/k/v, gate/up and down inputs in their own pass (``patch/fp8_inputs.py``), while o_proj's input and dY still get a
separate quantisation pass; ``leantune+fp8+graph`` is the same model stepped from CUDA graphs. ``leantune+nf4fp8``
(``+graph``; experimental): ``leantune+nf4``'s NF4 layers with FP8 compute (``leantune.quantize``'s ``"nf4-fp8"``:
the codes dequantised straight to e4m3, the frozen GEMMs in FP8, the norm/GLU codes fused as for FP8).

The QLoRA models are built one decoder layer at a time (:func:`_build_quantized`): the model on the meta device, then
each layer materialised, drawn from the same (seed, name) as the bf16 model's, and quantised before the next, so the
bf16 model never exists whole (a 70B one would not fit on the card); ``leantune+nf4`` quantises a MoE layer's expert
stacks there too (Mixtral-8x7B shape: ~2.8 GB of bf16 stacks per layer, one layer at a time). Both quantise the same
bf16 weights to the same NF4 codes (leantune's quantiser is bit-exact with bitsandbytes'), so their first losses must
agree.
"""

from __future__ import annotations

import re
import zlib

from .harness import load_config


def attention_implementation(config) -> str:
    """"sdpa", or "eager" where transformers' causal-LM class for ``config`` does not support sdpa (gpt-oss:
    SDPA has no sinks; leantune's patch serves the sinks under eager with ``ops.sink_attention``)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    model_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    return "sdpa" if getattr(model_class, "_supports_sdpa", True) else "eager"


IMPLS = ("hf+peft", "hf+peft+liger", "hf+peft+batched_mm", "hf+peft+eager_experts",
         "leantune", "leantune+graph", "leantune+offload", "leantune+offload+tiled",
         "leantune+nf4", "leantune+nf4+graph", "leantune+nf4+offload+tiled", "hf+peft+bnb", "leantune+fp8",
         "leantune+fp8+graph", "leantune+nf4fp8", "leantune+nf4fp8+graph", "hf+peft+torchao", "hf+peft+torchao+compile")
QUANTIZED = ("leantune+nf4", "leantune+nf4+graph", "leantune+nf4+offload+tiled", "hf+peft+bnb", "leantune+fp8",
             "leantune+fp8+graph", "leantune+nf4fp8", "leantune+nf4fp8+graph")
TILE_TOKENS = 4096  # the tiled MLP's tile of "leantune+offload+tiled"
_TILE_SUFFIX = re.compile(r"\+tiled(\d+)$")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
EXPERT_TARGETS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")  # MoE configs: LoRA on the expert stacks
# HF+PEFT with transformers' other expert implementations (its default is "grouped_mm")
HF_EXPERTS = {"hf+peft+batched_mm": "batched_mm", "hf+peft+eager_experts": "eager"}


def split_tile(impl: str) -> tuple[str, int | None]:
    """(implementation, MLP tile in tokens or None): ``leantune+offload+tiled2048`` is ``leantune+offload+tiled``
    with 2048-token tiles; ``...+tiled`` alone has ``TILE_TOKENS``."""
    match = _TILE_SUFFIX.search(impl)
    if match:
        return impl[:match.start()] + "+tiled", int(match.group(1))
    return impl, (TILE_TOKENS if impl.endswith("+tiled") else None)


def known_impl(impl: str) -> bool:
    """Whether ``impl`` is one of ``IMPLS``, a tiled one with a tile of at least 1 token included."""
    base, tile = split_tile(impl)
    return base in IMPLS and (tile is None or tile >= 1)


class Skip(Exception):
    """The implementation cannot run here (e.g. Liger not installed): a result with a note, not a failure."""


def build(spec, device: str | None = None, shard=None):
    """(model, config): ``spec``'s model (a ``step.RunSpec``) on ``device`` (default ``spec.device``) in bf16 with
    LoRA, set up per ``spec.impl`` (module docstring), in training mode.

    ``shard`` (FSDP2 runs: a function that applies ``fully_shard`` to the model in place): the model is built on the
    meta device, set up, sharded, and only then given storage, each rank drawing the full matrices one at a time
    from the same (seed, name) and keeping its shard, so the weights equal the unsharded build's and a model larger
    than one card (70B) never exists whole on one. ``hf+peft+liger`` (Liger's classes are swapped in before the
    build) and the NF4 implementations (built layer by layer) are built on the device and then sharded; bitsandbytes'
    layers do not run under FSDP2 (Skip)."""
    import torch

    impl, tile = split_tile(spec.impl)
    config = load_config(spec.config, spec.layers)
    device = torch.device(device or spec.device)
    if shard is not None and impl == "hf+peft+bnb":
        raise Skip("bitsandbytes' Linear4bit does not run under FSDP2 (its quant state is not sharded)")
    # Liger swaps its classes in before a build on the device; the NF4 ones are built layer by layer on the device
    meta = shard is not None and impl != "hf+peft+liger" and impl not in QUANTIZED
    if meta:
        model, names = _build_meta(spec, config)
    elif impl in QUANTIZED:
        model = _build_quantized(spec, config, device)
    else:
        model = _build_bf16(spec, config, device)
    if impl.startswith("leantune"):
        import leantune

        offload = "offload" in impl
        if offload and not spec.gc:
            raise Skip("offloaded checkpoints need gradient checkpointing (--gc on)")
        leantune.patch(model, offload_checkpoints=offload, tile_mlp=tile)
    if shard is not None:
        shard(model)
    if meta:  # storage for the shards, then each rank's values
        model.to_empty(device=device)
        _init_and_draw(list(model.modules()), model.get_base_model(), names)
    model.train()  # HF checkpoints only in training mode
    return model, config


def _lora_config(spec, model=None):
    """LoRA on ``TARGETS``; on a MoE ``model`` also on its expert stacks (PEFT ``target_parameters``)."""
    from peft import LoraConfig

    moe = model is not None and any(name.endswith("mlp.experts") and getattr(m, "gate_up_proj", None) is not None
                                    for name, m in model.named_modules())
    return LoraConfig(r=spec.lora_r, lora_alpha=spec.lora_alpha, target_modules=TARGETS, lora_dropout=0.0,
                      init_lora_weights=False, bias="none", task_type="CAUSAL_LM",
                      target_parameters=list(EXPERT_TARGETS) if moe else None,
                      use_dora=getattr(spec, "dora", False))  # trl_bench's specs have no dora field


def _checkpointing(model, spec) -> None:
    model.config.use_cache = False
    if spec.gc:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()


def _build_bf16(spec, config, device):
    import torch
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    if spec.impl == "hf+peft+liger":
        try:
            from liger_kernel.transformers import apply_liger_kernel_to_llama
        except ImportError as exc:
            raise Skip(f"liger_kernel not importable ({exc})") from None
        if config.model_type != "llama":
            raise Skip(f"Liger's llama patch does not apply to model_type {config.model_type!r}")
        apply_liger_kernel_to_llama()  # module-level: classes swapped before the model is built
    torch.manual_seed(spec.seed)
    with device:
        model = AutoModelForCausalLM.from_config(config, **_hf_build_options(spec, config))
    seeded_init(model, spec.seed, trainable_only=False, std=getattr(config, "initializer_range", 0.02))
    _checkpointing(model, spec)
    model = get_peft_model(model, _lora_config(spec, model))
    seeded_init(model, spec.seed + 1, trainable_only=True)
    if spec.impl.startswith("hf+peft+torchao"):
        _torchao_float8(model, compiled=spec.impl.endswith("+compile"))
    return model


def _torchao_float8(model, compiled: bool) -> None:
    """The FP8 peer baseline (issue #26): torchao's ``convert_to_float8_training`` with its rowwise recipe (per-row
    scales of x and dY, per-output-channel of W: leantune's FP8 layout) on the frozen bf16 ``base_layer`` of every
    PEFT LoRA projection; the LoRA branch, embeddings and ``lm_head`` stay bf16/fp32. torchao quantises W at every
    call (its weights stay bf16). ``compiled``: each ``Float8Linear`` through ``torch.compile`` (torchao's advice:
    its casts and scalings fused; per module, so checkpointing and PEFT stay eager). Skip without torchao."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        from torchao.float8.float8_linear import Float8Linear
    except ImportError as exc:
        raise Skip(f"torchao not importable ({exc})") from None
    convert_to_float8_training(model, module_filter_fn=lambda module, fqn: fqn.endswith("base_layer"),
                               config=Float8LinearConfig.from_recipe_name("rowwise"))
    converted = [m for m in model.modules() if isinstance(m, Float8Linear)]
    if not converted:
        raise Skip("torchao converted no base layer")
    if compiled:
        for module in converted:
            module.compile()


def _hf_build_options(spec, config) -> dict:
    """``from_config``'s options for a bf16 build: dtype, attention and, for ``HF_EXPERTS``, the experts
    implementation (Skip for a config without expert stacks)."""
    import torch

    options = {"dtype": torch.bfloat16, "attn_implementation": attention_implementation(config)}
    if spec.impl in HF_EXPERTS:
        if not _has_expert_stacks(config):
            raise Skip(f"{spec.impl}: model_type {config.model_type!r} has no expert stacks")
        options["experts_implementation"] = HF_EXPERTS[spec.impl]
    return options


def _has_expert_stacks(config) -> bool:
    """Whether ``config``'s model has transformers' 3-D expert stacks (the MoE families: an experts count set)."""
    return any(getattr(config, name, None) for name in ("num_experts", "num_local_experts", "n_routed_experts"))


def _build_meta(spec, config):
    """The bf16 LoRA model on the meta device (for :func:`build`'s ``shard``), and the names that seed its draws:
    the bf16 model's for the base modules, PEFT's for the adapters (as :func:`_build_bf16` draws them)."""
    import torch
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, **_hf_build_options(spec, config))
    names = _draw_names(model, spec.seed, getattr(config, "initializer_range", 0.02))
    _checkpointing(model, spec)
    model = get_peft_model(model, _lora_config(spec, model))
    for name, module in model.named_modules():  # the adapters, drawn as seeded_init(trainable_only) does
        names.setdefault(module, (name, spec.seed + 1, None))
    return model, names


def _draw_names(model, seed: int, std: float) -> dict:
    """{module: (its name, seed, std)} over ``model``'s modules: the names, seed and spread the bf16 build's
    :func:`seeded_init` draws their matrices with."""
    return {module: (name, seed, std) for name, module in model.named_modules()}


def _init_and_draw(modules, hf, names) -> None:
    """Values for ``modules``, which have storage but no values yet: HF's init of each (norms, biases, rotary
    frequencies, scaled embeddings' scale), then each matrix of a module in ``names`` drawn whole from its (name,
    seed, std), as :func:`seeded_init` draws it; of a ``DTensor`` each rank keeps its shard."""
    import torch
    from torch.distributed.tensor import DTensor, distribute_tensor

    seen = set()
    with torch.no_grad():
        for module in modules:  # first: a later module's init must not overwrite a tied matrix drawn below
            hf._init_weights(module)
        for module in modules:
            for key, p in module.named_parameters(recurse=False):
                if p.dim() < 2 or module not in names or id(p) in seen:  # a tied weight: once, under its first name
                    continue
                seen.add(id(p))
                name, seed, std = names[module]
                full = torch.empty(p.shape, dtype=p.dtype, device=p.device) if isinstance(p, DTensor) else p
                _draw_(full, f"{name}.{key}" if name else key, seed, std)
                if isinstance(p, DTensor):
                    p.to_local().copy_(distribute_tensor(full, p.device_mesh, p.placements,
                                                         src_data_rank=None).to_local())


def _build_quantized(spec, config, device):
    """The QLoRA model, one decoder layer at a time (module docstring)."""
    import torch
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    if spec.impl == "hf+peft+bnb":
        try:
            import bitsandbytes  # noqa: F401
        except ImportError as exc:
            raise Skip(f"bitsandbytes not importable ({exc})") from None
    torch.manual_seed(spec.seed)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, **_hf_build_options(spec, config))
    hf = model
    names = _draw_names(model, spec.seed, getattr(config, "initializer_range", 0.02))  # the bf16 model's names
    layers = list(model.get_decoder().layers)
    if spec.impl.startswith("leantune"):  # PEFT wraps nn.Linear bases; leantune's NF4 replaces them under the wrappers
        model = get_peft_model(model, _lora_config(spec, model))
    inside = {id(m) for layer in layers for m in layer.modules()}
    outside = [m for m in hf.modules() if id(m) not in inside]
    for layer in layers:
        _materialize(list(layer.modules()), hf, names, device)
        _quantize_layer(layer, spec.impl, names)  # drops the bf16 linears (from ``names`` too): freed here
    _materialize(outside, hf, names, device)
    if getattr(config, "tie_word_embeddings", False):
        hf.tie_weights()
    _checkpointing(hf, spec)
    if spec.impl == "hf+peft+bnb":  # PEFT puts lora.bnb.Linear4bit over bitsandbytes' layers
        model = get_peft_model(model, _lora_config(spec, model))
    seeded_init(model, spec.seed + 1, trainable_only=True)
    return model


def _materialize(modules, hf, names, device) -> None:
    """Storage on ``device`` for ``modules``' meta parameters and buffers, then their values
    (:func:`_init_and_draw`)."""
    modules = [m for m in modules if any(t.is_meta for t in (*m.parameters(recurse=False), *m.buffers(recurse=False)))]
    for module in modules:
        module.to_empty(device=device, recurse=False)
    _init_and_draw(modules, hf, names)


def _quantize_layer(layer, impl: str, names) -> None:
    """Replace the layer's frozen projections by quantised ones: leantune's ``NF4Linear`` (``FP8Linear`` for
    ``leantune+fp8``) under PEFT's wrappers, or bitsandbytes' ``Linear4bit`` (quantised as it moves to the device).
    The NF4 leantune ones also put a MoE experts module's stacks in NF4 (``leantune.quantize_experts``: the layer's
    bf16 stacks are freed here, so a Mixtral-8x7B-shaped model never holds more than one layer's); bitsandbytes and
    FP8 keep the stacks in bf16."""
    from torch import nn

    if impl.startswith("leantune") and not impl.startswith("leantune+fp8"):
        from ..quantize import expert_stacks, quantize_experts

        for module in list(layer.modules()):
            if expert_stacks(module):
                quantize_experts(module, names.get(module, ("experts",))[0])

    for parent in list(layer.modules()):
        for child_name, child in list(parent.named_children()):
            if type(child) is not nn.Linear or child_name not in (*TARGETS, "base_layer"):
                continue
            if impl.startswith("leantune+fp8"):
                from ..ops import quantize_fp8
                from ..quantize import FP8Linear

                new = FP8Linear(quantize_fp8(child.weight.detach(), name=names.get(child, (child_name,))[0]),
                                child.bias)
            elif impl.startswith("leantune"):
                from ..ops import quantize_nf4, with_fp8_compute
                from ..quantize import NF4Linear

                weight = quantize_nf4(child.weight.detach(), name=names.get(child, (child_name,))[0])
                new = NF4Linear(with_fp8_compute(weight) if impl.startswith("leantune+nf4fp8") else weight,
                                child.bias)
            else:
                import bitsandbytes as bnb

                weight = bnb.nn.Params4bit(child.weight.detach(), requires_grad=False, compress_statistics=True,
                                           quant_type="nf4", blocksize=64)
                new = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                        compute_dtype=child.weight.dtype, compress_statistics=True,
                                        quant_type="nf4", device="meta")
                new.weight = weight
                if child.bias is not None:
                    new.bias = child.bias
                new = new.to(child.weight.device)  # Params4bit quantises on this move
            setattr(parent, child_name, new)
            names.pop(child, None)


def seeded_init(model, seed: int, *, trainable_only: bool, std: float | None = None) -> None:
    """Re-draw every matrix from a generator seeded by (seed, parameter name), so the weights depend on neither the
    module classes (Liger swaps some) nor the order they were built in. ``std`` given: normal(0, std) (base
    weights; 1-D parameters, the norms, keep their init); else uniform(+-1/sqrt(fan_in)), nn.Linear's default
    (LoRA A [r, in] and B [out, r], non-zero as with ``init_lora_weights=False``)."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():  # tied weights appear once
            if p.dim() < 2 or (trainable_only and not p.requires_grad):
                continue
            _draw_(p, name, seed, std)


def _draw_(p, name: str, seed: int, std: float | None) -> None:
    import torch

    g = torch.Generator(device=p.device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    if std is not None:
        p.normal_(0.0, std, generator=g)
    else:
        bound = p.shape[1] ** -0.5
        p.uniform_(-bound, bound, generator=g)
