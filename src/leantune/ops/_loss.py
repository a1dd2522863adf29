"""The loss ops' shared host-side pieces: option and label checks, the mean's divisor, reductions, row scales.

:func:`leantune.ops.cross_entropy` and :func:`leantune.ops.linear_cross_entropy` take the same keywords and the same
reduction rule (docs/design.md, "Public op contract"): ``"mean"`` divides the summed row losses by D = count(valid)
or ``num_items``, ``"sum"`` does not divide, ``"none"`` returns the rows. Both ops check their inputs here before
any kernel runs; the per-row loss and gradient kernels they share are :mod:`leantune.ops.cross_entropy`'s
(``loss_rows`` / ``gradient_rows``, beside the kernels they launch).

Two ways to check what needs the tensors' contents (``checks``, docs/design.md "Public op contract"):

``"eager"`` (the public default): the label range, the valid count and a tensor ``num_items`` are reduced on the
    device and read back in one host sync; a bad value raises ValueError before any kernel runs.
``"deferred"`` (what :func:`leantune.patch` uses inside a training step): nothing is read back. A label outside
    [0, V) other than ignore_index is treated as ignored by the kernels (they never read out of bounds), the
    returned loss is NaN (0 + NaN on every element), and the device's error flag records it;
    :func:`raise_deferred_errors`, called where the host waits anyway (``leantune train``'s and ``patch_trainer``'s
    logging), raises the same ValueError. The valid count stays a 0-dim tensor, and ``num_items`` is the divisor as
    given (HF's ``sum / num_items_in_batch``): a tensor's value is not checked, and 0 with valid labels divides
    by 0 (inf) instead of raising; 0 with no valid label still gives 0.0.
"""

from __future__ import annotations

import numbers
from typing import NamedTuple

import torch

from . import _runtime

REDUCTIONS = ("mean", "sum", "none")
CHECKS = ("eager", "deferred")
# per-row statistics of softmax(z) a loss op can return beside the loss (cross_entropy's row_statistics)
STATISTICS = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


class Options(NamedTuple):
    """The loss options every kernel and torch path takes (validated by the public functions)."""

    ignore_index: int = -100
    label_smoothing: float = 0.0
    softcap: float | None = None
    z_loss: float = 0.0


