"""Offloaded checkpoints on CPU: the same pack/prefetch/unpack bookkeeping as on CUDA with host-to-host copies, so
gradients must equal plain non-reentrant checkpointing bit for bit; the host pool, its room check, and the errors."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from peft import LoraConfig, get_peft_model
from reference import rel_err
from torch.utils.checkpoint import checkpoint
from transformers import LlamaConfig, LlamaForCausalLM

import leantune
from leantune.errors import LeantuneError
from leantune.patch import offload
from leantune.patch.offload import (
    CheckpointOffloader,
    disable_offloaded_checkpoints,
    enable_offloaded_checkpoints,
    offloader_of,
)

VOCAB = 300
LAYERS = 2
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
NON_REENTRANT = {"use_reentrant": False}


def tiny_llama_lora(**lora_kwargs):
    """A random 2-layer Llama (hidden 64) wrapped by PEFT LoRA on all seven projections, in training mode."""
    config = LlamaConfig(hidden_size=64, intermediate_size=112, num_hidden_layers=LAYERS, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=128, initializer_range=0.2)
    config._attn_implementation = "eager"
    options = {"r": 4, "lora_alpha": 8, "target_modules": PROJECTIONS, "lora_dropout": 0.0, "init_lora_weights": False}
    options.update(lora_kwargs)
    return get_peft_model(LlamaForCausalLM(config), LoraConfig(**options)).train()


def step(model, input_ids):
    """(loss, {name: grad}) of one forward + backward with labels = input_ids."""
    model.zero_grad(set_to_none=True)
    out = model(input_ids=input_ids, labels=input_ids)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    assert grads and all(g is not None and g.norm() > 0 for g in grads.values())
    return out.loss.detach(), grads


def assert_bit_identical(result, ref):
    (loss, grads), (ref_loss, ref_grads) = result, ref
    assert torch.equal(loss, ref_loss), f"loss {loss.item()!r} != {ref_loss.item()!r}"
    assert grads.keys() == ref_grads.keys()
    different = [name for name in grads if not torch.equal(grads[name], ref_grads[name])]
    assert not different, f"gradients not bit-identical: {different}"


@pytest.fixture(autouse=True)
def torch_backend(monkeypatch):
    monkeypatch.setenv("LEANTUNE_BACKEND", "torch")


@pytest.mark.parametrize("patched", [False, True], ids=["hf", "leantune"])
@pytest.mark.parametrize("order", ["checkpointing_first", "offload_first"])
def test_gradients_bit_identical_to_plain_checkpointing(order, patched):
    model = tiny_llama_lora()
    if patched:
        leantune.patch(model)
    input_ids = torch.randint(3, VOCAB, (2, 37))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=NON_REENTRANT)
    ref = step(model, input_ids)
    if order == "offload_first":
        model.gradient_checkpointing_disable()
        offloader = enable_offloaded_checkpoints(model, min_bytes=0)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=NON_REENTRANT)
    else:
        offloader = enable_offloaded_checkpoints(model, min_bytes=0)
    assert_bit_identical(step(model, input_ids), ref)
    # exactly one saved input per checkpointed layer (no masks, position ids or cos/sin); layer 0's prefetched
    assert (offloader.packed, offloader.prefetched) == (LAYERS, LAYERS - 1)
    assert_bit_identical(step(model, input_ids), ref)


def test_layer_input_is_released_after_pack():
    """The layer input is held only by the host copy: the original tensor is freed as the forward moves on."""
    offloader = CheckpointOffloader(min_bytes=0)
    weight = torch.randn(16, 16, requires_grad=True)
    x = torch.randn(3, 5, 16, requires_grad=True)
    hidden = x * 2.0  # non-leaf, saved by nothing but the checkpoint
    alive = weakref.ref(hidden)
    offloader.begin_forward(1)
    with offloader.hooks():
        y = checkpoint(lambda h: torch.tanh(h @ weight), hidden, use_reentrant=False)
    del hidden
    gc.collect()
    assert alive() is None, "the checkpoint input is still referenced after offloading"
    y.square().sum().backward()
    ref_x, ref_w = x.grad.clone(), weight.grad.clone()
    x.grad = weight.grad = None
    checkpoint(lambda h: torch.tanh(h @ weight), x * 2.0, use_reentrant=False).square().sum().backward()
    assert torch.equal(x.grad, ref_x) and torch.equal(weight.grad, ref_w)


def test_empty_tensors_stay_even_with_no_threshold():
    """torch 2.11's non-reentrant checkpoint saves an empty dummy beside the layer inputs: it is not offloaded (no
    buffer, no link in the prefetch chain), even with ``min_bytes=0``."""
    offloader = CheckpointOffloader(min_bytes=0)
    offloader.begin_forward(1)
    dummy = torch.empty((0,), requires_grad=True)
    assert offloader.pack(dummy) is dummy
    assert offloader.packed == 0 and not list(offloader.pool.buffers())
    saved = offloader.pack(torch.randn(3, 4))
    assert offloader.packed == 1 and offloader.unpack(saved).shape == (3, 4)


def test_host_pool_reused_across_steps():
    model = tiny_llama_lora()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=NON_REENTRANT)
    offloader = enable_offloaded_checkpoints(model, min_bytes=0)
    input_ids = torch.randint(3, VOCAB, (3, 29))
    step(model, input_ids)
    first = sorted(t.data_ptr() for t in offloader.pool.buffers())
    assert len(first) == LAYERS and offloader.pool.nbytes() == LAYERS * 3 * 29 * 64 * 4
    for _ in range(2):
        step(model, input_ids)
        assert sorted(t.data_ptr() for t in offloader.pool.buffers()) == first, "pool buffers were reallocated"
    assert offloader.pool.nbytes() == LAYERS * 3 * 29 * 64 * 4
    # a shorter last batch: a new set, the idle set of the old shape dropped first
    step(model, input_ids[:2])
    assert offloader.pool.nbytes() == LAYERS * 2 * 29 * 64 * 4


def test_host_room_check_raises_before_allocating(monkeypatch):
    model = tiny_llama_lora()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=NON_REENTRANT)
    offloader = enable_offloaded_checkpoints(model, min_bytes=0, margin_gib=1.0)
    monkeypatch.setattr(offload, "host_available_bytes", lambda: 1024**3)  # 1 GiB: the margin alone fills it
    with pytest.raises(LeantuneError, match=r"need 0\.00 GiB of host memory for 2 layer inputs of shape \[2, 9, 64\] "
                                            r"float32, plus a 1\.00 GiB margin, but only 1\.00 GiB is available"):
        model(input_ids=torch.randint(3, VOCAB, (2, 9)), labels=None)
    assert offloader.pool.nbytes() == 0
    monkeypatch.setattr(offload, "host_available_bytes", lambda: 2 * 1024**3)
    step(model, torch.randint(3, VOCAB, (2, 9)))
    assert offloader.pool.nbytes() > 0


def test_checkpointing_off_is_an_error():
    model = tiny_llama_lora()
    enable_offloaded_checkpoints(model)
    input_ids = torch.randint(3, VOCAB, (2, 9))
    with pytest.raises(LeantuneError, match=r"gradient checkpointing is off .*gradient_checkpointing_enable"):
        model(input_ids=input_ids, labels=input_ids)
    model.eval()
    model(input_ids=input_ids)  # no training forward, nothing to offload: fine
    with torch.no_grad():
        model.train()(input_ids=input_ids)


@pytest.mark.parametrize("kwargs", [{"use_reentrant": True}, {}], ids=["reentrant", "torch_default"])
def test_reentrant_checkpointing_is_an_error(kwargs):
    """Also when the keyword is missing: torch's checkpoint then runs reentrant."""
    model = tiny_llama_lora()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    enable_offloaded_checkpoints(model)
    input_ids = torch.randint(3, VOCAB, (2, 9))
    with pytest.raises(LeantuneError, match="non-reentrant"):
        model(input_ids=input_ids, labels=input_ids)


