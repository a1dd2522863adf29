"""Offloaded checkpoints: each checkpointed decoder layer's input lives in host memory between forward and backward.

With non-reentrant gradient checkpointing (``torch.utils.checkpoint``, ``use_reentrant=False``) a decoder layer
keeps one thing alive between its forward and its backward: its input ``hidden_states`` [B, S, H], stored by the
checkpoint as a saved tensor of its recompute frame (everything the layer computes inside is dropped and
recomputed). Saved tensors go through ``torch.autograd.graph.saved_tensors_hooks`` (the mechanism of torch's own
``save_on_cpu``); the checkpoint's own hook is active only *inside* the layer, so a pack hook entered around the
checkpointed call sees exactly the layer's inputs (checked with a counting hook: one tensor per layer for
transformers' decoder layers, which pass everything but ``hidden_states`` as keywords bound into the function).
That hook is :class:`CheckpointOffloader`; it is entered by wrapping each layer's ``_gradient_checkpointing_func``
(what ``GradientCheckpointingLayer.__call__`` calls).

Forward (pack), on CUDA:
  1. the side stream ``d2h`` waits for the compute stream (the input has been produced there) and for the host
     buffer's previous use (an event), then copies device -> pinned host buffer, ``non_blocking``; an event marks
     the copy's end.
  2. ``input.record_stream(d2h)``; the hook keeps no reference, so the device block is released as soon as the
     forward moves on, and the caching allocator hands it out again only after the copy has finished.
Backward (unpack), when layer i's recompute asks for its input:
  3. if its copy back was prefetched, the compute stream waits on that copy's event; otherwise the copy is made now
     (same path) and waited for.
  4. layer i-1's copy back is started on the side stream ``h2d`` (prefetch): the device tensor is allocated on the
     compute stream, ``h2d`` waits for the compute stream (the block may be a just-freed one still in use there)
     and for the d2h copy's event, copies, records an event; ``record_stream(h2d)`` keeps the block safe should the
     tensor be dropped before use. So layer i-1's input crosses the bus while layer i recomputes and backpropagates.
Lifetimes: a host buffer belongs to one saved input until autograd frees that input (after the layer's backward,
or when the graph is dropped); it then returns to the pool with the event of its last copy, which the next
copy into it waits for. At most two layer inputs are on the device in the backward (the one in use, the prefetched).

Host memory: a pool keyed by (shape, dtype) of pinned buffers, allocated at the first forward of a shape (one per
checkpointed layer, all at once) and reused by every later step. Before allocating, the pool checks that
``/proc/meminfo`` MemAvailable covers the new buffers plus a margin and raises :class:`~leantune.errors.LeantuneError`
otherwise. A new shape frees the idle buffers of other shapes first (variable-length batches do not pile up sets).

On CPU tensors the same bookkeeping runs (pool, pack, prefetch, unpack) with plain host-to-host copies and no
streams, so CPU tests prove it: gradients are bit-identical to plain checkpointing (docs/design.md, "Saved and
recomputed").

Entry points: :func:`enable_offloaded_checkpoints` / :func:`disable_offloaded_checkpoints` on a transformers model
(or a PEFT wrapper). Gradient checkpointing may be enabled before or after: a forward pre-hook on the model wraps
each layer's checkpoint function at every forward (so a later ``gradient_checkpointing_enable`` is picked up) and
raises when a training forward runs with checkpointing off.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import weakref

import torch
from torch import nn

from ..errors import LeantuneError
from ._model import checkpoint_reentrant, hf_model

logger = logging.getLogger(__name__)

GIB = 1024**3
_OFFLOAD_ATTR = "_leantune_offload"  # on the transformers model: its CheckpointOffloader


# ---------------------------------------------------------------------------------------------------- host memory
def host_available_bytes() -> int | None:
    """Bytes of host memory available to new allocations (``/proc/meminfo`` MemAvailable; ``sysconf`` available
    pages elsewhere); None when neither can be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # the file states kB
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_host_room(nbytes: int, *, margin_bytes: int, what: str) -> None:
    """Raise :class:`LeantuneError` unless ``nbytes`` plus ``margin_bytes`` fit in :func:`host_available_bytes`.

    Args:
        nbytes: bytes about to be allocated on the host.
        margin_bytes: bytes left free for everything else (data loading, the Python heap, the page cache).
        what: what the bytes are for, for the message.
    """
    available = host_available_bytes()
    if available is None:
        logger.warning("offloaded checkpoints: host memory could not be read; %.2f GiB allocated unchecked",
                       nbytes / GIB)
        return
    if nbytes + margin_bytes > available:
        raise LeantuneError(
            f"offloaded checkpoints need {nbytes / GIB:.2f} GiB of host memory for {what}, plus a "
            f"{margin_bytes / GIB:.2f} GiB margin, but only {available / GIB:.2f} GiB is available (MemAvailable): "
            f"shorten the sequence or the batch, checkpoint fewer layers, or turn offload_checkpoints off")


