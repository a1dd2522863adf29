"""The bound launch path (ops/_launch.py): its key is never coarser than Triton's specialisation, a changed
specialisation binds again, and on the GPU the bound launches give bit-identical results to Triton's JIT path.

On the CPU the binding logic runs against a JIT function whose compile-and-launch is replaced by a recorder (the
interpreter has no compiled kernels); the op tests (test_rope.py, test_rms_norm.py, ...) run every routed kernel
through the interpreter, where ``bound`` returns the kernel unchanged.
"""

from __future__ import annotations

import importlib
import itertools

import pytest
import torch
from conftest import ON_GPU
from triton import knobs
from triton.compiler import CompiledKernel
from triton.runtime.jit import JITFunction

from leantune import ops
from leantune.ops import _launch


# ------------------------------------------------------------------------------------------- key vs Triton's rule
def _spec(value):
    """Triton 3.6's own specialisation of one runtime argument (type string, attribute) on the CUDA backend."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.nvidia.compiler import CUDABackend

    return native_specialize_impl(CUDABackend, value, False, True, True)


def _one_arg(a):  # a kernel signature of one runtime argument
    pass


@pytest.fixture(autouse=True)
def bound_path_on(monkeypatch):
    """The bound path is off by default until proven on the card (ops/_launch.py); these tests are about it."""
    monkeypatch.setattr(_launch, "ENABLED", True)


def test_key_is_never_coarser_than_triton_specialisation():
    ints = [0, 1, 2, 15, 16, 17, 31, 32, 48, -1, -16, -17, 2**31 - 16, 2**31 - 1, 2**31, 2**31 + 16, -2**31,
            -2**31 - 1, -2**31 - 16, 2**40, 2**40 + 3, 2**63 - 1, 2**63, 2**63 + 16, 2**64 - 1]
    buf = torch.zeros(64, dtype=torch.float32)
    tensors = [buf, buf[1:], buf[4:], buf[2:].view(torch.bfloat16), buf.view(torch.bfloat16)[1:],
               buf.view(torch.int8)[8:], torch.nn.Parameter(buf.clone()), torch.nn.Parameter(buf.clone())[1:]]
    values = ints + tensors + [0.0, 1.0, 16.0, 1e300, True, False, None]
    params = JITFunction(_one_arg).params
    classes: dict = {}
    for v in values:
        source = _launch._key_source(params, (type(v),))
        assert source is not None, type(v)
        namespace: dict = {}
        exec(source, namespace)
        classes.setdefault((type(v), namespace["key"](v)), []).append(v)
    for (kind, _), members in classes.items():
        specs = {_spec(v) for v in members}
        assert len(specs) == 1, (kind, members, specs)
    # the classes do separate what Triton separates (1, multiples of 16, i32/i64, alignment, dtype, bool vs int)
    assert len({k for k in classes if k[0] is int}) >= 6
    assert _spec(buf) != _spec(buf[1:]) and _spec(1) != _spec(2) != _spec(16) and _spec(True) != _spec(1)


def test_unsupported_argument_kinds_have_no_key():
    params = JITFunction(_one_arg).params
    for kind in (tuple, list, str, torch.dtype, object):
        assert _launch._key_source(params, (kind,)) is None
    assert _launch._key_source(params, (int, int)) is None  # more arguments than parameters


# -------------------------------------------------------------------------------------- binding logic on the CPU
def _kernel(X, Y, n, scale, flag, BLOCK: "tl.constexpr", MODE: "tl.constexpr" = 0, extra=7):  # noqa: F821
    pass


class CudaLauncher:
    """Stand-in for Triton's launcher class (same name): records the C entry point's arguments."""

    global_scratch_size = 0
    profile_scratch_size = 0
    launch_cooperative_grid = False
    launch_pdl = False

    def __init__(self):
        self.calls = []

    def launch(self, *args):
        self.calls.append(args)

    def __call__(self, *args):
        raise AssertionError("the bound path calls the C entry point, not CudaLauncher.__call__")


class Recorder:
    """A JIT function whose compile+launch (``run``) is recorded; returns one CompiledKernel per distinct key."""

    def __init__(self, monkeypatch):
        self.fn = JITFunction(_kernel)
        self.jit_calls = []
        self.launchers = []
        self.fn.run = self.run
        monkeypatch.setattr(_launch, "_get_device", lambda: 0)
        monkeypatch.setattr(_launch, "_stream_getter", lambda: (lambda device: 4242))

    def run(self, *args, grid, warmup, **kwargs):
        self.jit_calls.append((grid, args, kwargs))
        compiled = object.__new__(CompiledKernel)
        launcher = CudaLauncher()
        self.launchers.append(launcher)
        compiled._run, compiled.function, compiled.packed_metadata = launcher, f"function{len(self.launchers)}", "md"
        return compiled


def test_first_launch_binds_and_later_ones_skip_the_jit(monkeypatch):
    rec = Recorder(monkeypatch)
    kernel = _launch.BoundKernel(rec.fn)
    x, y = torch.zeros(32), torch.zeros(32)
    first = kernel[(3, 2)](x, y, 48, 0.5, True, BLOCK=64, num_warps=4)
    assert len(rec.jit_calls) == 1 and rec.jit_calls[0][0] == (3, 2) and kernel.bound_count() == 1
    again = kernel[(5,)](x.clone(), y, 32, 2.0, False, BLOCK=64, num_warps=4)  # same classes: 48, 32 both "D"
    assert len(rec.jit_calls) == 1 and again is first
    (call,) = rec.launchers[0].calls
    # grid, stream, function, cooperative, pdl, no scratch, packed metadata, no launch metadata or hooks, the
    # positional arguments, then MODE's placeholder (a constexpr: ignored by the launcher) and extra's default
    assert call[:13] == (5, 1, 1, 4242, "function1", False, False, None, None, "md", None, None, None)
    assert call[13] is not x and torch.equal(call[13], x) and call[14] is y
    assert call[15:] == (32, 2.0, False, None, None, 7)


@pytest.mark.parametrize("change", ["misaligned", "int_is_1", "int_not_16", "dtype", "parameter", "bool_for_int",
                                    "float_for_int", "constexpr", "constexpr_bool", "num_warps", "i64"])
def test_a_changed_specialisation_binds_again(monkeypatch, change):
    rec = Recorder(monkeypatch)
    kernel = _launch.BoundKernel(rec.fn)
    buf = torch.zeros(64)
    args, kwargs = [buf[:32], buf[32:], 48, 0.5, True], {"BLOCK": 64, "MODE": 1, "num_warps": 4}
    kernel[(1,)](*args, **kwargs)
    kernel[(1,)](*args, **kwargs)
    assert len(rec.jit_calls) == 1
    if change == "misaligned":
        args[0] = buf[1:33]
    elif change == "int_is_1":
        args[2] = 1
    elif change == "int_not_16":
        args[2] = 50
    elif change == "dtype":
        args[1] = buf[32:].view(torch.int32)
    elif change == "parameter":
        args[1] = torch.nn.Parameter(buf[32:].clone())
    elif change == "bool_for_int":
        args[2] = True
    elif change == "float_for_int":
        args[2] = 48.0
    elif change == "constexpr":
        kwargs["BLOCK"] = 128
    elif change == "constexpr_bool":
        kwargs["MODE"] = True  # == 1 and hashes alike: only its type tells them apart
    elif change == "num_warps":
        kwargs["num_warps"] = 8
    elif change == "i64":
        args[2] = 2**31 + 16
    kernel[(1,)](*args, **kwargs)
    assert len(rec.jit_calls) == 2, "a launch with another specialisation reused a bound kernel"
    kernel[(1,)](*args, **kwargs)
    assert len(rec.jit_calls) == 2 and len(rec.launchers[1].calls) == 1


def test_jit_path_whenever_the_key_cannot_be_proven(monkeypatch):
    rec = Recorder(monkeypatch)
    kernel = _launch.BoundKernel(rec.fn)
    x = torch.zeros(32)
    args = (x, x, 16, 1.0, False)

    def jit_calls_for(launch, times=2):
        before = len(rec.jit_calls)
        for _ in range(times):
            launch()
        return len(rec.jit_calls) - before

    assert jit_calls_for(lambda: kernel[lambda meta: (1,)](*args, BLOCK=16)) == 2  # callable grid
    assert jit_calls_for(lambda: kernel[(1,)](x, x, (16,), 1.0, False, BLOCK=16)) == 2  # a tuple argument
    assert jit_calls_for(lambda: kernel[(1,)](*args, BLOCK=16, extra=3)) == 2  # runtime argument by keyword
    assert jit_calls_for(lambda: kernel[(1,)](*args, BLOCK=[16])) == 2  # unhashable constexpr
    monkeypatch.setattr(_launch, "ENABLED", False)
    assert jit_calls_for(lambda: kernel[(1,)](*args, BLOCK=16)) == 2
    monkeypatch.setattr(_launch, "ENABLED", True)
    assert jit_calls_for(lambda: kernel[(1,)](*args, BLOCK=16)) == 1  # binds, then bound

    def hook(*a, **k):
        pass

    knobs.runtime.launch_enter_hook.add(hook)  # a profiler: it must see every launch
    try:
        assert jit_calls_for(lambda: kernel[(1,)](*args, BLOCK=16)) == 2
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    rec.fn.pre_run_hooks.append(hook)
    assert jit_calls_for(lambda: kernel[(1,)](*args, BLOCK=16)) == 2
    rec.fn.pre_run_hooks.clear()
    assert jit_calls_for(lambda: kernel[(1,)](*args, BLOCK=16)) == 0


def test_full_table_is_cleared(monkeypatch):
    rec = Recorder(monkeypatch)
    kernel = _launch.BoundKernel(rec.fn)
    monkeypatch.setattr(_launch, "MAX_ENTRIES", 3)
    x = torch.zeros(8)
    for block in itertools.islice(itertools.count(16, 16), 5):
        kernel[(1,)](x, x, 16, 1.0, False, BLOCK=block)
    assert kernel.bound_count() <= 3 and len(rec.jit_calls) == 5


def test_interpreted_kernels_are_left_unwrapped():
    from leantune.ops._runtime import KERNELS_INTERPRETED

    rope = importlib.import_module("leantune.ops.rope")  # the module (leantune.ops.rope is the op's function)
    assert isinstance(rope._rope_kernel, _launch.BoundKernel) != KERNELS_INTERPRETED
    assert _launch.bound(len) is len  # not a JIT function (e.g. an autotuner): unchanged


# -------------------------------------------------------------------------------------------- bound path, on GPU
def _routed_ops():
    """Each routed kernel through its op: (name, thunk returning the tensors to compare)."""
    dev, bf = "cuda", torch.bfloat16

    def leaf(*shape, dtype=bf, scale=1.0):
        return (torch.randn(*shape, device=dev) * scale).to(dtype).requires_grad_()

    q, k = leaf(2, 4, 33, 64), leaf(2, 2, 33, 64)
    cos, sin = torch.randn(1, 33, 64, device=dev).to(bf), torch.randn(1, 33, 64, device=dev).to(bf)
    x, w = leaf(37, 96), leaf(96)
    g, u = leaf(37, 200), leaf(37, 200)
    logits, labels = leaf(37, 300), torch.randint(0, 300, (37,), device=dev)
    labels[::5] = -100
    xl, wl = leaf(37, 96), leaf(80, 96, scale=0.1).detach()
    a, b = leaf(8, 96, scale=0.1), leaf(80, 8, scale=0.1)
    mlp = [ops.LoraWeights(leaf(120, 96, scale=0.1).detach(), leaf(8, 96, scale=0.1), leaf(120, 8, scale=0.1), 2.0)
           for _ in range(2)]
    down = ops.LoraWeights(leaf(96, 120, scale=0.1).detach(), leaf(8, 120, scale=0.1), leaf(96, 8, scale=0.1), 2.0)

    def grads(outs, leaves):
        outs = outs if isinstance(outs, (tuple, list)) else (outs,)
        gs = torch.autograd.grad(outs, leaves, [torch.ones_like(o) for o in outs])
        return [o.detach() for o in outs] + list(gs)

    def lora_dropout():
        torch.manual_seed(7)
        return grads(ops.lora_linear(xl, wl, a, b, 2.0, dropout=0.25), [xl, a, b])

    return [
        ("rope", lambda: grads(ops.rope(q, k, cos, sin), [q, k])),
        ("rms_norm", lambda: grads(ops.rms_norm(x, w, 1e-5), [x, w])),
        ("rms_norm_one_row", lambda: grads(ops.rms_norm(x[:1], w, 1e-5), [x, w])),
        ("swiglu", lambda: grads(ops.swiglu(g, u), [g, u])),
        ("geglu", lambda: grads(ops.geglu(g, u), [g, u])),
        ("cross_entropy", lambda: grads(ops.cross_entropy(logits, labels), [logits])),
        ("lora_linear", lambda: grads(ops.lora_linear(xl, wl, a, b, 2.0), [xl, a, b])),
        ("lora_dropout", lora_dropout),
        ("lora_mlp", lambda: grads(ops.lora_mlp(x, mlp[0], mlp[1], down), [x, mlp[0].lora_A, down.lora_B])),
    ]


def _jit_runs(monkeypatch):
    """Count Triton JIT-path launches of every bound kernel (the bound path skips ``JITFunction.run``)."""
    counts = {"n": 0}
    seen = set()
    import gc

    for obj in gc.get_objects():
        if isinstance(obj, _launch.BoundKernel) and id(obj.fn) not in seen:
            seen.add(id(obj.fn))
            original = obj.fn.run

            def counted(*args, _original=original, **kwargs):
                counts["n"] += 1
                return _original(*args, **kwargs)

            monkeypatch.setattr(obj.fn, "run", counted, raising=False)
    return counts


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_bound_path_is_bit_identical_to_the_jit_path(monkeypatch):
    monkeypatch.setenv("LEANTUNE_BACKEND", "triton")
    jit_runs = _jit_runs(monkeypatch)
    for name, run in _routed_ops():
        monkeypatch.setattr(_launch, "ENABLED", False)
        reference = run()
        monkeypatch.setattr(_launch, "ENABLED", True)
        run()  # binds
        before = jit_runs["n"]
        for _ in range(2):
            bound = run()
            torch.cuda.synchronize()
            for i, (r, o) in enumerate(zip(reference, bound)):
                assert torch.equal(r, o), f"{name}: output {i} differs on the bound path"
        assert jit_runs["n"] == before, f"{name}: a bound launch went through Triton's JIT path"


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_alignment_and_unit_ints_bind_again_on_gpu(monkeypatch):
    """A pointer 2 bytes off 16 after an aligned one, and an int that becomes 1, must not reuse the kernel bound
    for the aligned / non-1 case (Triton specialises on both): same result as the JIT path, a new binding."""
    monkeypatch.setenv("LEANTUNE_BACKEND", "triton")
    rms_module = importlib.import_module("leantune.ops.rms_norm")
    rope_module = importlib.import_module("leantune.ops.rope")

    for kernel in (rope_module._rope_kernel, rms_module._rms_norm_forward_kernel):
        monkeypatch.setattr(kernel, "_layouts", {})  # earlier tests may have bound these shapes
    jit_runs = _jit_runs(monkeypatch)
    buf = torch.randn(2 * 4 * 33 * 64 + 1, device="cuda").to(torch.bfloat16)
    k = torch.randn(2, 2, 33, 64, device="cuda").to(torch.bfloat16)
    cos, sin = torch.randn(33, 64, device="cuda"), torch.randn(33, 64, device="cuda")
    x, w = torch.randn(37, 96, device="cuda"), torch.randn(96, device="cuda")
    cases = [
        ("rope aligned", rope_module._rope_kernel, lambda: ops.rope(buf[:-1].view(2, 4, 33, 64), k, cos, sin)),
        ("rope misaligned", rope_module._rope_kernel, lambda: ops.rope(buf[1:].view(2, 4, 33, 64), k, cos, sin)),
        ("rms_norm 37 rows", rms_module._rms_norm_forward_kernel, lambda: (ops.rms_norm(x, w, 1e-5),)),
        ("rms_norm 1 row", rms_module._rms_norm_forward_kernel, lambda: (ops.rms_norm(x[:1], w, 1e-5),)),
    ]
    for name, kernel, run in cases:
        monkeypatch.setattr(_launch, "ENABLED", False)
        reference = run()
        monkeypatch.setattr(_launch, "ENABLED", True)
        count, before = kernel.bound_count(), jit_runs["n"]
        first = run()
        assert kernel.bound_count() == count + 1 and jit_runs["n"] > before, f"{name}: reused another binding"
        before = jit_runs["n"]
        second = run()
        assert jit_runs["n"] == before, f"{name}: not bound"
        for r, a, b in zip(reference, first, second):
            assert torch.equal(r, a) and torch.equal(r, b), name