def test_small_tensors_stay_and_disable_restores():
    model = tiny_llama_lora()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=NON_REENTRANT)
    input_ids = torch.randint(3, VOCAB, (2, 9))
    ref = step(model, input_ids)
    offloader = enable_offloaded_checkpoints(model)  # default min_bytes 1 MiB: these inputs are 4.5 KiB
    assert_bit_identical(step(model, input_ids), ref)
    assert offloader.packed == 0 and offloader.pool.nbytes() == 0
    layers = model.get_base_model().model.layers
    originals = [layer._gradient_checkpointing_func.inner for layer in layers]
    assert offloader_of(model) is offloader
    disable_offloaded_checkpoints(model)
    assert offloader_of(model) is None
    assert [layer._gradient_checkpointing_func for layer in layers] == originals
    assert_bit_identical(step(model, input_ids), ref)
    disable_offloaded_checkpoints(model)  # harmless twice


def test_bad_arguments_named():
    with pytest.raises(ValueError, match="min_bytes"):
        CheckpointOffloader(min_bytes=-1)
    with pytest.raises(ValueError, match="margin_gib"):
        CheckpointOffloader(margin_gib="4")
    with pytest.raises(ValueError, match="transformers causal LM"):
        enable_offloaded_checkpoints(torch.nn.Linear(2, 2))