@dataclasses.dataclass(eq=False)
class HostBuffer:
    """One host buffer of the pool, its pool key, and the event of the last copy that touched it (None on CPU).

    A pinned buffer is page-locked by ``cudaHostRegister`` on a plain host tensor of exactly its size, and
    unregistered when the buffer goes (before its memory is freed). torch's pinned allocator (``pin_memory=True``)
    rounds each block up to a power of two: 32 layer inputs of 3 GiB (393,216 tokens at Llama-3-8B) would take
    128 GiB there instead of 96, more than the H200 machine's host has.
    """

    tensor: torch.Tensor
    key: tuple
    last_use: torch.cuda.Event | None = None
    pinned: bool = False

    @classmethod
    def allocate(cls, shape, dtype, key: tuple, *, pin: bool) -> HostBuffer:
        buffer = cls(torch.empty(shape, dtype=dtype), key)
        if pin:
            code = int(torch.cuda.cudart().cudaHostRegister(buffer.tensor.data_ptr(), buffer.tensor.nbytes, 0))
            if code != 0:
                raise LeantuneError(f"cannot pin {buffer.tensor.nbytes / GIB:.2f} GiB of host memory for offloaded "
                                    f"checkpoints (cudaHostRegister error {code}); lower the sequence length or "
                                    "turn offloading off")
            buffer.pinned = True
        return buffer

    def __del__(self):
        if self.pinned:
            self.pinned = False
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())


