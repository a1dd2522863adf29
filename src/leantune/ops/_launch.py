"""Launching Triton kernels with less host time: compiled kernels cached per argument key (experimental).

Why: in the op benchmarks the host, not the GPU, bounds small ops (RESULTS.md: RMSNorm's kernels take 0.19 ms of a
0.28-0.33 ms fwd+bwd; lora_qkv issues 12 Triton and ~8 torch launches where PEFT issues ~53 torch ones, yet was
slower). ``kernel[grid](...)`` rebuilds the kernel's specialisation and cache key from every argument, checks
global values and builds launch metadata for the (usually empty) hook chain on each call before the C launcher runs.

How: :func:`cached` wraps a ``@triton.jit`` kernel; ``wrapped[grid](*args, **kwargs)`` keeps the JIT syntax. The
first launch with a given key goes through Triton's JIT (compiling if needed) and stores the ``CompiledKernel`` it
returns; later launches with that key call the compiled kernel's launcher directly, with every parameter in
signature order, constexprs included, as ``JITFunction.run`` does. The key is at least as strict as Triton 3.6's
specialisation (``native_specialize_impl``), so a hit is the kernel the JIT would have chosen:

- tensor: dtype, and whether the address is 16-byte aligned;
- int: 1 or not (1 becomes a constexpr), divisible by 16 or not, and its width class (i32 / i64 / u64);
- bool by value; float by type only (always an fp32 argument); None;
- constexpr parameters by type and value; launch options (num_warps, ...) by value; the current device and the
  two Triton knobs the JIT adds to its options (debug, instrumentation mode).

Anything else takes the plain JIT path: other argument kinds, a parameter left to its default, a callable or empty
grid, kernels with pre-run hooks or captured globals, and launches while a profiler's launch hook is set.

Off unless ``LEANTUNE_LAUNCH_CACHE=1`` at import (or ``ENABLED = True``) until measured on the GPU
(benchmarks/hostprof.py); never used under the interpreter, where kernels are returned unwrapped.
"""

from __future__ import annotations

import os

import torch
from triton import knobs

from . import _runtime

ENABLED = os.environ.get("LEANTUNE_LAUNCH_CACHE", "0").strip() == "1"
MAX_ENTRIES = 512  # per kernel; a full cache is cleared
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # what Triton itself uses; CUDA builds only


def _int_class(value: int) -> tuple:
    """Triton's specialisation of a runtime int: equal to 1, divisible by 16, and the integer type it is passed as."""
    width = "i32" if -2**31 <= value < 2**31 else ("i64" if -2**63 <= value < 2**63 else "u64")
    return (int, value == 1, value % 16 == 0, width)


def _runtime_key(value):
    """Key of a non-constexpr argument; TypeError for kinds not cached."""
    if isinstance(value, torch.Tensor):
        return (value.dtype, value.data_ptr() % 16 == 0)
    if isinstance(value, bool):
        return (bool, value)
    if isinstance(value, int):
        return _int_class(value)
    if isinstance(value, float):
        return float
    if value is None:
        return None
    raise TypeError(type(value))


def _constexpr_key(value):
    return (type(value), value)  # unhashable values fail when the key is hashed: JIT path


def _hooked(hook) -> bool:
    """Whether a launch hook would run (profilers): Triton 3.6 keeps an always-present, usually empty, chain."""
    return hook is not None and bool(getattr(hook, "calls", True))


def _stream(device: int) -> int:
    return _raw_stream(device) if _raw_stream is not None else torch.cuda.current_stream(device).cuda_stream


class CachedKernel:
    """A ``@triton.jit`` kernel launched through a per-key cache of compiled kernels (see the module doc)."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.arg_names = list(kernel.arg_names)
        self.params = frozenset(self.arg_names)
        self.key_fns = [_constexpr_key if p.is_constexpr else _runtime_key for p in kernel.params]
        self.compiled: dict[tuple, object] = {}

    def __getattr__(self, name):  # everything else is the JIT function's
        return getattr(self.kernel, name)

    def __getitem__(self, grid):
        if not ENABLED or callable(grid) or not grid:
            return self.kernel[grid]
        return lambda *args, **kwargs: self._launch(grid, args, kwargs)

    def _cacheable(self) -> bool:
        return not (getattr(self.kernel, "pre_run_hooks", None) or getattr(self.kernel, "used_global_vals", None)
                    or _hooked(knobs.runtime.launch_enter_hook) or _hooked(knobs.runtime.launch_exit_hook))

    def _launch(self, grid, args, kwargs):
        try:
            values = list(args) + [kwargs[name] for name in self.arg_names[len(args):]]
            device = torch.cuda.current_device()
            options = tuple(sorted((k, v) for k, v in kwargs.items() if k not in self.params))
            key = (device, knobs.runtime.debug, knobs.compilation.instrumentation_mode, options,
                   *(fn(v) for fn, v in zip(self.key_fns, values)))
            compiled = self.compiled.get(key)  # hashing here rejects unhashable constexprs/options (TypeError)
        except (KeyError, TypeError):
            return self.kernel[grid](*args, **kwargs)
        if compiled is None or not self._cacheable():
            launched = self.kernel[grid](*args, **kwargs)
            if compiled is None and launched is not None and self._cacheable():
                if len(self.compiled) >= MAX_ENTRIES:
                    self.compiled.clear()
                self.compiled[key] = launched
            return launched
        grid = tuple(grid) + (1,) * (3 - len(grid))
        compiled.run(grid[0], grid[1], grid[2], _stream(device), compiled.function, compiled.packed_metadata, None,
                     None, None, *values)
        return compiled


def cached(kernel):
    """Decorator over ``@triton.jit``: the kernel with cached launches (unchanged under the interpreter)."""
    return kernel if _runtime.KERNELS_INTERPRETED else CachedKernel(kernel)
