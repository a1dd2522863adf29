"""A whole LoRA training step (forward, backward, optimizer step) captured once in CUDA graphs and replayed.

Why (docs/design.md, "The host"): a patched 8B step queues ~4,000 kernels, and on the lent H200 host issuing them
takes longer than the GPU takes to run them, so the host sets the pace of an eager step. A CUDA graph replays the
whole step's kernels with one host call: the GPU then runs back to back whatever the host's speed.

What is captured, per shape of micro-batch (every call must have the same keys, shapes and dtypes):
- ``micro``: ``loss = model(**batch).loss * loss_scale``, then backward; the gradients accumulate in place into
  each trainable parameter's ``.grad`` (allocated once, before capture);
- ``update``: optional ``clip_grad_norm_``, ``optimizer.step()``, then the gradients zeroed in place.
A step of K micro-batches replays ``micro`` K times, then ``update`` once. The batch is copied into static input
buffers before each replay; the loss returned is a fresh tensor (a copy of the static one), never read back here.

Conditions (checked before anything is captured, ValueError naming what is wrong):
- a CUDA model; an optimizer that can be captured (torch's Adam/AdamW/SGD with ``capturable=True``); every
  param group's learning rate a tensor, so that a scheduler's updates (``fill_``) reach the graph: float rates are
  converted to device tensors here;
- nothing in the step reads a value back to the host (leantune's patched ops do not; see docs/design.md);
- the step runs on a stream of its own from its first eager step on: work queued to the legacy default stream
  cannot be joined to a capture, and torch's backward syncs each leaf's gradient with the stream the leaf's first
  gradient was formed on (measured on the H200, torch 2.11: capture failed after eager steps on the default stream
  and succeeded when every step ran on a side stream). So construct this before the model's first backward.

The first ``warmup`` steps run eagerly on that stream (cuBLAS workspaces, Triton compilation, lazy module loads
happen outside the capture); the next step captures and replays. If capture fails, the step warns once and runs
eagerly from then on (same results, host-paced).
"""

from __future__ import annotations

import contextlib
import math
import numbers
import warnings
from collections.abc import Callable, Mapping, Sequence

import torch

from .ops._runtime import check_real

__all__ = ["CapturedStep", "graphable_optimizer"]


def _cuda_graph_capture(fn: Callable[[], None], stream) -> Callable[[], None]:
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        fn()
    return graph.replay


def _same(a, b) -> bool:
    """Whether two non-tensor batch values are the same: ``==`` (numbers of any type, NaN equal to NaN; an array's
    elementwise == has no single truth value: the same type and all equal)."""
    if a is b:
        return True
    if isinstance(a, numbers.Number) and isinstance(b, numbers.Number):
        return bool(a == b) or (isinstance(a, numbers.Real) and isinstance(b, numbers.Real)
                                and math.isnan(a) and math.isnan(b))
    try:
        return type(a) is type(b) and bool(a == b)
    except (TypeError, ValueError, RuntimeError):
        return False


