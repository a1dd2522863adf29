"""torch.compile through leantune's ops and a patched model (docs/design.md, "torch.compile").

Each case compiles with ``fullgraph=True`` (a graph break raises), counts the frames dynamo compiled (one graph, and
none more on a second call with the same shapes: no recompile) and compares the compiled forward and its gradients
with the same call run eagerly: fp32, relative error <= 1e-5. The eager results themselves are proven against
float64 in each op's own test file. Torch backend on the CPU; the Triton path compiles on the GPU (``-m gpu``).
"""

from __future__ import annotations

import gc

import pytest
import torch
import torch._dynamo
import torch._dynamo.testing
from conftest import ON_GPU
from reference import rel_err
from test_patch_families import batch, tiny_peft_model

import leantune
from leantune import ops
from leantune.ops import _runtime


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _leaves(*shapes, device="cpu"):
    return [torch.randn(shape, device=device, requires_grad=True) for shape in shapes]


def _lora(out_features, in_features, rank=3, device="cpu"):
    weight = torch.randn(out_features, in_features, device=device) / in_features**0.5
    lora_A, lora_B = _leaves((rank, in_features), (out_features, rank), device=device)
    return ops.LoraWeights(weight, lora_A, lora_B, 1.5)


def _cases(device="cpu"):
    """(name, fn(*leaves) -> scalar, leaves): one call of each public op, tiny and off any block size."""
    n, h, v = 7, 24, 13
    labels = torch.randint(0, v, (n,), device=device)
    labels[2] = -100
    cos, sin = torch.randn(5, 6, device=device), torch.randn(5, 6, device=device)  # partial rotary: 6 of 8 dims
    lm_head = torch.randn(v, h, device=device) / h**0.5
    q, k, v_, gate, up, down = (_lora(12, h, device=device), _lora(6, h, device=device), _lora(6, h, device=device),
                                _lora(10, h, device=device), _lora(10, h, device=device), _lora(h, 10, device=device))

    def lora_params(*projections):
        return [t for p in projections for t in (p.lora_A, p.lora_B)]

    return [
        ("rms_norm", lambda x, w: ops.rms_norm(x, w).square().sum(), _leaves((2, n, h), (h,), device=device)),
        ("rms_norm gemma", lambda x, w: ops.rms_norm(x, w, offset=1.0, casting="gemma").square().sum(),
         _leaves((n, h), (h,), device=device)),
        ("rope", lambda a, b: sum((t * t).sum() for t in ops.rope(a, b, cos, sin)),
         _leaves((2, 3, 5, 8), (2, 1, 5, 8), device=device)),
        ("swiglu", lambda g, u: ops.swiglu(g, u).square().sum(), _leaves((n, 10), (n, 10), device=device)),
        ("geglu", lambda g, u: ops.geglu(g, u, approximate="none").square().sum(),
         _leaves((n, 10), (n, 10), device=device)),
        ("cross_entropy", lambda z: ops.cross_entropy(z, labels, label_smoothing=0.1, z_loss=1e-3, checks="deferred"),
         _leaves((n, v), device=device)),
        ("linear_cross_entropy fast",
         lambda x: ops.linear_cross_entropy(x, lm_head, labels, softcap=5.0, checks="deferred"),
         _leaves((n, h), device=device)),
        ("linear_cross_entropy low",
         lambda x: ops.linear_cross_entropy(x, lm_head, labels, memory="low", checks="deferred"),
         _leaves((n, h), device=device)),
        ("lora_linear", lambda x, *_: ops.lora_linear(x, *q).square().sum(),
         [*_leaves((n, h), device=device), *lora_params(q)]),
        ("lora_qkv", lambda x, *_: sum((t * t).sum() for t in ops.lora_qkv(x, q, k, v_)),
         [*_leaves((n, h), device=device), *lora_params(q, k, v_)]),
        ("lora_mlp", lambda x, *_: ops.lora_mlp(x, gate, up, down).square().sum(),
         [*_leaves((2, n, h), device=device), *lora_params(gate, up, down)]),
        ("lora_linear dropout", lambda x, *_: ops.lora_linear(x, *q, dropout=0.3).square().sum(),
         [*_leaves((n, h), device=device), *lora_params(q)]),
        ("lora_mlp dropout", lambda x, *_: ops.lora_mlp(x, gate, up, down, dropout=0.3).square().sum(),
         [*_leaves((n, h), device=device), *lora_params(gate, up, down)]),
    ]


def _value_and_grads(fn, leaves, seed=0):
    for t in leaves:
        t.grad = None
    torch.manual_seed(seed)  # the same dropout seeds for the compiled and the eager call
    value = fn(*leaves)
    value.backward()
    return value.detach(), [t.grad.clone() for t in leaves]


