"""What every op shares: backend choice, the one allocator, launch heuristics and input checks.

Backend (docs/design.md, "Backends"): ``LEANTUNE_BACKEND=auto|triton|torch`` is read at every call, never cached.
``auto`` runs the Triton kernels on CUDA tensors and the torch formulas on anything else. ``triton`` on CPU tensors
needs Triton's interpreter, i.e. ``TRITON_INTERPRET=1`` set before leantune (and so triton.jit) is imported.

Allocation: every output and work buffer an op creates for its Triton kernels comes from :func:`empty`. Tests swap
the allocator for one that fills buffers with NaN (:func:`use_allocator`), so an element a kernel forgot to write
shows up as NaN instead of passing by luck.
"""

from __future__ import annotations

import contextlib
import functools
import math
import numbers
import os
from collections.abc import Callable, Iterator

import torch

BACKENDS = ("auto", "triton", "torch")
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# ----------------------------------------------------------------------------------------------------------- backend
def interpreting() -> bool:
    """True when Triton kernels run through Triton's CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() not in ("", "0", "false", "off")


# Whether this process's kernels are interpreted: triton.jit decides at decoration time (when leantune.ops is
# imported), so launch flags that only the interpreter needs read this, not the environment (~3 us per read).
KERNELS_INTERPRETED = interpreting()


def backend_choice() -> str:
    """``LEANTUNE_BACKEND`` as one of BACKENDS (unset or empty: ``"auto"``; case and spaces ignored).

    Raises:
        ValueError: any other value.
    """
    choice = os.environ.get("LEANTUNE_BACKEND", "auto").strip().lower() or "auto"
    if choice not in BACKENDS:
        raise ValueError(f"LEANTUNE_BACKEND must be auto, triton or torch; got {choice!r}")
    return choice


def backend(device: torch.device) -> str:
    """The implementation to use for tensors on ``device``: ``"triton"`` or ``"torch"``.

    Raises:
        ValueError: ``LEANTUNE_BACKEND`` is not one of auto, triton, torch.
        RuntimeError: ``LEANTUNE_BACKEND=triton`` for non-CUDA tensors without the Triton interpreter.
    """
    choice = backend_choice()
    if choice == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if choice == "triton" and device.type != "cuda" and not interpreting():
        raise RuntimeError(
            f"LEANTUNE_BACKEND=triton needs CUDA tensors (got tensors on {device}); to run the Triton kernels on the "
            "CPU, set TRITON_INTERPRET=1 before importing leantune, or use LEANTUNE_BACKEND=torch"
        )
    if choice == "triton" and device.type != "cuda" and not KERNELS_INTERPRETED:
        raise RuntimeError(
            "TRITON_INTERPRET=1 was set after leantune was imported, when its Triton kernels had already been built "
            "for the GPU; set it before importing leantune, or use LEANTUNE_BACKEND=torch"
        )
    return choice


# --------------------------------------------------------------------------------------------------------- allocator
def _torch_empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=device)


_allocator: Callable[[tuple[int, ...], torch.dtype, torch.device], torch.Tensor] = _torch_empty


def empty(shape, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised tensor from the current allocator (every kernel output and work buffer comes from here)."""
    return _allocator(tuple(map(int, shape)), dtype, device if type(device) is torch.device else torch.device(device))


@contextlib.contextmanager
def use_allocator(allocator: Callable[[tuple[int, ...], torch.dtype, torch.device], torch.Tensor]) -> Iterator[None]:
    """Route :func:`empty` through ``allocator(shape, dtype, device)`` inside the ``with`` block (tests poison)."""
    global _allocator
    previous, _allocator = _allocator, allocator
    try:
        yield
    finally:
        _allocator = previous


# ------------------------------------------------------------------------------------------------ launch heuristics
def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for ints; host code uses this, not ``triton.cdiv`` (a constexpr function: ~2 us per host call)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def num_warps_for(block_elements: int) -> int:
    """Warps for a program that touches ``block_elements`` elements per row (enough loads in flight, no spills)."""
    if block_elements <= 1024:
        return 4
    if block_elements <= 4096:
        return 8
    if block_elements <= 16384:
        return 16
    return 32


MAX_RANK_BLOCK = 64  # rank columns a low-rank kernel holds per tile; larger ranks loop or split (shared memory)


def rank_block(rank: int) -> int:
    """Tile width over a LoRA rank: a power of two in [16, MAX_RANK_BLOCK] (tl.dot needs >= 16)."""
    return max(16, min(MAX_RANK_BLOCK, next_power_of_2(rank)))


