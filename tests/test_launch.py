"""The launch cache of ops/_launch.py, with a stand-in for Triton's JIT function (the real path needs a GPU: run the
whole suite there with LEANTUNE_LAUNCH_CACHE=1 to exercise it on every kernel)."""

from __future__ import annotations

import pytest
import torch

from leantune.ops import _launch


class FakeCompiled:
    function, packed_metadata = "fn", "meta"

    def __init__(self):
        self.runs = []

    def run(self, *launch):
        self.runs.append(launch)


class FakeParam:
    def __init__(self, is_constexpr):
        self.is_constexpr = is_constexpr


class FakeJIT:
    """Records JIT launches; each returns a new compiled kernel, as a compile would."""

    arg_names = ["X", "n", "eps", "BLOCK"]
    params = [FakeParam(False), FakeParam(False), FakeParam(False), FakeParam(True)]

    def __init__(self):
        self.jit_launches = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.jit_launches.append((grid, args, kwargs))
            return FakeCompiled()
        return launch


@pytest.fixture
def fake_cuda(monkeypatch):
    monkeypatch.setattr(_launch, "ENABLED", True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)

    class Stream:
        cuda_stream = 1234

    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: Stream())
    monkeypatch.setattr(_launch, "_raw_stream", None)


def test_same_key_launches_the_cached_kernel_with_every_argument(fake_cuda):
    jit = FakeJIT()
    kernel = _launch.CachedKernel(jit)
    x = torch.zeros(8)
    first = kernel[(3,)](x, 5, 1e-6, BLOCK=64, num_warps=4)
    assert len(jit.jit_launches) == 1 and first.runs == []
    second = kernel[(7, 2)](x, 5, 2e-6, BLOCK=64, num_warps=4)  # floats are not part of the specialisation
    assert second is first and len(jit.jit_launches) == 1
    assert first.runs == [(7, 2, 1, 1234, "fn", "meta", None, None, None, x, 5, 2e-6, 64)]


@pytest.mark.parametrize("change", ["int 1", "int multiple of 16", "int64", "int vs bool", "dtype", "alignment",
                                    "constexpr", "constexpr type", "num_warps", "device", "debug knob"])
def test_any_specialisation_change_goes_through_the_jit(fake_cuda, monkeypatch, change):
    from triton import knobs

    jit = FakeJIT()
    kernel = _launch.CachedKernel(jit)
    base = torch.zeros(16)
    args, kwargs = [base, 5, 1e-6], {"BLOCK": 64, "num_warps": 4}
    kernel[(1,)](*args, **kwargs)
    kernel[(1,)](base, 7, 2e-6, BLOCK=64, num_warps=4)  # same specialisation: a hit
    assert len(jit.jit_launches) == 1
    if change == "int 1":
        args[1] = 1  # Triton turns 1 into a constexpr
    elif change == "int multiple of 16":
        args[1] = 32
    elif change == "int64":
        args[1] = 2**31 + 5
    elif change == "int vs bool":
        args[1] = True
    elif change == "dtype":
        args[0] = torch.zeros(16, dtype=torch.float64)
    elif change == "alignment":
        args[0] = base[1:]  # 4 bytes past a 16-byte boundary
    elif change == "constexpr":
        kwargs["BLOCK"] = 128
    elif change == "constexpr type":
        kwargs["BLOCK"] = 64.0  # equal to 64 and hashes alike
    elif change == "num_warps":
        kwargs["num_warps"] = 8
    elif change == "device":
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    else:
        monkeypatch.setattr(knobs.runtime, "debug", True)
    kernel[(1,)](*args, **kwargs)
    assert len(jit.jit_launches) == 2


def test_uncached_kinds_and_disabled_cache_use_the_jit(fake_cuda, monkeypatch):
    jit = FakeJIT()
    kernel = _launch.CachedKernel(jit)
    for _ in range(2):
        kernel[(1,)](torch.zeros(4), [1, 2], 1.0, BLOCK=8)  # a list argument: not cached
        kernel[(1,)](torch.zeros(4), 3, 1.0)  # BLOCK left out: Triton's own error or default, not ours
    assert len(jit.jit_launches) == 4
    monkeypatch.setattr(_launch, "ENABLED", False)
    kernel[(1,)](torch.zeros(4), 3, 1.0, BLOCK=8)
    kernel[(1,)](torch.zeros(4), 3, 1.0, BLOCK=8)
    assert len(jit.jit_launches) == 6 and kernel.compiled == {}


def test_full_cache_is_cleared(fake_cuda, monkeypatch):
    monkeypatch.setattr(_launch, "MAX_ENTRIES", 3)
    kernel = _launch.CachedKernel(FakeJIT())
    for block in range(5):
        kernel[(1,)](torch.zeros(4), 3, 1.0, BLOCK=block)
    assert 1 <= len(kernel.compiled) <= 3


def test_kernels_are_unwrapped_under_the_interpreter():
    from leantune.ops import _runtime, rms_norm  # noqa: F401

    module = __import__("leantune.ops.rms_norm", fromlist=["_rms_norm_forward_kernel"])
    kernel = module._rms_norm_forward_kernel
    assert isinstance(kernel, _launch.CachedKernel) != _runtime.KERNELS_INTERPRETED


def test_launch_hooks_force_the_jit_path(fake_cuda):
    from triton import knobs

    jit = FakeJIT()
    kernel = _launch.CachedKernel(jit)
    kernel[(1,)](torch.zeros(4), 3, 1.0, BLOCK=8)
    hook = lambda metadata: None
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        kernel[(1,)](torch.zeros(4), 3, 1.0, BLOCK=8)  # a profiler's hook must see the launch
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    kernel[(1,)](torch.zeros(4), 3, 1.0, BLOCK=8)
    assert len(jit.jit_launches) == 2 and len(kernel.compiled) == 1  # the hooked launch stored nothing


def test_empty_or_callable_grid_uses_the_jit(fake_cuda):
    jit = FakeJIT()
    kernel = _launch.CachedKernel(jit)
    for _ in range(2):
        kernel[()](torch.zeros(4), 3, 1.0, BLOCK=8)
        kernel[lambda meta: (1,)](torch.zeros(4), 3, 1.0, BLOCK=8)
    assert len(jit.jit_launches) == 4 and kernel.compiled == {}
