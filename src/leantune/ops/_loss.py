"""The loss ops' shared host-side pieces: option and label checks, the mean's divisor, reductions, row scales.

:func:`leantune.ops.cross_entropy` and :func:`leantune.ops.linear_cross_entropy` take the same keywords and the same
reduction rule (docs/design.md, "Public op contract"): ``"mean"`` divides the summed row losses by D = count(valid)
or ``num_items``, ``"sum"`` does not divide, ``"none"`` returns the rows. Both ops check their inputs here before
any kernel runs; the per-row loss and gradient kernels they share are :mod:`leantune.ops.cross_entropy`'s
(``loss_rows`` / ``gradient_rows``, beside the kernels they launch).
"""

from __future__ import annotations

import numbers
from typing import NamedTuple

import torch

from . import _runtime

REDUCTIONS = ("mean", "sum", "none")
# per-row statistics of softmax(z) a loss op can return beside the loss (cross_entropy's row_statistics)
STATISTICS = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


class Options(NamedTuple):
    """The loss options every kernel and torch path takes (validated by the public functions)."""

    ignore_index: int = -100
    label_smoothing: float = 0.0
    softcap: float | None = None
    z_loss: float = 0.0


def check_options(labels, n_vocab, ignore_index, label_smoothing, softcap, z_loss, reduction,
                  num_items) -> tuple[Options, int]:
    """Validate the loss keywords and labels (ValueError); the shared front door of both loss ops. Returns the
    options and count(labels != ignore_index), read in the same host sync as the labels' range."""
    if not isinstance(labels, torch.Tensor):
        raise ValueError(f"labels must be a torch.Tensor, got {type(labels).__name__}")  # noqa: TRY004 (contract)
    if labels.dtype != torch.int64:
        raise ValueError(f"labels must be int64, got {labels.dtype}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    label_smoothing = _runtime.check_real("label_smoothing", label_smoothing, low=0.0, high=1.0)
    if softcap is not None:
        softcap = _runtime.check_real("softcap", softcap, low=0.0, low_open=True,
                                      expected="None or a finite number > 0")
    z_loss = _runtime.check_real("z_loss", z_loss, low=0.0)
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, numbers.Integral):
        raise ValueError(f"ignore_index must be an int, got {ignore_index!r}")  # noqa: TRY004 (contract)
    if not -2**63 <= ignore_index < 2**63:
        raise ValueError(f"ignore_index must fit in int64 (labels' dtype), got {ignore_index}")
    item_bad = None
    if num_items is not None:
        if reduction != "mean":
            raise ValueError(f"num_items is only valid with reduction='mean', got reduction={reduction!r}")
        if isinstance(num_items, torch.Tensor):
            if num_items.dim() != 0 or num_items.dtype == torch.bool or num_items.is_complex():
                raise ValueError(f"num_items must be an int or a 0-dim real tensor, got shape {tuple(num_items.shape)} "
                                 f"{num_items.dtype}")
            if num_items.device != labels.device:
                if num_items.device.type != "cpu":  # a CPU scalar mixes with any device, as in torch's own ops
                    raise ValueError(f"num_items must be on labels' device {labels.device} (or a CPU scalar), "
                                     f"got {num_items.device}")
                num_items = num_items.to(labels.device)
            # a count: >= 0, finite, whole and < 2^63 as an int must be (gradient accumulation passes the global
            # number of valid tokens; 0 for a window without targets); every int64 is below 2^63
            item_bad = ~((num_items >= 0) & torch.isfinite(num_items) & (num_items == torch.round(num_items)))
            if num_items.is_floating_point():
                item_bad |= num_items >= 2.0**63
            item_zero = num_items == 0
        elif isinstance(num_items, bool) or not isinstance(num_items, numbers.Integral):
            raise ValueError(f"num_items must be an int or a 0-dim tensor, got {type(num_items).__name__}")
        elif num_items < 0:
            raise ValueError(f"num_items must be >= 0, got {num_items}")
        elif num_items >= 2**63:
            raise ValueError(f"num_items must be < 2^63 (a token count), got {num_items}")
    # a few small kernels, then the one host sync: labels are checked before any kernel reads logits[label]; whatever
    # runs between this sync and the first large kernel leaves the GPU idle, so the valid count comes along
    checks = []
    if labels.numel():
        valid = labels != ignore_index
        checks += [*torch.aminmax(torch.where(valid, labels, 0)), valid.sum()]
    if item_bad is not None:
        checks += [item_bad.long(), item_zero.long()]
    values = torch.stack(checks).tolist() if checks else []
    zero_items = num_items is not None and not isinstance(num_items, torch.Tensor) and num_items == 0
    if item_bad is not None:
        zero_items = bool(values.pop())
        if values.pop():
            raise ValueError(f"num_items must be >= 0, finite, whole and < 2^63 (a token count), got "
                             f"{num_items.item()}")
    low, high, n_valid = values or (0, 0, 0)
    if zero_items and n_valid:
        raise ValueError(f"num_items is 0 but {n_valid} labels are valid (not ignore_index): a divisor of 0 is only "
                         f"accepted when no label is valid, and the loss is then 0.0 with zero gradients")
    if low < 0 or high >= n_vocab:
        raise ValueError(f"labels must be in [0, {n_vocab}) or equal ignore_index={ignore_index}; found "
                         f"{low if low < 0 else high}")
    return Options(int(ignore_index), label_smoothing, softcap, z_loss), n_valid


def check_statistics(statistics) -> tuple[str, ...]:
    """The requested statistic names as a tuple (ValueError for a string, a non-sequence or an unknown name)."""
    if isinstance(statistics, str) or not isinstance(statistics, (tuple, list)):
        raise ValueError(f"statistics must be a tuple of names from {STATISTICS}, got {statistics!r}")
    unknown = [name for name in statistics if name not in STATISTICS]
    if unknown:
        raise ValueError(f"statistics must name only {STATISTICS}, got {unknown[0]!r}")
    return tuple(dict.fromkeys(statistics))


def mean_divisor(n_valid: int, reduction, num_items, device):
    """0-dim fp32 tensor on ``device``: num_items, else ``n_valid`` (count of valid labels, from
    :func:`check_options`), clamped to >= 1: a 0 comes only with no valid label (:func:`check_options` refuses a
    ``num_items`` of 0 otherwise), whose loss sum and gradients are 0, so the mean is 0.0, not 0 / 0. None for
    reductions other than "mean"."""
    if reduction != "mean":
        return None
    if isinstance(num_items, torch.Tensor):
        return num_items.detach().to(device=device, dtype=torch.float32).clamp_min(1.0)
    count = max(n_valid if num_items is None else num_items, 1)
    return torch.full((), float(count), dtype=torch.float32, device=device)


def reduce(row_loss, reduction, divisor):
    if reduction == "none":
        return row_loss
    total = row_loss.sum()
    return total if reduction == "sum" else total / divisor


def row_scale(grad_output, reduction, divisor):
    """dL/dloss_row as fp32: 0-dim for "mean"/"sum", [n] for "none"."""
    g = grad_output.float()
    return g / divisor if reduction == "mean" else g.contiguous()