def test_transformers_own_offload_is_an_error():
    model = tiny_llama_lora()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=NON_REENTRANT, offload=True)
    enable_offloaded_checkpoints(model)
    input_ids = torch.randint(3, VOCAB, (2, 9))
    with pytest.raises(LeantuneError, match="offload=True"):
        model(input_ids=input_ids, labels=input_ids)


def test_patch_keywords_enable_offload_and_tiling_and_unpatch_removes_them():
    """``leantune.patch(offload_checkpoints=True, tile_mlp=N)``: gradients equal plain checkpointing bit for bit
    (tile of 48 rows over 2 x 24 tokens: one GEMM row block), the summary says so, and ``unpatch`` takes both away."""
    from leantune.patch.tiled_mlp import TiledForward

    input_ids = torch.randint(0, VOCAB, (2, 24))
    torch.manual_seed(0)
    plain = tiny_llama_lora()
    plain.gradient_checkpointing_enable(gradient_checkpointing_kwargs=NON_REENTRANT)
    leantune.patch(plain)
    reference = step(plain, input_ids)

    torch.manual_seed(0)
    model = tiny_llama_lora()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=NON_REENTRANT)
    leantune.patch(model, offload_checkpoints=True, tile_mlp=48)
    summary = model.base_model.model.leantune_summary
    assert summary["offload_checkpoints"] is True and summary["tile_mlp"] == 48
    mlps = [m for m in model.modules() if type(m).__name__ == "LlamaMLP"]
    assert all(isinstance(m.__dict__.get("forward"), TiledForward) for m in mlps)
    offloader_of(model).min_bytes = 0  # these layer inputs are 6 KiB, below the default threshold
    assert_bit_identical(step(model, input_ids), reference)
    assert offloader_of(model).packed == LAYERS
    disable_offloaded_checkpoints(model)  # the summary reads it at each access
    assert summary["offload_checkpoints"] is False

    leantune.unpatch(model)
    assert offloader_of(model) is None
    assert not any("forward" in m.__dict__ for m in mlps)
    with pytest.raises(ValueError, match="tile_mlp must be an int >= 1"):
        leantune.patch(model, tile_mlp=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the side streams and pinned buffers need CUDA")
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_cuda_offload_through_pinned_buffers_matches_plain_checkpointing(monkeypatch, backend):
    """On the GPU the copies run on side streams into pinned host buffers: gradients equal plain checkpointing
    (bit for bit on the torch path; the Triton path's weight-gradient atomics allow fp32 rounding), over two steps
    of a model big enough (1 MiB layer inputs) that a use-after-free would corrupt the recompute."""
    monkeypatch.setenv("LEANTUNE_BACKEND", backend)
    torch.manual_seed(0)
    model = tiny_llama_lora().cuda()
    leantune.patch(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=NON_REENTRANT)
    input_ids = torch.randint(3, VOCAB, (8, 512), device="cuda")  # [8, 512, 64] fp32 = 1 MiB per layer input
    ref = step(model, input_ids)
    offloader = enable_offloaded_checkpoints(model, min_bytes=1 << 20)
    for _ in range(2):
        result = step(model, input_ids)
        if backend == "torch":
            assert_bit_identical(result, ref)
        else:
            assert torch.allclose(result[0], ref[0], rtol=1e-6)
            for name, grad in result[1].items():
                assert torch.allclose(grad, ref[1][name], rtol=1e-5, atol=1e-7), name
    assert offloader.packed == 2 * LAYERS and offloader.prefetched == 2 * (LAYERS - 1)
    assert offloader.pool.buffers() and all(b.is_pinned() for b in offloader.pool.buffers())


# ------------------------------------------------------------------------------- the forced input-embedding grad
def _embedding_outputs(model) -> list:
    """Weak references to the embedding layer's outputs, one per forward (its forward wrapped: a hook of the caller's
    own would make leantune keep the leaf)."""
    made = []
    embeddings = model.get_input_embeddings()
    forward = embeddings.forward

    def recording_forward(*args, **kwargs):
        out = forward(*args, **kwargs)
        made.append(weakref.ref(out))
        return out

    embeddings.forward = recording_forward
    return made


@pytest.mark.parametrize("offloaded", [False, True], ids=["checkpointing", "offloaded"])
def test_forced_embedding_grad_dropped_under_non_reentrant_checkpointing(monkeypatch, offloaded):
    """``gradient_checkpointing_enable`` hooks the embedding output to require grad (reentrant checkpointing needs
    it). Under non-reentrant checkpointing leantune's forward detaches that leaf: nothing holds it once the forward
    is done (with offload, layer 0's input then lives on the host only), and the loss and every gradient are
    bit-identical to keeping it."""
    from leantune.patch import input_embeddings

    model = tiny_llama_lora()
    leantune.patch(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=NON_REENTRANT)
    if offloaded:
        enable_offloaded_checkpoints(model, min_bytes=0)
    made = _embedding_outputs(model)
    input_ids = torch.randint(3, VOCAB, (2, 37))
    with monkeypatch.context() as keep:
        keep.setattr(input_embeddings, "_detach_is_safe", lambda *args: False)  # the forced leaf kept, as HF does
        ref = step(model, input_ids)
        model.zero_grad(set_to_none=True)
        out = model(input_ids=input_ids, labels=input_ids)
        gc.collect()
        assert made[-1]() is not None and made[-1]().requires_grad, "the control must hold the forced leaf"
        del out
    model.zero_grad(set_to_none=True)
    out = model(input_ids=input_ids, labels=input_ids)
    gc.collect()
    assert made[-1]() is None, "the forced embedding leaf is still held after the forward"
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    assert_bit_identical((out.loss.detach(), grads), ref)


def test_forced_embedding_grad_kept_for_reentrant_checkpointing_and_trainable_embeddings():
    """Reentrant checkpointing needs the forced grad (without it layer 0's adapters would get none: ``step`` asserts
    every gradient is non-zero), also through torch's ``checkpoint_wrapper`` rather than transformers' switch; a
    trainable embedding is never cut off."""
    import functools

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    model = tiny_llama_lora()
    leantune.patch(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    step(model, torch.randint(3, VOCAB, (2, 37)))
    model = tiny_llama_lora()
    model.config.use_cache = False  # a cache would grow again in the reentrant recomputation
    model.enable_input_require_grads()
    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, LlamaDecoderLayer), checkpoint_wrapper_fn=
                                   functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.REENTRANT))
    leantune.patch(model)
    step(model, torch.randint(3, VOCAB, (2, 37)))
    model = tiny_llama_lora(modules_to_save=["embed_tokens"])
    leantune.patch(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=NON_REENTRANT)
    _, grads = step(model, torch.randint(3, VOCAB, (2, 37)))
    assert any("embed_tokens" in name for name in grads)


