"""Triton launches with the argument binding done once per specialisation (docs/design.md, "Launch path").

Why: ``kernel[grid](...)`` in Triton 3.6 (``JITFunction.run``) re-derives the kernel's specialisation from every
argument on every call (the binder, a cache-key string of the options, the global-value check, a ``LazyDict`` of
launch metadata, the launch-hook chains called from C) before the C launcher runs: ~20 us per launch on the lent
H200 host, where the launcher alone (``CompiledKernel.run``) took 7.6 us (benchmarks/history.md, 2026-11-30).

How: :func:`bound` wraps a ``@triton.jit`` kernel; ``kernel[grid](*args, **kwargs)`` keeps Triton's syntax. The
first launch with a given key goes through Triton's JIT path (compiling if needed) and keeps the ``CompiledKernel``
it returns; later launches with the same key call that kernel's C launcher directly, on the current CUDA stream.

The key is never coarser than Triton's specialisation (checked against ``native_specialize_impl`` in
tests/test_launch.py), so a hit is the kernel the JIT would have chosen:
- per positional argument its Python type (bool and int apart, a Parameter apart from a Tensor);
- per tensor its dtype and whether its address is a multiple of 16 (Triton's "D" pointer attribute);
- per int whether it is 1 (Triton makes it a constexpr), a multiple of 16 ("D"), and ``value >> 31`` (0 or -1 for
  Triton's i32 range; i64 and u64 values get finer classes than Triton's, never coarser);
- floats, bools and None by type only (always fp32, u1, a constexpr None);
- constexprs (positional or keyword) and launch options (``num_warps``...) by value;
- the current CUDA device and ``triton.knobs.runtime.debug``.
Anything else takes the JIT path on every call: other argument kinds (tuples, descriptors), a callable grid, launch
hooks set (profilers see every launch with its metadata), pre-run hooks, a non-constexpr parameter passed by keyword,
an unhashable constexpr, an asynchronous compile, :data:`ENABLED` false. Not re-checked on a hit (read once, at the
JIT launch that bound the key): Triton's check that the globals a kernel reads have not changed (leantune's kernels
read module constants only) and ``TRITON_INSTRUMENTATION_MODE``.

Under ``TRITON_INTERPRET=1`` the kernel is returned unchanged: the interpreter has no compiled kernels, so CPU tests
run the JIT path and prove the call sites unchanged; the bound path is proven on the GPU (tests/test_launch.py).
"""

from __future__ import annotations

import functools

import torch
from triton import knobs
from triton.compiler import CompiledKernel
from triton.knobs import HookChain
from triton.runtime.jit import JITFunction

from . import _runtime

# Off until tests/test_launch.py's GPU cases and benchmarks/launch_probe.py have run on the card (no device time was
# left in the session that wrote this: benchmarks/NOTES.md). False: every launch through Triton's JIT path.
ENABLED = False
MAX_ENTRIES = 256  # bound kernels kept per argument layout; a full table is cleared (shapes that keep changing)

_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)
_TYPE_ONLY = (float, bool, type(None))  # Triton specialises these by type alone (fp32, u1, constexpr None)
_UNSUPPORTED = object()


def _current_device() -> int:
    return torch.cuda.current_device()


_get_device = getattr(torch._C, "_cuda_getDevice", _current_device)  # what torch.cuda.current_device returns


def _stream_getter():
    """Triton's own getter of the current raw CUDA stream (what ``JITFunction.run`` launches on)."""
    from triton.runtime import driver

    return driver.active.get_current_stream


def _key_source(params, types) -> str | None:
    """Python source of ``key(a0, a1, ...)``: the specialisation-relevant facts of positional arguments of these
    types, or None when one of them is a kind the key does not cover."""
    if len(types) > len(params):
        return None
    terms = []
    for i, (param, kind) in enumerate(zip(params, types)):
        a = f"a{i}"
        if param.is_constexpr:
            terms.append(a)
        elif kind in _TENSOR_TYPES:
            terms.append(f"{a}.dtype, {a}.data_ptr() & 15 == 0")
        elif kind is int:
            terms.append(f"{a} == 1, {a} & 15 == 0, {a} >> 31")
        elif kind not in _TYPE_ONLY:
            return None
    names = ", ".join(f"a{i}" for i in range(len(types)))
    return f"def key({names}):\n    return ({', '.join(terms)}{',' if len(terms) == 1 else ''})\n"


