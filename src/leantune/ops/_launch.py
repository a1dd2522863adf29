"""Launching Triton kernels with less host time: the compiled kernel cached per exact argument key (experimental).

Why: in the op benchmarks the host, not the GPU, bounds small ops (RESULTS.md: RMSNorm's kernels take 0.19 ms of a
0.28-0.33 ms fwd+bwd). ``kernel[grid](...)`` re-derives the kernel's specialisation from every argument on each
call (binder, cache-key string, global-value checks) before the C launcher runs.

How: :func:`cached` wraps a ``@triton.jit`` kernel; ``wrapped[grid](*args, **kwargs)`` keeps the JIT syntax. The
first launch with a given key goes through Triton's JIT (compiling if needed) and stores the ``CompiledKernel`` it
returns; later launches with the same key call the compiled kernel's launcher directly. The key is stricter than
Triton's specialisation, so a hit is always the kernel the JIT would have chosen: per tensor its dtype and whether
its address is 16-byte aligned (what Triton specialises pointers on), every int/bool by type and exact value, every
float by type only (always an fp32 argument), constexprs and launch options (num_warps, ...) by value, and the current device.
Anything else (None pointers are fine; other objects, launch hooks set, a kernel parameter left to its default)
takes the plain JIT path.

Off unless ``LEANTUNE_LAUNCH_CACHE=1`` at import (or ``ENABLED = True``) until measured on the GPU
(benchmarks/hostprof.py); never used under the interpreter, where kernels are returned unwrapped.
"""

from __future__ import annotations

import os

import torch
from triton import knobs

from . import _runtime

ENABLED = os.environ.get("LEANTUNE_LAUNCH_CACHE", "0").strip() == "1"
MAX_ENTRIES = 512  # per kernel; a full cache is cleared (shapes that keep changing fall back to the JIT path)


def _arg_key(value):
    """Hashable key of one argument, or raise TypeError for kinds not cached."""
    if isinstance(value, torch.Tensor):
        return (value.dtype, value.data_ptr() % 16 == 0)
    if isinstance(value, (bool, int)):
        return (type(value), value)
    if isinstance(value, float):
        return float
    if value is None or isinstance(value, str):
        return value
    raise TypeError(type(value))


def _hooked(hook) -> bool:
    """Whether a launch hook would run (profilers): Triton 3.6 keeps an always-present, usually empty, chain."""
    return hook is not None and bool(getattr(hook, "calls", True))


class CachedKernel:
    """A ``@triton.jit`` kernel launched through a per-key cache of compiled kernels (see the module doc)."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.arg_names = list(kernel.arg_names)
        self.params = frozenset(self.arg_names)
        self.compiled: dict[tuple, object] = {}

    def __getattr__(self, name):  # everything else is the JIT function's
        return getattr(self.kernel, name)

    def __getitem__(self, grid):
        if not ENABLED or callable(grid):
            return self.kernel[grid]
        return lambda *args, **kwargs: self._launch(grid, args, kwargs)

    def _launch(self, grid, args, kwargs):
        try:
            values = list(args) + [kwargs[name] for name in self.arg_names[len(args):]]
            options = tuple(sorted((k, v) for k, v in kwargs.items() if k not in self.params))
            key = (torch.cuda.current_device(), *map(_arg_key, values), options)
            hash(key)
        except (KeyError, TypeError):
            return self.kernel[grid](*args, **kwargs)
        compiled = self.compiled.get(key)
        if compiled is None or _hooked(knobs.runtime.launch_enter_hook) or _hooked(knobs.runtime.launch_exit_hook):
            compiled = self.kernel[grid](*args, **kwargs)
            if len(self.compiled) >= MAX_ENTRIES:
                self.compiled.clear()
            self.compiled[key] = compiled
            return compiled
        grid = tuple(grid) + (1,) * (3 - len(grid))
        stream = torch.cuda.current_stream().cuda_stream
        compiled.run(grid[0], grid[1], grid[2], stream, compiled.function, compiled.packed_metadata, None, None, None,
                     *values)
        return compiled


def cached(kernel):
    """Decorator over ``@triton.jit``: the kernel with cached launches (unchanged under the interpreter)."""
    return kernel if _runtime.KERNELS_INTERPRETED else CachedKernel(kernel)