def _compiled_matches_eager(fn, leaves, backend="aot_eager", tol=1e-5):
    counter = torch._dynamo.testing.CompileCounterWithBackend(backend)
    compiled = torch.compile(fn, fullgraph=True, backend=counter)
    value, grads = _value_and_grads(compiled, leaves)
    ref_value, ref_grads = _value_and_grads(fn, leaves)
    assert torch.isfinite(ref_value), "eager value is not finite"
    assert rel_err(value, ref_value) <= tol, f"value: {rel_err(value, ref_value):.3g}"
    for i, (g, ref) in enumerate(zip(grads, ref_grads)):
        assert ref.norm() > 0, f"grad {i}: eager gradient is zero"
        assert rel_err(g, ref) <= tol, f"grad {i}: relative error {rel_err(g, ref):.3g}"
    assert counter.frame_count == 1, f"{counter.frame_count} graphs compiled"
    with torch.no_grad():
        for t in leaves:
            t.copy_(torch.randn_like(t))
    _value_and_grads(compiled, leaves)  # new values, same shapes
    assert counter.frame_count == 1, "a second call with the same shapes recompiled"


@pytest.mark.parametrize("index", range(len(_cases())), ids=[name for name, _, _ in _cases()])
def test_each_op_compiles_fullgraph_like_eager(index, monkeypatch):
    monkeypatch.setenv("LEANTUNE_BACKEND", "torch")
    _, fn, leaves = _cases()[index]
    _compiled_matches_eager(fn, leaves)


@pytest.mark.parametrize("targets, rope", [("all", True), ("mlp", True), ("mlp", False)],
                         ids=["lora-all", "lora-mlp", "lora-mlp-rope-off"])
def test_patched_model_training_step_compiles_fullgraph_like_eager(targets, rope, monkeypatch):
    """A patched Llama + PEFT LoRA model with (non-reentrant) gradient checkpointing: forward, fused loss and
    backward in one graph (no RoPE-flag, import, input-embedding hook or deferred-flag breaks), the loss and every
    LoRA gradient as the eager step's, no recompile for a new batch, and ``ops.rope`` in the graph exactly when the
    rope kind is on. LoRA on the MLP only: eager runs HF's attention forward (the rope kind in a flag its dispatcher
    reads) while the compiled step runs leantune's copy (the kind passed as an argument: no flag to mutate in the
    checkpointed layer, which torch 2.11 cannot trace), or HF's forward with no flag when the kind is off."""
    monkeypatch.setenv("LEANTUNE_BACKEND", "torch")
    mlp = ["gate_proj", "up_proj", "down_proj"]
    model = tiny_peft_model("llama", **({"target_modules": mlp} if targets == "mlp" else {}))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    leantune.patch(model, rope=rope)
    model.train()
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}

    def step(input_ids, labels):
        return model(input_ids=input_ids, labels=labels, use_cache=False).loss

    def loss_and_grads(fn, input_ids, labels):
        model.zero_grad(set_to_none=True)
        loss = fn(input_ids, labels)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in params.items()}

    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    # earlier tests' patched models, collected mid-trace, would restore HF's apply_rotary_pos_emb (their
    # finalizers) after dynamo read leantune's dispatcher: its guard on the closure then fails (seen on the card)
    gc.collect()
    compiled = torch.compile(step, fullgraph=True, backend=counter)
    input_ids, labels = batch()
    loss, grads = loss_and_grads(compiled, input_ids, labels)
    ref_loss, ref_grads = loss_and_grads(step, input_ids, labels)
    assert torch.isfinite(ref_loss) and rel_err(loss, ref_loss) <= 1e-5
    for name, ref in ref_grads.items():
        assert ref.norm() > 0, name
        assert rel_err(grads[name], ref) <= 1e-5, f"{name}: {rel_err(grads[name], ref):.3g}"
    assert counter.frame_count == 1
    graph_code = "".join(g.print_readable(print_output=False) for g in counter.graphs)
    assert ("in _rope_torch" in graph_code) == rope, f"ops.rope {'not ' if rope else ''}traced with rope={rope}"
    input_ids, labels = batch()
    loss_and_grads(compiled, input_ids, labels)
    assert counter.frame_count == 1, "a new batch of the same shape recompiled"
    leantune.unpatch(model)