class HostPool:
    """Host buffers keyed by (shape, dtype), allocated once and handed out again after each saved input is freed.

    ``pin`` allocates page-locked memory (needed for asynchronous copies from a CUDA device); CPU models use plain
    memory. Every allocation is checked by :func:`check_host_room` first, after the idle buffers of keys unused in
    the current forward are dropped (a shorter last batch does not keep a second set alive beside the first).
    """

    def __init__(self, *, margin_bytes: int):
        self.margin_bytes = margin_bytes
        self.free: dict[tuple, list[HostBuffer]] = {}
        self.owned: dict[tuple, int] = {}  # buffers allocated per key, free or lent
        self.used: set[tuple] = set()  # keys used in the current forward

    def begin_forward(self) -> None:
        self.used.clear()

    def reserve(self, shape: torch.Size, dtype: torch.dtype, count: int, *, pin: bool) -> None:
        """Make sure ``count`` buffers of this key exist, allocating the missing ones in one checked step."""
        key = (tuple(shape), dtype, pin)
        self.used.add(key)
        missing = count - self.owned.get(key, 0)
        if missing <= 0:
            return
        self._drop_idle(keep=self.used)
        nbytes = missing * shape.numel() * dtype.itemsize
        check_host_room(nbytes, margin_bytes=self.margin_bytes,
                        what=f"{missing} layer inputs of shape {list(shape)} {str(dtype).removeprefix('torch.')}")
        bucket = self.free.setdefault(key, [])
        for _ in range(missing):
            bucket.append(HostBuffer.allocate(shape, dtype, key, pin=pin))
        self.owned[key] = self.owned.get(key, 0) + missing

    def acquire(self, shape: torch.Size, dtype: torch.dtype, *, pin: bool) -> HostBuffer:
        key = (tuple(shape), dtype, pin)
        if not self.free.get(key):
            self.reserve(shape, dtype, self.owned.get(key, 0) + 1, pin=pin)
        return self.free[key].pop()

    def release(self, buffer: HostBuffer) -> None:
        if buffer.key in self.owned:  # else its set was dropped meanwhile: the buffer is let go
            self.free.setdefault(buffer.key, []).append(buffer)

    def _drop_idle(self, keep: set) -> None:
        for key in [k for k in self.free if k not in keep]:
            self.owned[key] -= len(self.free.pop(key))  # dropped buffers unregister themselves as they go
            if self.owned[key] == 0:
                del self.owned[key]

    def buffers(self) -> list[torch.Tensor]:
        """The idle buffers (tests compare their storage across steps)."""
        return [b.tensor for bucket in self.free.values() for b in bucket]

    def nbytes(self) -> int:
        """Host bytes held by the pool, idle or lent."""
        return sum(count * torch.Size(k[0]).numel() * k[1].itemsize for k, count in self.owned.items())

    def clear(self) -> None:
        """Drop every buffer (lent ones are let go when autograd frees them)."""
        self.free.clear()
        self.owned.clear()


# -------------------------------------------------------------------------------------------------- saved inputs
class _Streams:
    """The two side streams of one CUDA device: device->host in the forward, host->device in the backward."""

    def __init__(self, device: torch.device):
        self.d2h = torch.cuda.Stream(device)
        self.h2d = torch.cuda.Stream(device)


class OffloadedInput:
    """What the pack hook returns for one layer input: its host copy, the copy's event, and a prefetched device
    copy once the backward has asked for it. Returns its host buffer to the pool when autograd frees it."""

    def __init__(self, offloader: CheckpointOffloader, buffer: HostBuffer, device: torch.device, previous):
        self.offloader = offloader
        self.buffer = buffer
        self.device = device
        self.previous = previous  # weakref to the input packed just before in this forward (layer i-1), or None
        self.on_device: torch.Tensor | None = None  # prefetched copy
        self.ready: torch.cuda.Event | None = None  # end of the prefetch copy
        weakref.finalize(self, offloader.pool.release, buffer)