@functools.lru_cache(maxsize=16)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def persistent_programs(device: torch.device, n_work: int, per_sm: int = 4) -> int:
    """Grid size for kernels that loop over rows and keep per-program partial sums (e.g. weight gradients).

    On the GPU a few programs per SM; under the interpreter a handful, so partial sums are still exercised.
    """
    if device.type == "cuda":
        limit = per_sm * _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    else:
        limit = 4
    return max(1, min(n_work, limit))


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """``x [..., H]`` as a 2-D ``[rows, H]`` view with unit stride in the last dim (copies only if it must)."""
    x2d = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])  # not -1: ambiguous when the last dim is 0
    if x2d.shape[-1] > 1 and x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    return x2d


def autocast_dtype(device: torch.device) -> torch.dtype | None:
    """The dtype ``torch.autocast`` casts matmul inputs to on ``device``, or None when autocast is off there."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return None


# ------------------------------------------------------------------------------------------------------- autograd
def first_derivative_only(backward: Callable) -> Callable:
    """Decorator for the hand-derived ``backward`` of every op's ``autograd.Function``: it runs without building a
    graph, and under ``create_graph=True`` each gradient it returns carries a node that raises RuntimeError
    ("trying to differentiate twice") if differentiated again. torch's ``once_differentiable`` adds that node only
    when an incoming gradient requires grad; a second derivative through a loss op (incoming gradient: a constant)
    or ``(y * c).sum()`` would then silently lose the op's second-order terms."""

    @functools.wraps(backward)
    def wrapper(ctx, *grad_outputs):
        if not torch.is_grad_enabled():  # the engine enables grad mode in backward only for create_graph=True
            with torch.no_grad():
                return backward(ctx, *grad_outputs)
        # the error node hangs off the op's saved inputs (an empty slice's sum: exactly 0, inf/NaN-safe), so a
        # second derivative w.r.t. them reaches it; off fresh leaves only it was pruned and the terms silently
        # dropped. Read before backward, which may reuse saved buffers in place.
        anchors = [t.reshape(-1)[:0].sum() for t in ctx.saved_tensors if isinstance(t, torch.Tensor)
                   and t.requires_grad]
        with torch.no_grad():
            grads = backward(ctx, *grad_outputs)
        single = not isinstance(grads, tuple)
        grads = (grads,) if single else grads
        error = torch._C._functions.DelayedError(
            b"trying to differentiate twice through a leantune op: its backward is derived by hand and has no "
            b"derivative of its own", len(grads))
        link = sum(anchors[1:], anchors[0]) if anchors else None
        out = error(*[None if g is None else g.detach().requires_grad_() if link is None else g.detach() + link
                      for g in grads])
        return out if single or isinstance(out, tuple) else (out,)

    return wrapper


def reshaped_output(t: torch.Tensor, shape) -> torch.Tensor:
    """The contiguous ``t`` as a ``shape``-shaped tensor over the same storage that is not a view (``t.view(shape)``
    would be one), so that the caller of an ``autograd.Function`` may modify it in place (autograd forbids in-place
    ops on a view created inside a Function). Only for outputs the Function does not save for backward: the new
    tensor has its own version counter, so an in-place change would go unseen by a saved ``t``. When ``t`` already
    has ``shape``: ``t`` itself; under torch.compile (``set_`` is not traced): ``t.view(shape)``."""
    if torch.compiler.is_compiling():
        return t.view(shape)
    if tuple(t.shape) == tuple(shape):
        return t  # not a view: already its own tensor
    if not t.is_contiguous():
        raise ValueError(f"reshaped_output needs a contiguous tensor, got strides {t.stride()}")
    return t.new_empty(0).set_(t.untyped_storage(), t.storage_offset(), tuple(shape))