def test_embedding_gradient_read_through_a_hook_is_kept():
    """A caller who keeps the embedding output in a hook (saliency, attribution) reads its gradient as with HF.

    Both fp32 gradients are held to the float64 gradient of HF's model (docs/design.md, "Tests and tolerance"):
    norm-wise relative error <= 1e-5. An elementwise bar of atol 1e-6 (the earlier test) failed 1 draw in many:
    the rounding error of each element is a few eps32 times the size of the whole gradient (|g| up to ~1 here, 1.2e-7
    eps, ~2e-6 of it after two layers forward and back, HF's own fp32 path included), not of the element itself, so
    atol 1e-6 sat inside the rounding noise of either path; measured norm-wise errors are 1.5-2.5e-6 on both."""
    input_ids = torch.randint(3, VOCAB, (2, 19))
    grads = {}
    for name, patched, dtype in (("hf", False, torch.float32), ("leantune", True, torch.float32),
                                 ("float64", False, torch.float64)):
        torch.manual_seed(0)
        model = tiny_llama_lora().to(dtype)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=NON_REENTRANT)
        if patched:
            leantune.patch(model)
        kept = {}
        model.get_input_embeddings().register_forward_hook(lambda module, args, out, kept=kept: kept.update(out=out))
        model(input_ids=input_ids, labels=input_ids).loss.backward()
        grads[name] = kept["out"].grad
    assert all(grad is not None for grad in grads.values()), [name for name, g in grads.items() if g is None]
    for name in ("hf", "leantune"):
        err = rel_err(grads[name], grads["float64"])
        assert err <= 1e-5, f"{name}: relative error {err:.3g} of the embedding gradient against float64"