class CheckpointOffloader:
    """The saved-tensor hooks of offloaded checkpoints, the host pool and the side streams (see the module docstring).

    Args:
        min_bytes: saved tensors smaller than this stay where they are (position ids, small masks).
        margin_gib: host memory (GiB) that must stay available after the pool is allocated.
    """

    def __init__(self, *, min_bytes: int = 1 << 20, margin_gib: float = 2.0):
        if not isinstance(min_bytes, int) or min_bytes < 0:
            raise ValueError(f"min_bytes must be an int >= 0, got {min_bytes!r}")
        if not isinstance(margin_gib, (int, float)) or margin_gib < 0:
            raise ValueError(f"margin_gib must be a number >= 0, got {margin_gib!r}")
        self.min_bytes = min_bytes
        self.pool = HostPool(margin_bytes=int(margin_gib * GIB))
        self.expected_inputs = 1  # checkpointed layers per forward, set by the model's pre-hook
        self._streams: dict[torch.device, _Streams] = {}
        self._last = None  # weakref to the last OffloadedInput packed in this forward
        self.packed = 0  # counters for tests and logs
        self.prefetched = 0

    def begin_forward(self, expected_inputs: int) -> None:
        """A new forward starts: the prefetch chain restarts, and the pool expects this many inputs per shape."""
        self._last = None
        self.expected_inputs = max(1, expected_inputs)
        self.pool.begin_forward()

    def hooks(self):
        """The ``saved_tensors_hooks`` context to enter around one checkpointed call."""
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def _streams_for(self, device: torch.device) -> _Streams:
        if device not in self._streams:
            self._streams[device] = _Streams(device)
        return self._streams[device]

    def pack(self, tensor: torch.Tensor):
        # an empty tensor has nothing to move (torch 2.11's checkpoint saves an empty dummy beside the inputs)
        if (not tensor.is_floating_point() or tensor.nbytes < max(self.min_bytes, 1) or not tensor.is_contiguous()
                or tensor.device.type not in ("cpu", "cuda") or isinstance(tensor, nn.Parameter)):
            return tensor
        pin = tensor.device.type == "cuda"
        self.pool.reserve(tensor.shape, tensor.dtype, self.expected_inputs, pin=pin)
        buffer = self.pool.acquire(tensor.shape, tensor.dtype, pin=pin)
        if pin:
            streams = self._streams_for(tensor.device)
            streams.d2h.wait_stream(torch.cuda.current_stream(tensor.device))  # the input is written there
            if buffer.last_use is not None:
                streams.d2h.wait_event(buffer.last_use)  # the buffer's previous copy back has finished
            with torch.cuda.stream(streams.d2h):
                buffer.tensor.copy_(tensor, non_blocking=True)
                buffer.last_use = torch.cuda.Event()
                buffer.last_use.record(streams.d2h)
            tensor.record_stream(streams.d2h)  # the block is not handed out again before the copy ends
        else:
            buffer.tensor.copy_(tensor)
        saved = OffloadedInput(self, buffer, tensor.device, self._last)
        self._last = weakref.ref(saved)
        self.packed += 1
        return saved

    def _copy_back(self, saved: OffloadedInput) -> None:
        """Start the host->device copy of ``saved`` (on the h2d stream on CUDA)."""
        host = saved.buffer.tensor
        if saved.device.type != "cuda":
            saved.on_device = host.clone()
            return
        streams = self._streams_for(saved.device)
        compute = torch.cuda.current_stream(saved.device)
        out = torch.empty(host.shape, dtype=host.dtype, device=saved.device)  # allocated on the compute stream
        streams.h2d.wait_stream(compute)
        streams.h2d.wait_event(saved.buffer.last_use)  # the d2h copy has landed
        with torch.cuda.stream(streams.h2d):
            out.copy_(host, non_blocking=True)
            saved.ready = torch.cuda.Event()
            saved.ready.record(streams.h2d)
        out.record_stream(streams.h2d)
        saved.buffer.last_use = saved.ready
        saved.on_device = out

    def unpack(self, saved):
        if not isinstance(saved, OffloadedInput):
            return saved
        if saved.on_device is None:
            self._copy_back(saved)
        tensor, saved.on_device = saved.on_device, None  # unpacked again (retain_graph): copied again
        if saved.ready is not None:
            torch.cuda.current_stream(saved.device).wait_event(saved.ready)
            saved.ready = None
        previous = saved.previous() if saved.previous is not None else None
        if previous is not None and previous.on_device is None:
            self._copy_back(previous)  # layer i-1's input crosses while layer i recomputes
            self.prefetched += 1
        return tensor


# ------------------------------------------------------------------------------------------------- model wiring
class _OffloadedCheckpointFunc:
    """A layer's ``_gradient_checkpointing_func`` run inside the offloader's saved-tensor hooks."""

    def __init__(self, inner, offloader: CheckpointOffloader):
        self.inner = inner
        self.offloader = offloader

    def __call__(self, function, *args, **kwargs):
        with self.offloader.hooks():
            return self.inner(function, *args, **kwargs)


def _checkpoint_layers(hf: nn.Module) -> list[nn.Module]:
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in hf.modules() if isinstance(m, GradientCheckpointingLayer)]