def distinct_output(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a new view (``t.view_as(t)``) while torch.compile traces; ``t`` itself in eager mode. Every op's
    ``autograd.Function.forward`` returns each differentiable output through this.

    Why: torch 2.11's dynamo makes every tensor a traced forward created an extra output of its subgraph. The
    result of an in-place op (``act.mul_(up)``), or of a ``.to()``/``.float()`` that changes nothing, is the same
    tensor as its operand; returned, it appears twice among the outputs, autograd wires its gradient edge to the
    last copy (an unused extra output) and backward receives zeros for the real one: silent zero gradients
    (pytorch/pytorch#180642; fixed for 2.12 by pytorch/pytorch#180921). A view is a tensor of its own, so no extra
    output can be it. Outputs marked non-differentiable are returned as they are (the mark is on that tensor).
    Costs one ``torch.compiler.is_compiling()`` read per eager call (0.11 us).
    """
    return t.view_as(t) if torch.compiler.is_compiling() else t


# ---------------------------------------------------------------------------------------------------- input checks
def check_tensor(name: str, t, *, float_only: bool = True) -> None:
    """Raise ValueError unless ``t`` is a tensor of a supported float dtype (fp32, fp16, bf16)."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if float_only and t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} must be float32, float16 or bfloat16, got {t.dtype}")


def check_same_device(**tensors) -> torch.device:
    """Raise ValueError unless every non-None tensor is on one device; return that device."""
    present = {k: v for k, v in tensors.items() if v is not None}
    values = iter(present.values())
    device = next(values).device
    if all(v.device == device for v in values):  # the common case, without formatting device names
        return device
    devices = {str(v.device) for v in present.values()}
    if len(devices) > 1:
        where = ", ".join(f"{k} on {v.device}" for k, v in present.items())
        raise ValueError(f"all tensors must be on one device, got {where}")
    return next(iter(present.values())).device


def check_shape(name: str, t: torch.Tensor, expected: tuple, what: str) -> None:
    """Raise ValueError naming ``name`` unless ``t.shape == expected`` (``what`` explains the expectation)."""
    if tuple(t.shape) != tuple(expected):
        raise ValueError(f"{name} must have shape {tuple(expected)} ({what}), got {tuple(t.shape)}")


def check_real(name: str, value, *, low: float | None = None, high: float | None = None, low_open: bool = False,
               high_open: bool = False, expected: str | None = None) -> float:
    """``value`` as a float; ValueError naming ``name`` unless it is a finite real number (bools, strings and tensors
    are not) within [low, high] (``low_open`` / ``high_open`` exclude the bound). ``expected`` replaces the
    message's description of a valid value, for every failure. Under torch.compile's tracing it is returned
    unchecked (with ``dynamic=True`` a Python float is a symbolic input there, whose value tracing cannot read)."""
    def fail(what: str):
        raise ValueError(f"{name} must be {expected or what}, got {value!r}")

    if torch.compiler.is_compiling():
        return value  # maybe a symbolic number (dynamic=True makes Python floats inputs): no value while tracing
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        fail("a real number")
    try:
        number = float(value)
    except OverflowError:
        number = math.inf if value > 0 else -math.inf
    if not math.isfinite(number):
        fail("finite")
    too_low = low is not None and (number <= low if low_open else number < low)
    too_high = high is not None and (number >= high if high_open else number > high)
    if too_low or too_high:
        if low is not None and high is not None:
            expected_range = f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
        elif low is not None:
            expected_range = f"{'>' if low_open else '>='} {low:g}"
        else:
            expected_range = f"{'<' if high_open else '<='} {high:g}"
        fail(expected_range)
    return number


def _viewable_as_rows(t):
    """Whether ``t [..., I]`` views as ``[rows, I]`` without a copy (its leading dims nest: stride = next dim's
    stride x size)."""
    return all(t.stride(i) == t.stride(i + 1) * t.shape[i + 1] for i in range(t.dim() - 2))


def rows_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors share an element, exact for ``[rows, I]`` views with one row stride s >= I (the halves
    of a ``[rows, 2I]`` buffer: element offsets d apart overlap iff some row shift k gives |d - k s| < I), else
    conservative (their address spans intersect). False under torch.compile (no data pointers)."""
    if torch.compiler.is_compiling() or a.numel() == 0 or b.numel() == 0 or a.device != b.device:
        return False
    a2d, b2d = (t.view(-1, t.shape[-1]) if t.dim() >= 2 and _viewable_as_rows(t) else None for t in (a, b))
    size = a.element_size()
    diff = b.data_ptr() - a.data_ptr()
    if (a2d is not None and b2d is not None and b2d.shape == a2d.shape and b2d.stride() == a2d.stride()
            and a2d.stride(1) == 1 and a2d.stride(0) >= a2d.shape[1] and diff % size == 0
            and b.element_size() == size):
        (rows, width), stride = a2d.shape, a2d.stride(0)
        d = diff // size
        shifts = range(-(rows - 1), rows)
        k = min(max(round(d / stride), shifts.start), shifts.stop - 1)  # the nearest row shift, then its neighbours
        return any(abs(d - j * stride) < width for j in (k - 1, k, k + 1) if j in shifts)

    def span(t):  # first and one-past-last byte the tensor can touch
        start = t.data_ptr()
        return start, start + (sum((n - 1) * st for n, st in zip(t.shape, t.stride())) + 1) * t.element_size()
    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1
