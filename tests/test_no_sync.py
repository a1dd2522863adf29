"""No device-to-host synchronisation in a patched training step (issue #25; docs/design.md, "No host sync in a step").

On the CPU nothing synchronises, so the test watches for the calls that would on a GPU: while a patched step runs
(forward, backward, optimizer step), every call of ``Tensor.item``, ``tolist``, ``__bool__``, ``__int__``,
``__float__``, ``__index__``, ``nonzero``, ``cpu``, ``masked_select``, ``torch.nonzero`` / ``masked_select`` /
``unique`` and boolean-mask indexing (a data-dependent size: a sync) made *from leantune's source* (the calling
frame's file under src/leantune) is recorded, and the test fails on any. ``train/data.py`` is exempt: it builds the
rows on the host (CPU tensors by construction) before they go to the device.

The GPU test (``-m gpu``) runs a patched step under ``torch.cuda.set_sync_debug_mode("error")``, which also catches
syncs no Python frame shows (pageable copies, transformers' own). The Triton-backend cases build their tensors and
model on ``conftest.DEVICE`` (the interpreter on the CPU, the card on CUDA); on CUDA the loss ops' case runs under
that debug mode as well (the ops alone: any sync there is leantune's).
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import pytest
import torch
from conftest import DEVICE
from test_patch_families import batch, tiny_config, tiny_model, tiny_peft_model
from torch.overrides import TorchFunctionMode

import leantune
from leantune import ops
from leantune.patch import document_attention

LEANTUNE = Path(leantune.__file__).resolve().parent
HOST_DATA = {LEANTUNE / "train" / "data.py"}
# torch's own Python wrappers between a caller and the method it called
WRAPPERS = tuple(str(Path(torch.__file__).parent / name) for name in ("_tensor.py", "overrides.py", "functional.py"))
TENSOR_METHODS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "cpu",
                  "masked_select")
TORCH_FUNCTIONS = ("nonzero", "masked_select", "unique")


class SyncCalls:
    """Records the watched calls made from leantune's source while installed (``calls``: "name at file:line")."""

    def __init__(self, monkeypatch):
        self.calls: list[str] = []
        self.on = False
        for name in TENSOR_METHODS:
            monkeypatch.setattr(torch.Tensor, name, self._wrap(getattr(torch.Tensor, name), f"Tensor.{name}"))
        for name in TORCH_FUNCTIONS:
            monkeypatch.setattr(torch, name, self._wrap(getattr(torch, name), f"torch.{name}"))
        # Boolean indexing is watched through a torch-function mode, not by assigning Tensor.__getitem__: CPython
        # keeps the sequence slot that assignment adds after monkeypatch deletes it again, and from then on
        # torch.tensor([0-d tensors]) calls len() on each (TRL's ORPO log did, in a later test of the same worker).
        self._indexing = _BooleanIndexing(self)

    def _wrap(self, original, label, only=None):
        def watched(*args, **kwargs):
            if self.on and (only is None or only(*args)):
                self._note(label)
            return original(*args, **kwargs)

        return watched

    def _note(self, label):
        frame = sys._getframe(2)
        while frame is not None and frame.f_code.co_filename.startswith(WRAPPERS):
            frame = frame.f_back
        if frame is None:
            return
        path = Path(frame.f_code.co_filename).resolve()
        if path.is_relative_to(LEANTUNE) and path not in HOST_DATA:
            self.calls.append(f"{label} at {path.relative_to(LEANTUNE)}:{frame.f_lineno} ({frame.f_code.co_name})")

    def __enter__(self):
        self.on = True
        self._indexing.__enter__()
        return self

    def __exit__(self, *exc):
        self.on = False
        self._indexing.__exit__(*exc)


class _BooleanIndexing(TorchFunctionMode):
    """Notes ``tensor[mask]`` and ``tensor[mask] = v`` with a boolean tensor index (a read of the mask's count)."""

    def __init__(self, calls: SyncCalls):
        super().__init__()
        self.calls = calls

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in ("__getitem__", "__setitem__") and _boolean_index(*args):
            self.calls._note(f"Tensor.{name}")
        return func(*args, **(kwargs or {}))


def _boolean_index(tensor, index, *value):
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(p, torch.Tensor) and p.dtype == torch.bool and p.dim() > 0 for p in parts)


@pytest.fixture
def watch(monkeypatch):
    return SyncCalls(monkeypatch)


