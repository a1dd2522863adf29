"""What every ``leantune bench`` command shares: the time budget, child processes, the card's ceilings, the model
config and environment of a result, and table cells.

Every measurement runs in a child process (``run_child``): monkey patches (Liger's are module-level) never leak
between implementations, and the parent never touches the GPU, so it holds no CUDA context that would shrink the
children's memory. Every child is bounded: the parent passes the invocation's remaining budget (``Budget``) as the
child's timeout and starts no child it cannot expect to finish. The timing method and the floors are in
(docs/design.md, "Timing harness and floors").

Nothing heavy is imported at module level (torch, transformers and triton load inside the functions that need them),
so the command line can import this module and still answer ``--help`` at once.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from ..errors import LeantuneError

GiB = 1024**3
CHILD = "leantune.bench.step"  # the child of `bench e2e` and `bench max-context`: one run of one implementation
# Calls longer than this are device-bound: a CUDA-graph replay would only repeat do_bench, and interleaved rounds
# (bench/ops.py, ROUNDS) are not needed against the host's drifting speed.
GRAPH_MAX_MS = 20.0
# The cases of `bench ops` (the keys of op_cases.CASES, which imports torch): named here for the CLI's --help.
OP_NAMES = ("rms_norm", "rope", "swiglu", "cross_entropy", "linear_cross_entropy", "linear_cross_entropy_low",
            "linear_cross_entropy_512m", "lora_mlp", "lora_mlp_bf16", "lora_qkv", "lora_qkv_bf16", "nf4_dequant")


class BenchError(LeantuneError):
    """A user-facing error of the benchmark (no CUDA, bad option): the CLI prints it on one line."""


class RangeError(BenchError, ValueError):
    """A max-context range without a length to probe (a user error on the CLI, a ValueError to callers)."""


def check_range(lo: int, hi: int, step: int) -> None:
    """RangeError unless [lo, hi] holds a positive multiple of ``step`` (max-context's --lo/--hi/--step)."""
    if step <= 0:
        raise RangeError(f"--step must be positive, got {step}")
    if lo < 1 or -(-lo // step) > hi // step:
        raise RangeError(f"no multiple of {step} in [{lo}, {hi}] (--step, --lo, --hi; expected 1 <= lo <= hi)")


# ----------------------------------------------------------------------------------------------------- model config
def model_name(config_path: str) -> str:
    """The name a model's results are filed under: its folder's name (of config.json's folder for a file)."""
    path = Path(config_path)
    return (path.parent if path.name.endswith(".json") else path).name


def load_config(spec_config: str, layers: int | None = None):
    """The ``transformers`` config of a model folder or config.json, ``num_hidden_layers`` set to ``layers`` when
    given. Raises BenchError naming the path when it is missing or unreadable."""
    from transformers import AutoConfig

    path = Path(spec_config)
    if not path.exists():
        raise BenchError(f"model config not found: {spec_config}")
    if path.is_dir() and not (path / "config.json").exists():
        raise BenchError(f"no config.json in {spec_config}")
    try:
        config = AutoConfig.from_pretrained(str(path))
    except (OSError, ValueError, KeyError) as exc:  # invalid JSON, an unknown model_type
        raise BenchError(f"cannot read model config {spec_config}: {' '.join(str(exc).split())[:300]}") from None
    if layers:
        config.num_hidden_layers = layers
    return config


def environment(device: str) -> dict:
    """Date, GPU name and library versions (recorded in every result)."""
    import platform

    import peft
    import torch
    import transformers

    versions = {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__,
                "python": platform.python_version()}
    for name, dist in (("triton", "triton"), ("liger_kernel", "liger-kernel")):
        try:
            module = __import__(name)
        except ImportError:
            continue
        try:  # liger_kernel has no __version__: ask the installed distribution
            versions[name] = getattr(module, "__version__", None) or importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "?"
    gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    return {"date": time.strftime("%Y-%m-%d %H:%M"), "gpu": gpu, "versions": versions}


# ------------------------------------------------------------------------------------------------- child processes
def child_env() -> dict:
    """The parent's environment with this package's source root first on PYTHONPATH (children import the same
    leantune)."""
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def run_child(args: list[str], result: Path, log: Path, timeout_s: float, *, module: str = CHILD,
              keep: bool = True, nproc: int | None = None) -> dict:
    """Run ``python -m MODULE ARGS`` (children of ``CHILD`` get ``--result RESULT`` appended) with stdout+stderr
    into ``log``; the JSON it wrote to ``result``, or a status of timeout / crashed (with the log's tail).
    ``nproc`` launches it under ``torchrun --standalone --nproc_per_node NPROC`` instead (rank 0 writes the JSON).

    The child writes beside ``result`` under a hidden temporary name (``RESULT`` in ``args`` is replaced by it),
    moved onto ``result`` (and a ``.md`` it wrote beside it) only when it succeeds: a failing rerun never deletes a
    good result. With ``keep=False`` nothing is moved: the caller decides what to store from the returned dict.
    """
    fresh = result.with_name(f".new-{result.name}")
    scratch = (fresh, fresh.with_suffix(".md"))
    for path in scratch:  # a killed run's leftovers must not pass for this child's output
        path.unlink(missing_ok=True)
    launcher = [] if nproc is None else ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
    cmd = [sys.executable, *launcher, "-m", module, *[str(fresh) if a == str(result) else a for a in args]]
    if module == CHILD:
        cmd += ["--result", str(fresh)]
    t0 = time.perf_counter()
    try:
        with log.open("w") as fh:
            try:
                rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=child_env(),
                                    timeout=max(timeout_s, 1)).returncode
            except subprocess.TimeoutExpired:
                rc = None
        wall = time.perf_counter() - t0
        if rc == 0 and fresh.exists():
            found = json.loads(fresh.read_text())
            if keep:
                os.replace(fresh, result)
                if scratch[1].exists():
                    os.replace(scratch[1], result.with_suffix(".md"))
            return {**found, "wall_s": wall}
    finally:  # also on Ctrl-C: no scratch result left for `bench report` to find
        for path in scratch:
            path.unlink(missing_ok=True)
    if rc is None:
        return {"status": "timeout", "error": f"killed after {timeout_s:.0f} s", "wall_s": timeout_s}
    tail = " | ".join(log.read_text(errors="replace").strip().splitlines()[-3:])[-400:]
    return {"status": "crashed", "error": f"exit {rc}: {tail}", "wall_s": wall}


class Budget:
    """Wall-clock budget of one invocation; ``can_start`` says whether another child is expected to finish."""

    def __init__(self, seconds: float, clock: Callable[[], float] = time.monotonic):
        self.seconds, self.clock, self.start = seconds, clock, clock()
        self.longest = 0.0  # longest child so far: the estimate for the next

    def left(self) -> float:
        return self.seconds - (self.clock() - self.start)

    def can_start(self, estimate: float = 0.0) -> bool:
        return self.left() > max(estimate, self.longest, 1.0)

    def record(self, wall_s: float) -> None:
        self.longest = max(self.longest, wall_s)


# ------------------------------------------------------------------------------------------------------ the card
def require_cuda() -> None:
    """BenchError unless a CUDA device is visible (every measuring command needs one; the report does not)."""
    import torch

    if not torch.cuda.is_available():
        raise BenchError("`leantune bench` needs a CUDA GPU (none is visible); `leantune bench report` works "
                         "anywhere")


def measure_ceilings() -> dict:
    """Copy bandwidth (bytes read + written per s, over a 2 GiB fp32 copy) and bf16 matmul rate (FLOP/s, 8192^3) of
    this card, measured now (the medians of ``triton.testing.do_bench``). CUDA only."""
    import torch
    from triton.testing import do_bench

    src = torch.randn(2 * GiB // 4, device="cuda")
    dst = torch.empty_like(src)
    copy_ms = do_bench(lambda: dst.copy_(src), warmup=50, rep=400, return_mode="median")
    copy_rate = 2 * src.numel() * 4 / (copy_ms * 1e-3)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm_ms = do_bench(lambda: a @ b, warmup=100, rep=500, return_mode="median")
    mm_rate = 2 * 8192**3 / (mm_ms * 1e-3)
    torch.cuda.empty_cache()
    return {"copy_bytes_per_s": copy_rate, "matmul_flop_per_s": mm_rate}


# ------------------------------------------------------------------------------------------------------- tables
def table_cell(text, limit: int | None = None) -> str:
    """``text`` on one markdown table line: whitespace runs (newlines of CUDA errors) collapsed, ``|`` as ``/``."""
    return " ".join(str(text).split())[:limit].replace("|", "/")