def test_detach_only_where_it_is_known_safe():
    """Detach needs transformers' checkpointing on and non-reentrant in every module that has it on (torch's
    checkpoint defaults to reentrant when the keyword is missing; leantune's offload wrapper is looked through), no
    forward hook on the embeddings but the requires-grad ones, and no torch checkpoint_wrapper in the model."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from leantune.patch.input_embeddings import _detach_is_safe

    model = tiny_llama_lora()
    base, embeddings = model.base_model.model.model, model.get_input_embeddings()
    assert not _detach_is_safe(base, embeddings)  # no checkpointing: not known to be safe
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=NON_REENTRANT)
    assert _detach_is_safe(base, embeddings)
    enable_offloaded_checkpoints(model, min_bytes=0)
    model(input_ids=torch.randint(3, VOCAB, (1, 9)))  # the pre-hook wraps each layer's function
    assert _detach_is_safe(base, embeddings)
    disable_offloaded_checkpoints(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={})  # torch's checkpoint: reentrant by default
    assert not _detach_is_safe(base, embeddings)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=NON_REENTRANT)
    handle = embeddings.register_forward_hook(lambda module, args, out: None)
    assert not _detach_is_safe(base, embeddings)
    handle.remove()
    base.layers[0].mlp = checkpoint_wrapper(base.layers[0].mlp)
    assert not _detach_is_safe(base, embeddings)


def test_checkpoint_reentrant_reads_transformers_partials():
    """One reading for offload and the embedding detach: use_reentrant missing is torch's default (reentrant); the
    offload wrapper is looked through; a callable that is not a partial cannot be read."""
    import functools

    from leantune.patch._model import checkpoint_reentrant
    from leantune.patch.offload import _OffloadedCheckpointFunc

    assert checkpoint_reentrant(functools.partial(checkpoint, use_reentrant=False)) is False
    assert checkpoint_reentrant(functools.partial(checkpoint, use_reentrant=True)) is True
    assert checkpoint_reentrant(functools.partial(checkpoint)) is True
    wrapped = _OffloadedCheckpointFunc(functools.partial(checkpoint, use_reentrant=False), CheckpointOffloader())
    assert checkpoint_reentrant(wrapped) is False
    assert checkpoint_reentrant(checkpoint) is None