@contextlib.contextmanager
def cuda_syncs_raise():
    """On CUDA, any synchronising CUDA call inside the block raises (``torch.cuda.set_sync_debug_mode("error")``),
    whoever makes it and whether or not a Python frame shows it; on the CPU nothing synchronises and the block runs
    as it is."""
    if DEVICE != "cuda":
        yield
        return
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _step(model, watch, **inputs):
    """A patched training step (forward, backward, AdamW step) under ``watch``; returns the loss."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    with watch:
        loss = model(**inputs).loss
        loss.sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    assert watch.calls == [], watch.calls
    return loss


def _packed_positions(rows, seq):
    """position_ids restarting at random document starts (every row packed with 2-3 documents)."""
    positions = torch.empty(rows, seq, dtype=torch.int64)
    for r in range(rows):
        cuts = sorted(torch.randperm(seq - 2)[:2].add(1).tolist())
        starts = [0, *cuts]
        for s, e in zip(starts, [*cuts, seq]):
            positions[r, s:e] = torch.arange(e - s)
    return positions


CASES = {
    "plain": {},
    "labels all ignored": {"ignored": True},
    "num_items int": {"num_items": 7},
    "num_items tensor": {"num_items": torch.tensor(7)},
    "num_items 1x1 tensor": {"num_items": torch.tensor([[9.0]])},
    "num_items 0 tensor, no targets": {"num_items": torch.tensor(0), "ignored": True},
    "num_items 0 tensor, targets (inf)": {"num_items": torch.tensor(0)},
    "packed rows": {"packed": True},
    "softcap gemma2": {"family": "gemma2"},
    "nf4": {"nf4": True},
    "offload checkpoints": {"offload": True},
    "tile_mlp": {"patch": {"tile_mlp": 4}},
    "lm_head LoRA (cross_entropy)": {"lora": {"target_modules": ["q_proj", "down_proj", "lm_head"]}},
    "lora dropout, checkpointed": {"lora": {"lora_dropout": 0.1}, "offload": True},
    "fp8": {"fp8": True},
    "dora": {"lora": {"use_dora": True}},
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_patched_step_reads_nothing_back(case, watch, monkeypatch):
    monkeypatch.setenv("LEANTUNE_BACKEND", "torch")
    model = tiny_peft_model(case.get("family", "llama"), **case.get("lora", {}))
    if case.get("nf4") or case.get("fp8"):
        leantune.quantize(model, "nf4" if case.get("nf4") else "fp8")
    if case.get("offload"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    leantune.patch(model, offload_checkpoints=case.get("offload", False), **case.get("patch", {}))
    model.train()
    input_ids, labels = batch(rows=2, seq=12)
    if case.get("ignored"):
        labels[:] = -100
    inputs = {"input_ids": input_ids, "labels": labels}
    if "num_items" in case:
        inputs["num_items_in_batch"] = case["num_items"]
    if case.get("packed"):
        inputs["position_ids"] = position_ids = _packed_positions(2, 12)
        document_attention.remember_documents(position_ids, position_ids.clone())
        _forbid_transformers_detection(monkeypatch)
    loss = _step(model, watch, **inputs)
    if case.get("ignored"):
        assert loss.item() == 0.0
    elif torch.is_tensor(case.get("num_items")) and not case["num_items"].any():
        assert torch.isinf(loss).all()  # HF's sum / 0
    else:
        assert torch.isfinite(loss).all()


@pytest.mark.parametrize("model_type,nf4", [("qwen3_moe", None), ("mixtral", None), ("gpt_oss", None),
                                           ("mixtral", "before")])
def test_patched_moe_step_reads_nothing_back(model_type, nf4, watch, monkeypatch):
    """MoE experts through ops.moe_experts (LoRA on the expert stacks, deferred index checks, aux loss on); gpt-oss:
    biased router, clamped SwiGLU experts, RoPE widened from per-frequency cos/sin, sinks and a sliding layer in
    ops.sink_attention (no masks built by transformers); with ``nf4`` the linears and expert stacks in NF4,
    dequantised inside the op (the offset a Python float)."""
    from test_patch_moe import VOCAB, tiny_moe_peft

    monkeypatch.setenv("LEANTUNE_BACKEND", "torch")
    model = tiny_moe_peft(model_type, nf4).train()
    if model_type != "gpt_oss":  # as on the card: SDPA, where transformers' packed-row check runs
        model.set_attn_implementation("sdpa")
    leantune.patch(model)
    assert model.leantune_summary["counts"]["experts_lora"] == 2
    # the MoE models expand leantune's [1, S] positions to [B, S]: still answered here (on the card transformers'
    # check synced for Qwen3-MoE and Mixtral while the known positions were a view not recognised)
    document_attention.remember_single_sequences(torch.zeros(1, 3, dtype=torch.long))  # the dispatcher in place
    _forbid_transformers_detection(monkeypatch)
    input_ids = torch.randint(3, VOCAB, (2, 12))
    assert torch.isfinite(_step(model, watch, input_ids=input_ids, labels=input_ids.clone(), use_cache=False)).all()


def _forbid_transformers_detection(monkeypatch):
    """transformers' packed-row detection ends in a host sync: with the documents told, it must not run."""
    from transformers import masking_utils

    def refuse(position_ids):
        raise AssertionError("transformers' find_packed_sequence_indices ran on positions leantune was told")

    monkeypatch.setattr(masking_utils.find_packed_sequence_indices, "_leantune_original", refuse)


