"""Liger's cross-entropy options on leantune's loss ops, composed on their per-row losses (no new kernel).

``ce_weight`` / ``weight`` (per-class weights), ``use_token_scaling`` and ``return_token_accuracy`` of
:func:`leantune.ops.cross_entropy` and :func:`leantune.ops.linear_cross_entropy` run the op with
``reduction="none"`` (its kernels unchanged) and reduce the rows here. With every option off the ops take their
usual path, so the default's speed and memory are unchanged; with an option on, ``linear_cross_entropy`` runs its
"low" path (per-row gradient scales: the logits are recomputed in backward).

Formulas, per row i with label y_i, valid_i = (y_i != ignore_index), loss row l_i from the op:

- class weights w [V] (torch's ``F.cross_entropy(weight=w)``): r_i = w[y_i] l_i; ``"mean"`` divides sum r_i by
  sum over valid rows of w[y_i] (``num_items``, when given, replaces that divisor, HF's convention), 0.0 when that
  sum is 0 and no row is valid. Label smoothing and z-loss are refused with weights (torch weights the smoothing
  term per class, a formula not implemented here).
- token scaling (Liger's ``use_token_scaling``): r_i = p_i l_i with p_i = softmax(z_i)[y_i] = exp(-l_i), detached
  (no gradient through the scale); refused with label smoothing or z-loss, where l_i is not -log p_i. The mean
  divides by count(valid) (or ``num_items``), as without scaling.
- z-loss term (``return_z_loss``): z_loss * lse(z_i)^2 at valid rows, reduced as the loss, detached (for logging:
  its gradient is already in the loss); returned after the loss (and the statistics), before the accuracy.
- token accuracy: sum(valid_i and argmax z_i == y_i) / max(count(valid), 1), a 0-dim fp32 tensor without gradient
  (the first maximum on ties, as torch.argmax); returned last, after the loss (and the statistics).

No host sync: divisors and counts stay tensors, so ``checks="deferred"`` keeps its contract.
"""

from __future__ import annotations

import torch

from . import _runtime
from ._loss import check_options


def check_extras(labels, n_vocab, weight, weight_name, use_token_scaling, label_smoothing, z_loss):
    """ValueError for a bad class-weight tensor or an option combination the formulas above do not cover."""
    if not isinstance(use_token_scaling, bool):
        raise ValueError(f"use_token_scaling must be a bool, got {use_token_scaling!r}")
    if weight is not None:
        _runtime.check_tensor(weight_name, weight)
        _runtime.check_shape(weight_name, weight, (n_vocab,), "one weight per class V")
        if isinstance(labels, torch.Tensor) and weight.device != labels.device:
            raise ValueError(f"{weight_name} must be on labels' device {labels.device}, got {weight.device}")
    if (weight is not None or use_token_scaling) and (label_smoothing or z_loss):
        which = weight_name if weight is not None else "use_token_scaling"
        raise ValueError(f"{which} is not supported with label_smoothing or z_loss (got label_smoothing="
                         f"{label_smoothing}, z_loss={z_loss})")


def check_reduction(reduction, num_items, device) -> None:
    """The reduction keywords the op does not see (it runs with "none"): the loss ops' own checks
    (``_loss.check_options`` on no labels, deferred: no host read), ValueError with their messages."""
    check_options(torch.zeros(0, dtype=torch.int64, device=device), 1, -100, 0.0, None, 0.0, reduction, num_items,
                  "deferred")


def reduce_rows(rows, labels, ignore_index, reduction, num_items, weight, use_token_scaling):
    """The loss from the op's [N] fp32 rows (0 at ignored rows) under the options (module docstring)."""
    valid = labels != ignore_index
    factor = class_rows = None
    if weight is not None:
        # a bad label (deferred checks) reads class 0 here; the op's loss is NaN for that call anyway
        class_rows = torch.where(valid, weight.float()[torch.where(valid, labels, 0).clamp(0, weight.shape[0] - 1)],
                                 0.0)
        factor = class_rows
    if use_token_scaling:
        scale = torch.exp(-rows.detach())
        factor = scale if factor is None else factor * scale
    scaled = rows if factor is None else rows * factor
    if reduction == "none":
        return scaled
    total = scaled.sum()
    if reduction == "sum":
        return total
    if num_items is not None:
        count = (num_items.detach().to(rows.device, torch.float32) if isinstance(num_items, torch.Tensor)
                 else torch.full((), float(num_items), device=rows.device))
    elif class_rows is not None:
        count = class_rows.sum()
    else:
        count = valid.sum().float()
    # 0 / 0 (nothing valid) is 0.0 with zero gradients, the ops' rule
    return total / torch.where(count == 0, 1.0, count)


def token_accuracy(is_top1, labels, ignore_index):
    """sum(valid and top-1) / max(count(valid), 1) as a 0-dim fp32 tensor (no host read)."""
    valid = labels != ignore_index
    return ((is_top1 & valid).sum().float() / valid.sum().clamp_min(1).float()).detach()


def z_loss_term(lse, labels, ignore_index, z_loss, reduction, num_items):
    """The z-loss part of the loss for ``return_z_loss``: z_loss * lse_i^2 at valid rows, reduced as the loss (the
    mean over count(valid) or ``num_items``), detached (its gradient is already in the loss)."""
    valid = labels != ignore_index
    rows = torch.where(valid, z_loss * lse.detach().float() ** 2, 0.0)
    return reduce_rows(rows, labels, ignore_index, reduction, num_items, None, False).detach()


def cross_entropy_with_options(logits, labels, *, reduction, num_items, weight, use_token_scaling, return_z_loss,
                               return_token_accuracy, row_losses, softcap_fn, **kwargs):
    """:func:`leantune.ops.cross_entropy` with Liger's options on its rows (module docstring). ``row_losses`` and
    ``softcap_fn`` are that module's ``_cross_entropy`` and ``_softcap_torch`` (passed in: it imports this one)."""
    _cross_entropy, _softcap_torch = row_losses, softcap_fn

    for name, value in (("return_token_accuracy", return_token_accuracy), ("return_z_loss", return_z_loss)):
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be a bool, got {value!r}")
    check_extras(labels, logits.shape[1], weight, "weight", use_token_scaling,
                               kwargs["label_smoothing"], kwargs["z_loss"])
    check_reduction(reduction, num_items, logits.device)
    out = _cross_entropy(logits, labels, reduction="none", num_items=None, with_lse=return_z_loss,
                         **kwargs)
    rows, lse = out if return_z_loss else (out, None)
    result = (reduce_rows(rows, labels, kwargs["ignore_index"], reduction, num_items, weight,
                                        use_token_scaling),)
    if return_z_loss:
        result += (z_loss_term(lse, labels, kwargs["ignore_index"], kwargs["z_loss"], reduction,
                                             num_items),)
    if return_token_accuracy:
        with torch.no_grad():
            # no softcap: argmax of the logits as they are (a 16-bit value widens exactly; no [N, V] fp32 copy)
            z = logits if kwargs["softcap"] is None else _softcap_torch(logits.float(), kwargs["softcap"])[0]
            result += (token_accuracy(z.argmax(-1) == labels, labels, kwargs["ignore_index"]),)
    return result if len(result) > 1 else result[0]
