"""Test setup: Triton's interpreter on machines without a GPU, both backends, NaN-poisoned buffers, fresh seeds."""

import gc
import os
import random
import sys

# Must happen before triton.jit decorates leantune's kernels (i.e. before leantune is imported).
if os.environ.get("TRITON_INTERPRET") is None and not os.path.exists("/dev/nvidiactl"):
    os.environ["TRITON_INTERPRET"] = "1"

sys.path.insert(0, os.path.dirname(__file__))  # `import reference` from any test

import pytest  # noqa: E402
import reference  # noqa: E402
import torch  # noqa: E402

from leantune import heap  # noqa: E402
from leantune.ops import _runtime  # noqa: E402

ON_GPU = torch.cuda.is_available() and not _runtime.interpreting()
# Test tensors are tiny: one intra-op thread per pytest worker avoids oversubscribing a 2-core machine (measured ~5x).
torch.set_num_threads(1)
DEVICE = "cuda" if ON_GPU else "cpu"


@pytest.fixture(params=["torch", "triton"])
def backend(request, monkeypatch):
    """Run the test once per backend (the Triton one through the interpreter on CPU)."""
    monkeypatch.setenv("LEANTUNE_BACKEND", request.param)
    return request.param


@pytest.fixture(autouse=True)
def poisoned_buffers():
    """Every buffer leantune allocates starts as NaN, so an unwritten element cannot pass."""
    with _runtime.use_allocator(reference.nan_allocator):
        yield


@pytest.fixture(autouse=True)
def nothing_left_frozen():
    """gc.freeze is process-wide: a test that leaves leantune's freeze on (an open or unthawed
    ``heap.long_lived_frozen`` block) fails, and the next test starts with nothing frozen."""
    yield
    left, depth = gc.get_freeze_count(), heap._depth
    gc.unfreeze()
    heap._depth, heap._thaws = 0, False
    assert depth == 0, f"{depth} long_lived_frozen block(s) left open, {left} objects frozen"


@pytest.fixture(autouse=True)
def fresh_seed(request):
    """Fresh random inputs every run; the seed is printed on failure so a failing draw can be replayed."""
    seed = int(os.environ.get("LEANTUNE_TEST_SEED", random.SystemRandom().randrange(2**31)))
    torch.manual_seed(seed)
    random.seed(seed)
    request.node.user_properties.append(("seed", seed))
    yield seed


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        seeds = [v for k, v in item.user_properties if k == "seed"]
        if seeds:
            report.sections.append(("seed", f"LEANTUNE_TEST_SEED={seeds[0]} replays this draw"))


@pytest.fixture(autouse=True)
def python_signal_handlers():
    """Each test starts with Python's own Ctrl-C handler (KeyboardInterrupt), as the ``leantune`` process has; a
    pytest-xdist worker can hold SIG_IGN for SIGINT (seen: the signal tests of test_export.py then saw no signal and
    failed, or passed without testing anything). A test that leaves a handler or the signal mask changed fails."""
    import signal

    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    yield
    changed = {signal.Signals(sig).name: signal.getsignal(sig) for sig in before
               if signal.getsignal(sig) != (signal.default_int_handler if sig == signal.SIGINT else before[sig])}
    for sig, handler in before.items():
        signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
    now = signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    assert not changed, f"signal handlers left changed: {changed}"
    assert now == mask, f"signal mask left changed: {now} (was {mask})"