def test_unpacked_rows_skip_transformers_packing_check(watch, monkeypatch):
    """Rows without position_ids or a mask: the causal-LM forward makes the positions itself and answers
    transformers' packed-row check (a host sync; under CUDA-graph capture a dense mask), with HF's loss."""
    monkeypatch.setenv("LEANTUNE_BACKEND", "torch")
    from peft import get_peft_model
    from test_patch_families import lora_config
    from transformers import AutoModelForCausalLM

    config = tiny_config("llama")
    config._attn_implementation = "sdpa"
    model = get_peft_model(AutoModelForCausalLM.from_config(config), lora_config()).train()
    input_ids, labels = batch(rows=2, seq=12)
    with torch.no_grad():
        expected = model(input_ids=input_ids, labels=labels).loss
    leantune.patch(model)
    document_attention.remember_single_sequences(torch.zeros(1, 3, dtype=torch.long))  # the dispatcher in place
    _forbid_transformers_detection(monkeypatch)
    loss = _step(model, watch, input_ids=input_ids, labels=labels)
    assert abs(loss.item() - expected.item()) <= 1e-5 * abs(expected.item())


@pytest.mark.parametrize("family", ["gemma2"])
def test_patched_step_reads_nothing_back_on_triton(family, watch, monkeypatch):
    """The Triton kernels' launch path (interpreter on the CPU, the card on CUDA): nothing read back either, softcap
    included. Not under the CUDA sync debug mode: HF's eager attention (Gemma-2's softcap) builds its mask from a CPU
    scalar, a sync of transformers'."""
    from peft import get_peft_model
    from test_patch_families import lora_config

    monkeypatch.setenv("LEANTUNE_BACKEND", "triton")
    model = leantune.patch(get_peft_model(tiny_model(family, layers=1).to(DEVICE), lora_config())).train()
    input_ids, labels = (t.to(DEVICE) for t in batch(rows=1, seq=6))
    num_items = torch.tensor(5, device=DEVICE)
    assert torch.isfinite(_step(model, watch, input_ids=input_ids, labels=labels, num_items_in_batch=num_items))