@pytest.mark.parametrize("dynamic", [None, True], ids=["automatic-dynamic", "dynamic"])
def test_patched_step_compiles_fullgraph_over_lengths_and_a_tensor_count(dynamic, monkeypatch):
    """A new sequence length (dynamo then makes it symbolic, or dynamic=True from the start, where Python floats are
    symbolic inputs too) and num_items_in_batch as a tensor (what HF's Trainer passes): still one graph each time,
    the eager loss. RoPE's layout is read from symbolic strides without sorted(key=...); the options' value checks
    do not run on symbolic numbers; the loss's dtype follows torch's promotion without torch.result_type."""
    monkeypatch.setenv("LEANTUNE_BACKEND", "torch")
    model = leantune.patch(tiny_peft_model("llama")).train()

    def step(input_ids, labels, num_items):
        return model(input_ids=input_ids, labels=labels, num_items_in_batch=num_items, use_cache=False).loss

    gc.collect()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager", dynamic=dynamic)
    for seq in (9, 13):
        input_ids, labels = batch(seq=seq)
        count = (labels[:, 1:] != -100).sum()
        loss = compiled(input_ids, labels, count)
        loss.backward()
        assert rel_err(loss.detach(), step(input_ids, labels, count).detach()) <= 1e-5, seq
    leantune.unpatch(model)


def test_nf4_model_compiles_as_one_graph(monkeypatch):
    """QLoRA through leantune.quantize: the NF4 values are a constant of the graph while tracing (the cached tables'
    build reads Python lists), so the step is one frame, as the eager one in loss and gradients."""
    monkeypatch.setenv("LEANTUNE_BACKEND", "torch")
    model = tiny_peft_model("llama")
    leantune.quantize(model, "nf4")
    leantune.patch(model).train()
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}

    def step(input_ids, labels):
        return model(input_ids=input_ids, labels=labels, use_cache=False).loss

    input_ids, labels = batch()
    results = []
    gc.collect()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    for fn in (step, torch.compile(step, fullgraph=True, backend=counter)):
        model.zero_grad(set_to_none=True)
        loss = fn(input_ids, labels)
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in params.items()}))
    (ref, ref_grads), (loss, grads) = results
    assert counter.frame_count == 1 and rel_err(loss, ref) <= 1e-6
    assert all(rel_err(grads[n], ref_grads[n]) <= 1e-5 for n in grads)
    leantune.unpatch(model)


def test_eager_label_checks_break_the_graph_deferred_ones_do_not(monkeypatch):
    """``checks="eager"`` reads the labels on the host (documented): without fullgraph it costs one graph break and
    still gives the eager loss; ``checks="deferred"`` (what the patch passes) traces as one graph."""
    monkeypatch.setenv("LEANTUNE_BACKEND", "torch")
    logits = torch.randn(6, 11)
    labels = torch.randint(0, 11, (6,))
    eager = torch._dynamo.explain(lambda z, y: ops.cross_entropy(z, y))(logits, labels)
    deferred = torch._dynamo.explain(lambda z, y: ops.cross_entropy(z, y, checks="deferred"))(logits, labels)
    assert eager.graph_break_count == 1 and deferred.graph_break_count == 0
    compiled = torch.compile(lambda z, y: ops.cross_entropy(z, y), backend="aot_eager")
    assert rel_err(compiled(logits, labels), ops.cross_entropy(logits, labels)) <= 1e-6


def test_inductor_compiles_rms_norm_and_swiglu(monkeypatch):
    """Inductor (C++ codegen on the CPU) over the torch path of two ops in one graph, gradients included."""
    monkeypatch.setenv("LEANTUNE_BACKEND", "torch")
    _compiled_matches_eager(lambda x, w, u: ops.swiglu(ops.rms_norm(x, w), u).square().sum(),
                            _leaves((5, 12), (12,), (5, 12)), backend="inductor")


# Seen on the card (torch 2.11.0+cu130, triton 3.6, 2026-12-02): inductor's recompile of the fused loss's forward
# kernel with HAS_SOFTCAP and WRITE_GRAD on failed ("Triton compilation failed: _cross_entropy_forward_kernel_0",
# no more detail kept); aot_eager runs the same launch. Strict: a pass there fails this test, so docs/design.md
# ("torch.compile") is corrected when it changes.
_INDUCTOR_XFAIL = {"linear_cross_entropy fast": "inductor could not compile the fused loss's softcap forward kernel "
                                               "(torch 2.11, triton 3.6; cause unknown)"}


def _triton_params():
    for backend in ("aot_eager", "inductor"):
        for index, (name, _, _) in enumerate(_cases()):
            reason = _INDUCTOR_XFAIL.get(name) if backend == "inductor" else None
            marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
            yield pytest.param(index, backend, id=f"{name}-{backend}", marks=marks)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (Triton kernels under dynamo)")
@pytest.mark.parametrize("index, backend", _triton_params())
def test_triton_path_compiles(index, backend, monkeypatch):
    """The Triton launches inside the ops' nodes, traced by dynamo as user-defined Triton kernels."""
    import torch._inductor.config

    monkeypatch.setenv("LEANTUNE_BACKEND", "triton")
    monkeypatch.setattr(torch._inductor.config, "fallback_random", True)  # dropout seeds drawn as eager draws them
    _, fn, leaves = _cases("cuda")[index]
    assert _runtime.backend(leaves[0].device) == "triton"
    _compiled_matches_eager(fn, leaves, backend=backend)