def check_options(labels, n_vocab, ignore_index, label_smoothing, softcap, z_loss, reduction, num_items,
                  checks="eager", name="labels"):
    """Validate the loss keywords and labels (ValueError); the shared front door of both loss ops.

    Returns ``(options, n_valid, labels, poison)``: ``n_valid`` = count(labels != ignore_index), an int read in the
    same host sync as the labels' range (``checks="eager"``), else a 0-dim int64 tensor; ``labels`` the labels the
    kernels may read (deferred: bad ones replaced by ignore_index); ``poison`` None, or (deferred) a 0-dim fp32
    tensor, NaN when a label was bad, else 0, that the op adds to its loss (module docstring)."""
    if not isinstance(labels, torch.Tensor):
        raise ValueError(f"labels must be a torch.Tensor, got {type(labels).__name__}")  # noqa: TRY004 (contract)
    if labels.dtype != torch.int64:
        raise ValueError(f"labels must be int64, got {labels.dtype}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if checks not in CHECKS:
        raise ValueError(f"checks must be one of {CHECKS}, got {checks!r}")
    label_smoothing = _runtime.check_real("label_smoothing", label_smoothing, low=0.0, high=1.0)
    if softcap is not None:
        softcap = _runtime.check_real("softcap", softcap, low=0.0, low_open=True,
                                      expected="None or a finite number > 0")
    z_loss = _runtime.check_real("z_loss", z_loss, low=0.0)
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, numbers.Integral):
        raise ValueError(f"ignore_index must be an int, got {ignore_index!r}")  # noqa: TRY004 (contract)
    if not -2**63 <= ignore_index < 2**63:
        raise ValueError(f"ignore_index must fit in int64 (labels' dtype), got {ignore_index}")
    options = Options(int(ignore_index), label_smoothing, softcap, z_loss)
    item_bad = None
    if num_items is not None:
        if reduction != "mean":
            raise ValueError(f"num_items is only valid with reduction='mean', got reduction={reduction!r}")
        if isinstance(num_items, torch.Tensor):
            if num_items.dim() != 0 or num_items.dtype == torch.bool or num_items.is_complex():
                raise ValueError(f"num_items must be an int or a 0-dim real tensor, got shape {tuple(num_items.shape)} "
                                 f"{num_items.dtype}")
            if num_items.device != labels.device and num_items.device.type != "cpu":
                # a CPU scalar mixes with any device, as in torch's own ops
                raise ValueError(f"num_items must be on labels' device {labels.device} (or a CPU scalar), "
                                 f"got {num_items.device}")
            if checks == "eager":
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
    if checks == "deferred":
        labels, n_valid, poison = _deferred_label_check(labels, n_vocab, options.ignore_index, name)
        return options, n_valid, labels, poison
    # a few small kernels, then the one host sync: labels are checked before any kernel reads logits[label]; whatever
    # runs between this sync and the first large kernel leaves the GPU idle, so the valid count comes along
    pending = []
    if labels.numel():
        valid = labels != ignore_index
        pending += [*torch.aminmax(torch.where(valid, labels, 0)), valid.sum()]
    if item_bad is not None:
        pending += [item_bad.long(), item_zero.long()]
    values = torch.stack(pending).tolist() if pending else []
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
        raise ValueError(_label_message(n_vocab, ignore_index, low if low < 0 else high, name))
    return options, n_valid, labels, None


def _label_message(n_vocab, ignore_index, found, name="labels") -> str:
    return f"{name} must be in [0, {n_vocab}) or equal ignore_index={ignore_index}; found {found}"


# deferred input errors, per (device, source): int64 [2] = (1 once a bad value was seen, the first bad value), and on
# the host the message of the latest deferred check of that source on that device (a template of {found}).
# Sources: "labels" (the loss ops), "top_k_index" (ops.moe_experts).
_FLAGS: dict[tuple[torch.device, str], torch.Tensor] = {}
_FLAG_CONTEXT: dict[tuple[torch.device, str], str] = {}


def record_deferred(source: str, ok: torch.Tensor, values: torch.Tensor, message: str) -> torch.Tensor:
    """Record on ``ok``'s device whether ``values`` (any shape) hold a bad entry (``ok`` False there) and the first
    one, for :func:`raise_deferred_errors` (``message.format(found=...)`` forms its text); returns ``any_bad``, a
    0-dim bool tensor. A few O(n) kernels, no host read."""
    if torch.compiler.is_compiling():  # one opaque op: a flag created while tracing would recompile the next call
        return _record_flag_op(ok, values, source, message)
    return _record_flag(ok, values, source, message)


def _record_flag(ok: torch.Tensor, values: torch.Tensor, source: str, message: str) -> torch.Tensor:
    key = (ok.device, source)
    _FLAG_CONTEXT[key] = message
    any_bad = ~ok.all()
    flag = _FLAGS.get(key)
    if flag is None:
        flag = _FLAGS[key] = torch.zeros(2, dtype=torch.int64, device=ok.device)
    if values.numel():
        first = values.reshape(-1).gather(0, (~ok).reshape(-1).to(torch.uint8).argmax().reshape(1)).long()
        flag.copy_(torch.where(flag[:1] > 0, flag, torch.cat([any_bad.long().reshape(1), first])))
    return any_bad


# Under torch.compile the flag update is a custom op: dynamo does not trace the flag table, so the compiled graph does
# not guard on which flags exist (the table's one side effect happens when the op runs, as in eager mode).
_record_flag_op = torch.library.custom_op("leantune::record_deferred_flag", mutates_args=())(_record_flag)
_record_flag_op.register_fake(lambda ok, values, source, message: ok.new_empty((), dtype=torch.bool))