def test_document_attention_step_reads_nothing_back(watch, monkeypatch):
    """Per-document attention on packed rows, the documents told from the host copy of the positions."""
    monkeypatch.setenv("LEANTUNE_BACKEND", "torch")
    config = tiny_config("llama")
    config._attn_implementation = "sdpa"
    from peft import get_peft_model
    from test_patch_families import lora_config
    from transformers import AutoModelForCausalLM

    model = get_peft_model(AutoModelForCausalLM.from_config(config), lora_config())
    assert document_attention.use_document_attention(model.get_base_model()) is None
    leantune.patch(model).train()
    input_ids, labels = batch(rows=2, seq=12)
    position_ids = _packed_positions(2, 12)
    document_attention.remember_documents(position_ids, position_ids.clone())
    _forbid_transformers_detection(monkeypatch)
    assert torch.isfinite(_step(model, watch, input_ids=input_ids, labels=labels, position_ids=position_ids))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_patched_moe_step_has_no_sync_on_gpu(model_type):
    """An MoE step (router, experts through ops.moe_experts with LoRA on the stacks, the aux loss, AdamW) under
    set_sync_debug_mode("error"): HF's own no-mask aux loss (torch.bincount) would raise here. On SDPA: HF's eager
    attention builds its float mask from a CPU scalar (a sync of HF's, seen on the card). gpt-oss stays on eager
    (it refuses sdpa): its attention runs ops.sink_attention and, with no padding mask, leantune's causal-LM
    forward hands the base model no masks, so transformers' eager masks (that sync) are never built. No KV cache
    (the update of HF's sliding-window layer syncs: Mixtral failed with it on the card)."""
    from test_patch_moe import VOCAB, tiny_moe_peft

    torch.manual_seed(0)
    model = tiny_moe_peft(model_type, device="cuda").to(torch.bfloat16).train()
    if model_type != "gpt_oss":
        model.set_attn_implementation("sdpa")
    leantune.patch(model)
    if model_type == "gpt_oss":
        assert any("ops.sink_attention" in part for part in model.leantune_summary["fused"])
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, fused=True)
    input_ids = torch.randint(3, VOCAB, (2, 32), device="cuda")
    for checked in (False, True):
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error" if checked else "default")
        try:
            out = model(input_ids=input_ids, labels=input_ids, use_cache=False)  # HF's sliding-window cache syncs
            out.loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(out.loss) and out.aux_loss > 0


@pytest.mark.parametrize("op", ["cross_entropy", "linear_cross_entropy"])
@pytest.mark.parametrize("z_loss", [0.0, 1e-3])
def test_loss_ops_deferred_read_nothing_back(op, z_loss, watch, backend):
    """The public ops with checks="deferred", z-loss and softcap, tensor num_items, forward and backward; on CUDA also
    under the sync debug mode, after a warm-up call (the kernels compile outside the checked block)."""
    hidden = torch.randn(9, 16, device=DEVICE, requires_grad=True)
    weight = torch.randn(40, 16, device=DEVICE, requires_grad=True)
    labels = torch.randint(0, 40, (9,), device=DEVICE)
    labels[::3] = -100
    num_items = torch.tensor(4, device=DEVICE)  # made here: creating a CUDA tensor from a host value copies (a sync)

    def forward_backward():
        if op == "cross_entropy":
            loss = ops.cross_entropy(hidden @ weight.t(), labels, softcap=5.0, z_loss=z_loss, num_items=num_items,
                                     checks="deferred")
        else:
            loss = ops.linear_cross_entropy(hidden, weight, labels, softcap=5.0, z_loss=z_loss, num_items=num_items,
                                            checks="deferred")
        loss.backward()
        return loss

    if DEVICE == "cuda":
        forward_backward()
    with watch, cuda_syncs_raise():
        loss = forward_backward()
    assert watch.calls == [], watch.calls
    assert torch.isfinite(loss)


def test_trl_head_reads_nothing_back(watch, monkeypatch):
    """TRL's fused_lm_head calls served by leantune's head (with its statistics): no boolean-mask selection."""
    pytest.importorskip("trl")
    from leantune.integrations.trl import FusedLMHead

    monkeypatch.setenv("LEANTUNE_BACKEND", "torch")
    model = leantune.patch(tiny_peft_model("llama")).train()
    hf = model.get_base_model()
    hf.forward = FusedLMHead(hf, hf.forward, ("log_probs", "entropy", "is_top1", "mean_logits"), metrics=True)
    input_ids, labels = batch(rows=2, seq=12)
    labels[1, :5] = -100  # a prompt without targets
    loss = _step(model, watch, input_ids=input_ids, labels=labels, fused_lm_head=True)
    assert torch.isfinite(loss)