class CapturedStep:
    """Training steps of ``model`` with ``optimizer``, replayed from CUDA graphs after ``warmup`` eager steps.

    Args:
        model: a (patched) causal LM whose forward returns ``.loss``.
        optimizer: a torch optimizer over the trainable parameters, created with ``capturable=True``.
        max_grad_norm: clip the global gradient norm to this before each update (None: no clipping).
        loss_scale: each micro-batch's loss is multiplied by this before backward (e.g. the world size under DDP).
        warmup: eager steps before the capture (>= 1).
        capture: ``capture(fn, stream) -> replay`` (default: CUDA graphs on CUDA; on any other device the steps
            stay eager). Tests pass a recorder that replays ``fn`` by calling it.
        prepare: ``prepare(inputs)``, called with each micro-batch's tensor inputs just before its forward (the
            caller's tensors in eager steps, the static buffers at capture): e.g. ``leantune train`` tells the
            attention code the documents of its packed rows from their host copy.

    Call ``step(batches)`` with one batch (a mapping of model keyword arguments) or a sequence of micro-batches;
    returns ``(loss_sum, grad_norm)`` as device tensors (grad_norm None without clipping), never synchronising.

    On a device without CUDA graphs the steps run eagerly, with one ``RuntimeWarning`` at construction
    (``eager_reason`` says why), as after a failed capture. A model with modules in eval mode (transformers'
    ``from_pretrained`` leaves it there, and ``get_peft_model`` does not change it) warns once at the first step:
    its forwards form the logits and turn dropout off; call ``model.train()`` first. A step that raises leaves no
    gradient behind, and the batch layout is fixed by the first step that succeeds.

    Raises:
        ValueError: a model that is not callable, an optimizer that cannot be captured, ``warmup`` not an int >= 1,
            ``capture`` or ``prepare`` given and not callable,
            ``max_grad_norm`` not None or a finite number > 0, ``loss_scale`` not a finite number, a batch whose
            keys, shapes or dtypes differ from the first one's, a non-tensor argument that changes between calls
            (non-tensor values are compared by ``==``; an array is the same only as the same object), a model output
            without ``.loss`` (a batch without labels).
    """

    def __init__(self, model, optimizer, *, max_grad_norm: float | None = None, loss_scale: float = 1.0,
                 warmup: int = 3, capture: Callable | None = None, prepare: Callable | None = None):
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
            raise ValueError(f"warmup must be an int >= 1 (eager steps before the capture), got {warmup!r}")
        if max_grad_norm is not None:
            max_grad_norm = check_real("max_grad_norm", max_grad_norm, low=0.0, low_open=True,
                                       expected="None or a finite number > 0")
        loss_scale = check_real("loss_scale", loss_scale)
        for name, fn in (("capture", capture), ("prepare", prepare)):
            if fn is not None and not callable(fn):
                raise ValueError(f"{name} must be None or a callable, got {type(fn).__name__}")
        if not callable(model):
            raise ValueError(f"model must be a callable causal LM (its forward returns .loss), got "
                             f"{type(model).__name__}")
        if not hasattr(optimizer, "param_groups"):
            raise ValueError(f"optimizer must be a torch optimizer, got {type(optimizer).__name__}")
        self.model, self.optimizer = model, optimizer
        self.params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
        if not self.params:
            raise ValueError("optimizer has no parameter that requires grad")
        self.device = self.params[0].device
        self.max_grad_norm, self.loss_scale, self.warmup = max_grad_norm, loss_scale, warmup
        self._prepare = prepare
        self._capture = capture if capture is not None else (
            _cuda_graph_capture if self.device.type == "cuda" else None)
        if self._capture is _cuda_graph_capture:
            self._check_optimizer()
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.steps = 0
        self.eager_reason: str | None = None if self._capture else f"no CUDA graphs on {self.device.type}"
        if self.eager_reason is not None:
            warnings.warn(f"leantune CapturedStep: {self.eager_reason}; the steps run eagerly", RuntimeWarning,
                          stacklevel=2)
        self._layout: tuple | None = None  # (signature, constants) of the first step that succeeded
        self._static: dict[str, torch.Tensor] = {}
        self._constants: dict = {}
        self._micro = self._update = None
        self._static_loss = self._static_norm = None

    # ------------------------------------------------------------------------------------------------ checks
    def _check_optimizer(self) -> None:
        for i, group in enumerate(self.optimizer.param_groups):
            if "capturable" in group and not group["capturable"]:
                raise ValueError(f"optimizer param group {i} is not capturable: create it with capturable=True, "
                                 f"e.g. torch.optim.AdamW(params, lr=..., fused=True, capturable=True)")
            if not isinstance(group["lr"], torch.Tensor):  # a float would be baked into the graph
                group["lr"] = torch.tensor(float(group["lr"]), dtype=torch.float32, device=self.device)

    def _split(self, batch: Mapping, layout: tuple | None):
        """(tensor inputs, (signature, constants)) of one batch, checked against ``layout``: the step's fixed one,
        or this call's first micro-batch's while no step has succeeded (committed by :meth:`step`)."""
        if not isinstance(batch, Mapping):
            raise ValueError(f"each batch must be a mapping of model keyword arguments, got {type(batch).__name__}")
        tensors = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
        constants = {k: v for k, v in batch.items() if not isinstance(v, torch.Tensor)}
        signature = {k: (tuple(v.shape), v.dtype) for k, v in tensors.items()}
        if layout is None:
            return tensors, (signature, constants)
        fixed, fixed_constants = layout
        if signature != fixed:
            diff = sorted(set(signature) ^ set(fixed)) or [k for k in signature if signature[k] != fixed[k]]
            k = diff[0]

            def shown(sig):
                return "missing" if sig is None else f"{sig[0]} {str(sig[1]).replace('torch.', '')}"

            raise ValueError(f"batch[{k!r}] is {shown(signature.get(k))}, but the captured step was built for "
                             f"{shown(fixed.get(k))}: every batch of a captured step needs the same keys, "
                             "shapes and dtypes (pad or pack rows to one length)")
        elif changed := [k for k in set(constants) | set(fixed_constants)
                         if not _same(constants.get(k), fixed_constants.get(k))]:
            k = changed[0]
            raise ValueError(f"batch[{k!r}] changed from {fixed_constants.get(k)!r} to {constants.get(k)!r}: "
                             "non-tensor arguments are fixed at capture (also where the steps run eagerly: the "
                             "same code then captures on a GPU)")
        return tensors, layout

    def _warn_eval_mode(self) -> None:
        modules = getattr(self.model, "named_modules", None)  # a plain callable model has none
        names = [n for n, m in modules() if not m.training] if callable(modules) else []
        if names:
            warnings.warn(f"leantune CapturedStep: {len(names)} modules of the model are in eval mode (e.g. "
                          f"{names[0] or 'the model itself'}; transformers' from_pretrained leaves a model in eval "
                          "mode and get_peft_model does not change it): eval-mode forwards form the [tokens, vocab] "
                          "logits and turn dropout off; call model.train() before training", RuntimeWarning,
                          stacklevel=3)

    # ------------------------------------------------------------------------------------------------ passes
    def _micro_pass(self, inputs: Mapping) -> torch.Tensor:
        if self._prepare is not None:
            self._prepare(inputs)
        loss = self.model(**inputs, **self._constants).loss
        if loss is None:
            raise ValueError("the model returned no loss: every batch of a CapturedStep needs labels")
        (loss * self.loss_scale if self.loss_scale != 1.0 else loss).backward()
        return loss.detach()

    def _update_pass(self):
        norm = None
        if self.max_grad_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm, foreach=True)
        self.optimizer.step()
        for p in self.params:
            p.grad.zero_()  # in place: the captured backward accumulates into these buffers
        return norm

    def _eager_step(self, micro: list) -> tuple:
        total = None
        for batch in micro:
            loss = self._micro_pass(batch)
            total = loss.float() if total is None else total + loss.float()
        for p in self.params:
            if p.grad is None:  # a parameter this step did not reach: a zero buffer, as the captured step has
                p.grad = torch.zeros_like(p)
        return total, self._update_pass()

    def _capture_graphs(self, first: Mapping) -> None:
        self._static = {k: v.clone() for k, v in first.items()}
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()  # the eager steps' cached blocks; the graphs keep a pool of their own

        def micro():
            self._static_loss = self._micro_pass(self._static)

        def update():
            self._static_norm = self._update_pass()

        self._micro = self._capture(micro, self.stream)
        self._update = self._capture(update, self.stream)

    # ------------------------------------------------------------------------------------------------ step
    def step(self, batches) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One optimizer step over ``batches`` (a mapping, or a sequence of mappings: micro-batches).
        Returns ``(loss_sum, grad_norm)``: the sum of the micro-batches' (unscaled) losses, fp32, and the
        global gradient norm before clipping (None when ``max_grad_norm`` is None); device tensors."""
        micro = [batches] if isinstance(batches, Mapping) else list(batches)
        if not micro:
            raise ValueError("step needs at least one micro-batch")
        layout = self._layout
        inputs = []
        for b in micro:
            tensors, layout = self._split(b, layout)
            inputs.append(tensors)
        if self.steps == 0:
            self._warn_eval_mode()
        self._constants = layout[1]
        stream = self.stream
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(self.device))
        try:
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                out = self._run(inputs)
        except BaseException:
            for p in self.params:  # a failed step's partial gradients would be added to the next step's
                if p.grad is not None:
                    p.grad.zero_()
            raise
        if stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(stream)
        self._layout = layout  # fixed by the first step that succeeds
        self.steps += 1
        return out

    def _run(self, inputs: list) -> tuple:
        if self.eager_reason is not None or self.steps < self.warmup:
            return self._eager_step(inputs)
        if self._micro is None:
            try:
                self._capture_graphs(inputs[0])
            except Exception as exc:  # noqa: BLE001  (any capture failure: stay correct, eagerly)
                self.eager_reason = f"capture failed ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})"
                self._micro = self._update = None
                warnings.warn(f"leantune CapturedStep: {self.eager_reason}; training continues without CUDA "
                              "graphs", RuntimeWarning, stacklevel=3)
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                for p in self.params:
                    if p.grad is not None:
                        p.grad.zero_()
                return self._eager_step(inputs)
        total = None
        for batch in inputs:
            for k, v in batch.items():
                self._static[k].copy_(v, non_blocking=True)
            self._micro()
            loss = self._static_loss.float().clone()
            total = loss if total is None else total + loss
        self._update()
        norm = None if self._static_norm is None else self._static_norm.clone()
        return total, norm


def graphable_optimizer(params: Sequence, lr: float, **kwargs):
    """``torch.optim.AdamW`` that a :class:`CapturedStep` can capture: fused on CUDA, ``capturable=True``, each
    group's learning rate a device tensor (a scheduler's ``fill_`` then reaches the graph).

    ``params``: tensors, or torch's param groups (dicts with ``"params"``, other keys per group, e.g. ``"lr"``).

    Raises:
        ValueError: no parameters, a mix of tensors and groups, a learning rate that is not a finite number >= 0.
    """
    params = list(params)
    groups = [g for g in params if isinstance(g, Mapping)]
    if groups and len(groups) != len(params):
        raise ValueError("params must be all tensors or all param groups (dicts with 'params'), not a mix")
    if not groups:
        groups = [{"params": params}] if params else []
    groups = [{**g, "params": list(g["params"])} for g in groups]
    tensors = [p for g in groups for p in g["params"]]
    if not tensors:
        raise ValueError("graphable_optimizer got no parameters")
    lr = check_real("lr", lr, low=0.0)
    for i, g in enumerate(groups):
        if "lr" in g:
            g["lr"] = check_real(f"param group {i}'s lr", g["lr"], low=0.0)
    device = tensors[0].device
    if device.type != "cuda":
        return torch.optim.AdamW(groups, lr=lr, **kwargs)
    for g in groups:
        g["lr"] = torch.tensor(float(g.get("lr", lr)), device=device)
    return torch.optim.AdamW(groups, lr=torch.tensor(lr, device=device), fused=True, capturable=True, **kwargs)