class BoundKernel:
    """A ``@triton.jit`` kernel whose launches skip Triton's binder once a key is bound (see the module doc).

    ``kernel[grid](*args, **kwargs)`` as for the JIT function; ``grid`` a tuple of 1 to 3 ints. Returns what Triton
    returns (the ``CompiledKernel``). ``kernel.fn`` is the JIT function (for the normal path and introspection).
    """

    def __init__(self, fn: JITFunction):
        self.fn = fn
        self._params = fn.params
        self._layouts: dict[tuple, object] = {}

    def __repr__(self):
        return f"BoundKernel({self.fn!r})"

    def __getitem__(self, grid):
        if callable(grid) or torch.compiler.is_compiling():  # dynamo traces a JIT launch, not the binding (exec, C)
            return self.fn[grid]
        return functools.partial(self._launch, grid)

    def bound_count(self) -> int:
        """Keys bound so far (tests: a changed specialisation binds a new one)."""
        return sum(len(layout[1]) for layout in self._layouts.values() if layout is not _UNSUPPORTED)

    def _layout(self, types: tuple, n_args: int):
        source = _key_source(self._params, types[:n_args])
        if source is None:
            layout = _UNSUPPORTED
        else:
            namespace: dict = {}
            exec(source, namespace)  # one generated function per layout: no per-argument Python call per launch
            layout = (namespace["key"], {})
        self._layouts[types] = layout
        return layout

    def _launch(self, grid, *args, **kwargs):
        key = None
        if ENABLED:
            types = (*map(type, args), *map(type, kwargs.values()))
            layout = self._layouts.get(types)
            if layout is None:
                layout = self._layout(types, len(args))
            if layout is not _UNSUPPORTED:
                keyfn, entries = layout
                runtime = knobs.runtime
                try:
                    key = (_get_device(), runtime.debug, keyfn(*args), *kwargs.items())
                    entry = entries.get(key)
                except Exception:  # an unhashable constexpr or option, a tensor without an address: the JIT decides
                    entry = key = None
                enter, leave = runtime.launch_enter_hook, runtime.launch_exit_hook
                quiet = (enter.__class__ is HookChain and not enter.calls and leave.__class__ is HookChain
                         and not leave.calls and not self.fn.pre_run_hooks)
                if not quiet:
                    key = None
                elif entry is not None:
                    launch, function, head, tail, stream_of, compiled = entry
                    n = len(grid)
                    launch(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, stream_of(key[0]), function,
                           *head, *args, *tail)
                    return compiled
        compiled = self.fn[grid](*args, **kwargs)
        if key is not None:
            self._bind(key, entries, compiled, len(args), kwargs)
        return compiled

    def _bind(self, key, entries, compiled, n_args, kwargs) -> None:
        """Keep what a later launch with ``key`` needs: the C launcher, the CUfunction, the launcher's leading
        arguments and the values of the parameters after the positional ones (defaults; constexpr placeholders,
        which the launcher ignores)."""
        if type(compiled) is not CompiledKernel or compiled.function is None:
            return  # an asynchronous compile, or a kernel Triton did not load
        tail = []
        for param in self._params[n_args:]:
            if param.is_constexpr:
                tail.append(None)
            elif param.name in kwargs or not param.has_default:
                return  # a runtime argument by keyword: its value is not fixed by the key
            else:
                tail.append(param.default)
        launcher = compiled.run
        if (type(launcher).__name__ == "CudaLauncher" and callable(getattr(launcher, "launch", None))
                and not getattr(launcher, "global_scratch_size", 1)
                and not getattr(launcher, "profile_scratch_size", 1)):
            # CudaLauncher.__call__ only adds (cooperative, pdl, no scratch buffers) before the C entry point
            launch = launcher.launch
            head = (launcher.launch_cooperative_grid, launcher.launch_pdl, None, None, compiled.packed_metadata,
                    None, None, None)
        else:
            launch = launcher
            head = (compiled.packed_metadata, None, None, None)  # launch metadata, enter hook, exit hook: none
        if len(entries) >= MAX_ENTRIES:
            entries.clear()
        entries[key] = (launch, compiled.function, head, tuple(tail), _stream_getter(), compiled)


def bound(fn):
    """Decorator over ``@triton.jit``: the kernel launched through :class:`BoundKernel` (unchanged under the
    interpreter, or for anything that is not a plain JIT function, e.g. an autotuner)."""
    if _runtime.KERNELS_INTERPRETED or not isinstance(fn, JITFunction):
        return fn
    return BoundKernel(fn)