def test_leantune_train_graph_step_reads_nothing_back(tmp_path, watch, monkeypatch):
    """``leantune train --cuda-graphs``'s step through the CPU recorder (an eager warm-up step, then a captured one
    and a replay): nothing read back from leantune's code."""
    from test_train import tiny_config as train_config
    from test_train import write_chat_jsonl, write_tiny_model

    from leantune.train import loop

    monkeypatch.setattr(loop, "STEP_CAPTURE", lambda fn, stream: fn)
    monkeypatch.setattr(loop, "GRAPH_WARMUP", 1)
    tiny = {"model": write_tiny_model(tmp_path / "model"), "data": write_chat_jsonl(tmp_path / "chat.jsonl", n=30)}
    run = loop._prepare(train_config(tiny, tmp_path / "out", patch="on", grad_accum=2, max_steps=3,
                                     cuda_graphs=True))
    run.captured = loop.captured_step(run)
    params = [p for p in run.model.parameters() if p.requires_grad]
    for step in range(3):
        micro = [run.train_data.select(slice(k * 2, k * 2 + 2)) for k in range(2)]
        with watch:
            loss, grad_norm, lr = loop.train_step(run, micro, params)
        assert watch.calls == [], (step, watch.calls)
        assert torch.is_tensor(loss) and torch.is_tensor(grad_norm) and isinstance(lr, float)
    assert run.captured._micro is not None  # steps 2 and 3 went through the recorded graphs


def test_leantune_train_step_reads_nothing_back(tmp_path, watch):
    """``leantune train``'s step (two micro-batches, patched, clipping, AdamW, schedule) and its step record."""
    from test_train import tiny_config as train_config
    from test_train import write_chat_jsonl, write_tiny_model
    from tqdm.auto import tqdm

    from leantune.train import loop, step_log

    tiny = {"model": write_tiny_model(tmp_path / "model"), "data": write_chat_jsonl(tmp_path / "chat.jsonl", n=30)}
    run = loop._prepare(train_config(tiny, tmp_path / "out", patch="on", grad_accum=2, max_steps=2))
    log = step_log.StepLog(run, tqdm(disable=True))
    params = [p for p in run.model.parameters() if p.requires_grad]
    micro = [run.train_data.select(slice(k * 2, k * 2 + 2)) for k in range(2)]
    with watch:
        timer = log.start()
        loss, grad_norm, lr = loop.train_step(run, micro, params)
        log.record(1, timer, loss, grad_norm, lr, 128)
    assert watch.calls == [], watch.calls
    assert torch.is_tensor(loss) and torch.is_tensor(grad_norm) and len(log.pending) == 1
    # the record is read at the log point: the values the step left on the device
    from leantune.errors import LeantuneError
    from leantune.train.metrics import MetricsLog

    run.metrics = MetricsLog(tmp_path / "metrics.jsonl")
    run.metrics.reset()
    log.flush()
    record = run.metrics.read()[-1]
    assert record["step"] == 1 and record["loss"] == loss.item() and record["grad_norm"] == grad_norm.item()
    # a bad label in a later step: its flag travels with the step's numbers, the log point raises
    labels = torch.tensor([3, 10**6])
    bad = ops.cross_entropy(torch.randn(2, 259), labels, checks="deferred")
    log.record(2, log.start(), bad, grad_norm, lr, 128)
    with pytest.raises(LeantuneError, match=r"labels must be in \[0, 259\).*found 1000000"):
        log.flush()


def test_bad_label_inside_a_step_gives_nan_then_the_error_at_the_log_point(monkeypatch):
    """A label outside [0, V) in a patched step: the kernels ignore it (no out-of-bounds read), the loss is NaN, and
    ops.raise_deferred_errors() raises the op's ValueError once (the flag is cleared)."""
    monkeypatch.setenv("LEANTUNE_BACKEND", "torch")
    model = leantune.patch(tiny_peft_model("llama")).train()
    input_ids, labels = batch(rows=1, seq=8)
    labels[0, 3] = 1000 + 17  # the vocabulary is 1000
    loss = model(input_ids=input_ids, labels=labels).loss
    assert torch.isnan(loss)
    loss.backward()  # the gradients of the other tokens stay finite
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    with pytest.raises(ValueError, match=r"labels must be in \[0, 1000\) or equal ignore_index=-100; found 1017"):
        ops.raise_deferred_errors()
    ops.raise_deferred_errors()  # cleared
    with pytest.raises(ValueError, match="found 1017"):  # the public default still raises at once
        ops.cross_entropy(torch.randn(8, 1000), labels[0])