def _check_checkpoint_func(func) -> None:
    if checkpoint_reentrant(func):
        raise LeantuneError("offloaded checkpoints need non-reentrant gradient checkpointing: call "
                            "gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False})")
    if "gradient_checkpointing_enable" in getattr(getattr(func, "func", func), "__qualname__", ""):
        raise LeantuneError("gradient checkpointing was enabled with transformers' offload=True, which already "
                            "offloads (synchronously): use either it or leantune's offloaded checkpoints")


def _pre_forward(offloader: CheckpointOffloader, layers: list, hf: nn.Module, args, kwargs) -> None:
    if not (hf.training and torch.is_grad_enabled()):
        return
    checkpointed = 0
    for layer in layers:
        if not (layer.gradient_checkpointing and layer.training):
            continue
        func = layer.__dict__.get("_gradient_checkpointing_func")
        if isinstance(func, _OffloadedCheckpointFunc) and func.offloader is offloader:
            checkpointed += 1
            continue
        _check_checkpoint_func(func)
        layer._gradient_checkpointing_func = _OffloadedCheckpointFunc(func, offloader)
        checkpointed += 1
    if not checkpointed:
        raise LeantuneError(
            f"offloaded checkpoints are on but gradient checkpointing is off in {type(hf).__name__}: call "
            "model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False}) "
            "(before or after enabling offload), or disable_offloaded_checkpoints(model)")
    offloader.begin_forward(checkpointed)


def enable_offloaded_checkpoints(model, *, min_bytes: int = 1 << 20, margin_gib: float = 2.0) -> CheckpointOffloader:
    """Offload each checkpointed decoder layer's input to (pinned) host memory between forward and backward.

    Args:
        model: a transformers model with ``GradientCheckpointingLayer`` decoder layers, or a PEFT wrapper of one.
            Gradient checkpointing must be non-reentrant and on at training forwards; it may be enabled before or
            after this call.
        min_bytes: saved inputs smaller than this many bytes stay on the device.
        margin_gib: GiB of host memory that must remain available once the pinned pool is allocated.

    Returns:
        The :class:`CheckpointOffloader` (its ``pool`` holds the host buffers; ``packed``/``prefetched`` count).
        Calling again replaces the previous one.

    Raises:
        ValueError: ``model`` is not a transformers model, has no checkpointable layers, or an option is invalid.
        LeantuneError: at a training forward: checkpointing off, reentrant, or transformers' own ``offload=True``;
            at the first forward of a shape: the host lacks room for the buffers plus the margin.
    """
    hf = hf_model(model)
    layers = _checkpoint_layers(hf)
    if not layers:
        raise ValueError(f"{type(hf).__name__} has no GradientCheckpointingLayer: offloaded checkpoints need "
                         "transformers' checkpointed decoder layers")
    disable_offloaded_checkpoints(model)
    offloader = CheckpointOffloader(min_bytes=min_bytes, margin_gib=margin_gib)
    handle = hf.register_forward_pre_hook(functools.partial(_pre_forward, offloader, layers), with_kwargs=True)
    hf.__dict__[_OFFLOAD_ATTR] = (offloader, handle)
    return offloader


def disable_offloaded_checkpoints(model):
    """Undo :func:`enable_offloaded_checkpoints` (layers get their checkpoint functions back, the pool is freed);
    harmless when it was never enabled. Returns ``model``."""
    hf = hf_model(model)
    state = hf.__dict__.pop(_OFFLOAD_ATTR, None)
    if state is None:
        return model
    offloader, handle = state
    handle.remove()
    for layer in _checkpoint_layers(hf):
        func = layer.__dict__.get("_gradient_checkpointing_func")
        if isinstance(func, _OffloadedCheckpointFunc):
            layer._gradient_checkpointing_func = func.inner
    offloader.pool.clear()
    return model


def offloader_of(model) -> CheckpointOffloader | None:
    """The :class:`CheckpointOffloader` enabled on ``model``, or None."""
    state = hf_model(model).__dict__.get(_OFFLOAD_ATTR)
    return state[0] if state else None