def _deferred_label_check(labels, n_vocab, ignore_index, name="labels"):
    """The deferred check (module docstring): a handful of O(N) kernels, no host read; ``name``: the argument's."""
    ok = ((labels >= 0) & (labels < n_vocab)) | (labels == ignore_index)
    any_bad = record_deferred(name, ok, labels,
                              _label_message(n_vocab, ignore_index, "{found}", name)
                              + f" (found inside a training step: the loss of that step is NaN and the "
                              f"{name[:-1]} was ignored)")
    safe = torch.where(ok, labels, ignore_index)
    n_valid = (safe != ignore_index).sum()
    poison = torch.where(any_bad, float("nan"), 0.0)
    return safe, n_valid, poison


def deferred_error_flags() -> list[torch.Tensor]:
    """The devices' deferred-error flags as 0-dim int64 tensors (non-zero once a bad label was seen), for a caller
    that copies them to the host without blocking and calls :func:`raise_deferred_errors` only when one is set
    (``leantune train``'s step records): reading a device value blocks until the queue before it has run."""
    return [flag[0] for flag in _FLAGS.values()]


def raise_deferred_errors() -> None:
    """Raise the ValueError of a label found out of range by a loss op with ``checks="deferred"`` (or an expert index
    out of range in ``ops.moe_experts`` with ``checks="deferred"``) since the last call (and clear it). Reads one small
    flag per device that saw such a check: a host wait, so call it where the host waits anyway (a logging step).
    ``leantune train`` and :func:`leantune.integrations.trl.patch_trainer` call it at each log point; a plain training
    script with :func:`leantune.patch` may call it likewise.

    Raises:
        ValueError: ``labels must be in [0, V) or equal ignore_index=...; found X`` (the first bad label since the
            last call; V and ignore_index of the latest deferred check on that device).
    """
    for key, flag in list(_FLAGS.items()):
        seen, found = flag.tolist()
        if seen:
            flag.zero_()
            raise ValueError(_FLAG_CONTEXT[key].format(found=found))


def check_statistics(statistics) -> tuple[str, ...]:
    """The requested statistic names as a tuple (ValueError for a string, a non-sequence or an unknown name)."""
    if isinstance(statistics, str) or not isinstance(statistics, (tuple, list)):
        raise ValueError(f"statistics must be a tuple of names from {STATISTICS}, got {statistics!r}")
    unknown = [name for name in statistics if name not in STATISTICS]
    if unknown:
        raise ValueError(f"statistics must name only {STATISTICS}, got {unknown[0]!r}")
    return tuple(dict.fromkeys(statistics))


def mean_divisor(n_valid, reduction, num_items, device):
    """0-dim fp32 tensor on ``device``: num_items, else ``n_valid`` (count of valid labels, from
    :func:`check_options`: an int, or a 0-dim tensor when checks are deferred), clamped to >= 1: a 0 with no valid
    label, whose loss sum and gradients are 0, gives the mean 0.0, not 0 / 0 (eager checks refuse a ``num_items``
    of 0 otherwise; deferred, a 0 with valid labels stays 0: sum / 0, as HF's division). Formed on the device from
    a tensor count, no host read. None for reductions other than "mean"."""
    if reduction != "mean":
        return None
    if isinstance(n_valid, torch.Tensor):  # deferred: every decision on the device
        if num_items is None:
            return n_valid.clamp_min(1).to(torch.float32)
        if isinstance(num_items, torch.Tensor):
            count = num_items.detach().to(device=device, dtype=torch.float32, non_blocking=True)
        else:
            count = torch.full((), float(num_items), dtype=torch.float32, device=device)
        return torch.where((count == 0) & (n_valid == 0), 1.0, count)
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