def test_watch_catches_a_read_back(watch, monkeypatch):
    """The watch itself: a ``.item()`` made from a file under src/leantune inside a loss backward (the kind of the
    old grad-output shortcut) is reported, with its place; the same call from the test's own code is not."""
    module = sys.modules["leantune.ops.cross_entropy"]
    namespace = {"original": module.row_scale}
    source = "def row_scale(grad_output, reduction, divisor):\n    grad_output.item()\n" \
             "    return original(grad_output, reduction, divisor)\n"
    exec(compile(source, module.__file__, "exec"), namespace)  # noqa: S102 - code that runs as leantune's
    monkeypatch.setattr(module, "row_scale", namespace["row_scale"])
    logits = torch.randn(4, 10, requires_grad=True)
    with watch:
        ops.cross_entropy(logits, torch.randint(0, 10, (4,)), checks="deferred").backward()
        logits.sum().item()  # the test's own read: not leantune's
    assert watch.calls == ["Tensor.item at ops/cross_entropy.py:2 (row_scale)"], watch.calls


def test_watch_catches_boolean_indexing_and_leaves_tensor_alone(watch):
    """``x[mask]`` from leantune's source is reported (a read of the mask's count); after the watch, torch.tensor
    of 0-d tensors still works (a Tensor class patched at __getitem__ once broke it for the rest of the process)."""
    namespace = {}
    source = "def pick(x, mask):\n    return x[mask]\n"
    exec(compile(source, sys.modules["leantune.ops.cross_entropy"].__file__, "exec"), namespace)  # noqa: S102
    x = torch.randn(5)
    with watch:
        namespace["pick"](x, x > 0)
        x[x > 0]  # the test's own: not leantune's
    assert watch.calls == ["Tensor.__getitem__ at ops/cross_entropy.py:2 (pick)"], watch.calls
    assert torch.tensor([torch.tensor(1.0), torch.tensor(2.0)]).tolist() == [1.0, 2.0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", ["plain", "num_items tensor", "labels all ignored", "packed rows", "tile_mlp"])
def test_patched_step_has_no_sync_on_gpu(case):
    """The whole step under torch.cuda.set_sync_debug_mode("error"): any synchronising CUDA call raises, whoever
    makes it (leantune, transformers, torch)."""
    torch.manual_seed(0)
    from peft import get_peft_model
    from test_patch_families import lora_config
    from transformers import AutoModelForCausalLM

    config = tiny_config("llama")
    config._attn_implementation = "sdpa"  # eager attention builds its float mask from a CPU scalar (a sync of HF's)
    model = AutoModelForCausalLM.from_config(config).to("cuda", torch.bfloat16)

    model = get_peft_model(model, lora_config())
    leantune.patch(model, tile_mlp=4 if case == "tile_mlp" else None).train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-3, fused=True)
    input_ids, labels = batch(rows=2, seq=64)
    if case == "labels all ignored":
        labels[:] = -100
    inputs = {"input_ids": input_ids.cuda(), "labels": labels.cuda()}
    if case == "num_items tensor":
        inputs["num_items_in_batch"] = torch.tensor(50, device="cuda")
    if case == "packed rows":
        host = _packed_positions(2, 64)
        inputs["position_ids"] = host.cuda()
        document_attention.remember_documents(inputs["position_ids"], host)
    for checked in (False, True):  # the first step warms up (compilation, allocations), the second is checked
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error" if checked else "default")
        try:
            loss = model(**inputs).loss
            loss.sum().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(loss).all() or case == "labels all ignored"


@pytest.mark.parametrize("op", ["cross_entropy", "linear_cross_entropy"])
def test_deferred_bad_label_is_ignored_by_the_kernels(op, backend):
    """Both backends: a label past V (or negative) never reaches a kernel's index; the other rows' gradients are
    those of the same call with the bad rows ignored, and the loss is NaN."""
    hidden = torch.randn(6, 16, device=DEVICE, requires_grad=True)
    weight = torch.randn(30, 16, device=DEVICE)
    labels = torch.randint(0, 30, (6,), device=DEVICE)
    labels[1], labels[4] = 30 + 10**9, -7
    ignored = labels.clone()
    ignored[1] = ignored[4] = -100

    def run(lab, checks):
        if op == "cross_entropy":
            return ops.cross_entropy(hidden @ weight.t(), lab, checks=checks)
        return ops.linear_cross_entropy(hidden, weight, lab, checks=checks)

    loss = run(labels, "deferred")
    (grad,) = torch.autograd.grad(loss, hidden)
    ref = run(ignored, "eager")
    (ref_grad,) = torch.autograd.grad(ref, hidden)
    assert torch.isnan(loss) and torch.equal(grad, ref_grad)
    with pytest.raises(ValueError, match=f"found {30 + 10**9}"):
        ops.raise_deferred_errors()
