"""End-to-end LoRA training-step benchmark and max-context bisection: leantune vs HF+PEFT vs HF+PEFT+Liger (CUDA).

What one run measures (one implementation x one model x seq x batch x gradient checkpointing), in its own process
(``python -m leantune.bench.e2e --one SPEC_JSON --result PATH``) so that monkey patches (Liger's are module-level)
never leak between implementations:

- model: a config folder (or config.json), random init directly on the device in bf16, then every matrix re-drawn
  from (seed, parameter name) (``seeded_init``: identical weights whatever classes Liger swapped in); PEFT LoRA
  r=16, alpha=32 on all 7 projections, ``init_lora_weights=False`` (non-zero B, so every gradient is non-trivial),
  adapters in fp32 (PEFT's default); sdpa attention; fused AdamW on the LoRA parameters; gradient checkpointing
  non-reentrant with ``enable_input_require_grads``.
- implementations: ``hf+peft`` (HF modules, eager), ``hf+peft+liger`` (``apply_liger_kernel_to_llama()`` before the
  model is built; skipped with a note when liger_kernel is not importable), ``leantune`` (``leantune.patch`` after
  ``get_peft_model``).
- the optimizer state is created up front (one AdamW step with lr 0 on zero gradients), so every step, even the
  first, holds steady-state memory; then ``warmup`` steps, then ``steps`` timed steps (each CUDA-synchronised;
  the same token batch every step).
- first step: loss and the global L2 norm of all LoRA gradients (before the optimizer update, outside the timed
  part); same seed, same weights, same tokens in every implementation, so these must agree
  (``report.flag_agreement``).
- tokens/s = steps * batch * seq / total timed seconds; peak GiB = ``max_memory_allocated`` over all steps after
  ``reset_peak_memory_stats`` (taken after the model is built); peak minus the bytes of the frozen weights.
- MFU / HFU (computed by the parent and the report) against the bf16 matmul ceiling (8192^3,
  ``ops.measure_ceilings``) measured ONCE per invocation, in its own child process before the runs (the parent never
  touches the GPU, so it holds no CUDA context that would shrink the children's memory); ``--matmul-tflops`` reuses
  a known value instead.

FLOPs per token (issue 7), P = matmul weight parameters including lm_head (counted even when tied: it is still a
matmul), P_layers = P without lm_head, A = 2*S*Hq*D*L (the causal half of QK^T and PV, S = sequence length):
model FLOPs = 4*P + 3*A (forward 2P + A; backward of frozen weights needs only dX: 2P; attention backward 2A);
hardware FLOPs = model FLOPs + (2*P_layers + A) under gradient checkpointing (the recomputed layer forwards).
LoRA adapter FLOPs are left out (< 1% at r=16).

Max context: bisection over multiples of ``step`` for the longest batch-1 sequence whose step fits; every probe is
its own process (one training step after the optimizer state exists; ``torch.OutOfMemoryError`` = does not fit).

Every child is bounded: the parent passes the invocation's remaining ``budget_s`` as the child's timeout and starts
no run it cannot expect to finish (it then lists what was left, and for max-context the bracket to resume from).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from ..errors import LeantuneError

GiB = 1024**3
IMPLS = ("hf+peft", "hf+peft+liger", "leantune")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class BenchError(LeantuneError):
    """A user-facing error of the benchmark (no CUDA, bad option): the CLI prints it on one line."""


# ------------------------------------------------------------------------------------------------------------ FLOPs
def _dims(config) -> dict:
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return {"H": config.hidden_size, "Hq": heads, "Hk": getattr(config, "num_key_value_heads", None) or heads,
            "D": head_dim, "I": config.intermediate_size, "L": config.num_hidden_layers, "V": config.vocab_size}


def matmul_params(config, *, lm_head: bool = True) -> int:
    """Weight parameters that take part in a matmul per token: q, k, v, o, gate, up, down of every layer, plus the
    lm_head ([V, H]) when ``lm_head`` (counted even when tied to the embedding). Embeddings and norms excluded."""
    d = _dims(config)
    per_layer = d["H"] * d["Hq"] * d["D"] * 2 + d["H"] * d["Hk"] * d["D"] * 2 + 3 * d["H"] * d["I"]
    return d["L"] * per_layer + (d["V"] * d["H"] if lm_head else 0)


def attention_flops_per_token(config, seq: int) -> int:
    """A = 2*S*Hq*D*L: forward FLOPs per token of QK^T and PV over the causal half (S/2 keys on average)."""
    d = _dims(config)
    return 2 * seq * d["Hq"] * d["D"] * d["L"]


def model_flops_per_token(config, seq: int) -> int:
    """4*P + 3*A: forward 2P + A, backward 2P (dX only, weights frozen) + 2A. LoRA FLOPs excluded."""
    return 4 * matmul_params(config) + 3 * attention_flops_per_token(config, seq)


def hardware_flops_per_token(config, seq: int, gradient_checkpointing: bool) -> int:
    """Model FLOPs plus, under gradient checkpointing, the recomputed layer forwards: 2*P_layers + A."""
    extra = 2 * matmul_params(config, lm_head=False) + attention_flops_per_token(config, seq)
    return model_flops_per_token(config, seq) + (extra if gradient_checkpointing else 0)


def utilization(tokens_per_s: float, flops_per_token: float, matmul_flop_per_s: float) -> float:
    """Fraction (0..1) of the matmul ceiling: tokens/s * FLOPs/token / (FLOP/s). NaN when an input is missing."""
    if not tokens_per_s or not matmul_flop_per_s or flops_per_token is None:
        return math.nan
    return tokens_per_s * flops_per_token / matmul_flop_per_s


def frozen_weight_bytes(model) -> int:
    """Bytes of the parameters that do not require grad (the frozen base weights), tied storages counted once."""
    seen: dict[int, int] = {}
    for p in model.parameters():
        if not p.requires_grad:
            seen[p.untyped_storage().data_ptr()] = p.untyped_storage().nbytes()
    return sum(seen.values())


def default_shape(config) -> tuple[int, int]:
    """(seq, batch) of issue 7: 4096x1 for 8B-class models (P >= 3e9 matmul params), 8192x2 for smaller ones."""
    return (4096, 1) if matmul_params(config) >= 3e9 else (8192, 2)


# -------------------------------------------------------------------------------------------------------- bisection
class RangeError(BenchError, ValueError):
    """A max-context range without a length to probe (a user error on the CLI, a ValueError to callers)."""


def check_range(lo: int, hi: int, step: int) -> None:
    """RangeError unless [lo, hi] holds a positive multiple of ``step`` (max-context's --lo/--hi/--step)."""
    if step <= 0:
        raise RangeError(f"--step must be positive, got {step}")
    if lo < 1 or -(-lo // step) > hi // step:
        raise RangeError(f"no multiple of {step} in [{lo}, {hi}] (--step, --lo, --hi; expected 1 <= lo <= hi)")


def bisect_max_fitting(fits: Callable[[int], bool | None], lo: int, hi: int, step: int,
                       stop: Callable[[], bool] = lambda: False) -> dict:
    """Largest multiple of ``step`` in [lo, hi] for which ``fits`` is True, assuming monotone ``fits``.

    ``lo`` and ``hi`` are rounded inward to multiples of ``step``. ``fits`` returning None (a probe that neither fit
    nor ran out of memory: timeout, crash) ends the search. ``stop()`` is asked before each probe (the time budget).
    Returns {"best": largest fitting length or None, "first_fail": smallest length known not to fit or None,
    "probes": [[seq, fits], ...] in order, "complete": whether the bracket is closed (best + step == first_fail, or
    hi fits, or lo fails)}. Binary search: ceil(log2(#candidates + 1)) probes at most. Raises RangeError (a
    ValueError) when [lo, hi] holds no positive multiple of ``step``.
    """
    check_range(lo, hi, step)
    lo_k, hi_k = -(-lo // step), hi // step
    good, bad = lo_k - 1, hi_k + 1  # invariant: good fits (or is below range), bad fails (or is above range)
    probes: list[list] = []
    while bad - good > 1:
        if stop():
            break
        mid = (good + bad) // 2
        ok = fits(mid * step)
        probes.append([mid * step, ok])
        if ok is None:
            break
        if ok:
            good = mid
        else:
            bad = mid
    return {"best": good * step if good >= lo_k else None, "first_fail": bad * step if bad <= hi_k else None,
            "probes": probes, "complete": bad - good == 1}


# ------------------------------------------------------------------------------------------------------------ specs
@dataclasses.dataclass
class RunSpec:
    """One child process: one implementation, one model, one shape. ``device='cpu'`` is a dry run for the tests."""

    impl: str
    config: str  # a model folder holding config.json, or the config.json itself
    seq: int
    batch: int
    gc: bool
    warmup: int = 2
    steps: int = 5
    seed: int = 0
    device: str = "cuda"
    layers: int | None = None  # override num_hidden_layers (quick runs)
    lora_r: int = 16
    lora_alpha: int = 32
    lr: float = 1e-4

    def __post_init__(self):
        if self.impl not in IMPLS:
            raise BenchError(f"unknown implementation {self.impl!r}; expected one of {', '.join(IMPLS)}")
        if self.seq < 1 or self.batch < 1 or self.steps < 1 or self.warmup < 0:
            raise BenchError("seq, batch and steps must be >= 1 and warmup >= 0")

    @property
    def name(self) -> str:
        layers = f"_L{self.layers}" if self.layers else ""
        return (f"{model_name(self.config)}{layers}_{self.impl}_s{self.seq}_b{self.batch}_gc"
                f"{'on' if self.gc else 'off'}").replace("+", "-")


def model_name(config_path: str) -> str:
    path = Path(config_path)
    return (path.parent if path.name.endswith(".json") else path).name


def load_config(spec_config: str, layers: int | None = None):
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


# ------------------------------------------------------------------------------------------------------------ child
class Skip(Exception):
    """The implementation cannot run here (e.g. Liger not installed): a result with a note, not a failure."""


def build(spec: RunSpec):
    """(model, config): the spec's model on ``spec.device`` in bf16 with LoRA, patched per ``spec.impl``."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    config = load_config(spec.config, spec.layers)
    if spec.impl == "hf+peft+liger":
        try:
            from liger_kernel.transformers import apply_liger_kernel_to_llama
        except ImportError as exc:
            raise Skip(f"liger_kernel not importable ({exc})") from None
        if config.model_type != "llama":
            raise Skip(f"Liger's llama patch does not apply to model_type {config.model_type!r}")
        apply_liger_kernel_to_llama()  # module-level: classes swapped before the model is built
    torch.manual_seed(spec.seed)
    with torch.device(spec.device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    seeded_init(model, spec.seed, trainable_only=False, std=getattr(config, "initializer_range", 0.02))
    model.config.use_cache = False
    if spec.gc:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    model = get_peft_model(model, LoraConfig(r=spec.lora_r, lora_alpha=spec.lora_alpha, target_modules=TARGETS,
                                             lora_dropout=0.0, init_lora_weights=False, bias="none",
                                             task_type="CAUSAL_LM"))
    seeded_init(model, spec.seed + 1, trainable_only=True)
    if spec.impl == "leantune":
        import leantune

        leantune.patch(model)
    model.train()  # HF checkpoints only in training mode
    return model, config


def seeded_init(model, seed: int, *, trainable_only: bool, std: float | None = None) -> None:
    """Re-draw every matrix from a generator seeded by (seed, parameter name), so the weights depend on neither the
    module classes (Liger swaps some) nor the order they were built in. ``std`` given: normal(0, std) (base
    weights; 1-D parameters, the norms, keep their init); else uniform(+-1/sqrt(fan_in)), nn.Linear's default
    (LoRA A [r, in] and B [out, r], non-zero as with ``init_lora_weights=False``)."""
    import zlib

    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():  # tied weights appear once
            if p.dim() < 2 or (trainable_only and not p.requires_grad):
                continue
            g = torch.Generator(device=p.device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            if std is not None:
                p.normal_(0.0, std, generator=g)
            else:
                bound = p.shape[1] ** -0.5
                p.uniform_(-bound, bound, generator=g)


def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def lora_grad_norm(model) -> float:
    """Global L2 norm (float64) of the gradients of every trainable parameter."""
    import torch

    squares = [p.grad.detach().double().pow(2).sum() for p in model.parameters() if p.requires_grad
               and p.grad is not None]
    return math.sqrt(float(torch.stack(squares).sum())) if squares else math.nan


def run_one(spec: RunSpec) -> dict:
    """Build, then train ``warmup + steps`` steps; the result dict of one run (see the module docstring).

    Raises Skip, BenchError, and torch.OutOfMemoryError (the caller turns each into a status).
    """
    import torch

    cuda = spec.device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise BenchError("this benchmark needs a CUDA GPU")
    t0 = time.perf_counter()
    model, config = build(spec)
    g = torch.Generator(device=spec.device).manual_seed(spec.seed + 2)
    ids = torch.randint(0, config.vocab_size, (spec.batch, spec.seq), generator=g, device=spec.device)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=spec.lr, fused=cuda)
    _sync(spec.device)
    build_s = time.perf_counter() - t0
    frozen = frozen_weight_bytes(model)
    # Optimizer state up front (one step with lr 0 on zero gradients: weights unchanged), so that every step, the
    # first included, holds steady-state memory and a one-step max-context probe is a fair test.
    for p in params:
        p.grad = torch.zeros_like(p)
    lr = optimizer.param_groups[0]["lr"]
    optimizer.param_groups[0]["lr"] = 0.0
    optimizer.step()
    optimizer.param_groups[0]["lr"] = lr
    optimizer.zero_grad(set_to_none=True)
    _sync(spec.device)
    if cuda:
        torch.cuda.reset_peak_memory_stats()

    step_s = []
    for i in range(spec.warmup + spec.steps):
        optimizer.zero_grad(set_to_none=True)
        _sync(spec.device)
        t = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        _sync(spec.device)
        elapsed = time.perf_counter() - t
        if i == 0:  # the agreement step (untimed part): same seed, weights, tokens in every implementation
            first_loss, grad_norm = float(loss.detach()), lora_grad_norm(model)
        t = time.perf_counter()
        optimizer.step()
        _sync(spec.device)
        if i >= spec.warmup:
            step_s.append(elapsed + time.perf_counter() - t)
    last_loss = float(loss.detach())
    tokens_per_s = spec.steps * spec.batch * spec.seq / sum(step_s)
    peak = torch.cuda.max_memory_allocated() if cuda else None
    lora_params = sum(p.numel() for p in params)
    return {
        "status": "ok" if math.isfinite(first_loss) and math.isfinite(last_loss) else "nonfinite",
        **dataclasses.asdict(spec), "model": model_name(spec.config), "name": spec.name,
        "first_loss": first_loss, "grad_norm": grad_norm, "last_loss": last_loss,
        "step_ms": [1e3 * s for s in step_s], "median_step_ms": 1e3 * sorted(step_s)[len(step_s) // 2],
        "tokens_per_s": tokens_per_s, "build_s": build_s,
        "peak_gib": None if peak is None else peak / GiB,
        "frozen_weight_gib": frozen / GiB,
        "peak_minus_frozen_gib": None if peak is None else (peak - frozen) / GiB,
        "lora_params": lora_params, "matmul_params": matmul_params(config),
        "model_flops_per_token": model_flops_per_token(config, spec.seq),
        "hardware_flops_per_token": hardware_flops_per_token(config, spec.seq, spec.gc),
        "leantune_summary": _summary(model) if spec.impl == "leantune" else None,
        **environment(spec.device),
    }


def _summary(model):
    from leantune.patch import SUMMARY_ATTR

    for module in model.modules():
        if SUMMARY_ATTR in module.__dict__:
            return json.loads(json.dumps(module.__dict__[SUMMARY_ATTR], default=str))
    return None


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


def run_one_safe(spec: RunSpec) -> dict:
    """``run_one`` with every outcome a result: status ok | nonfinite | oom | skipped | error."""
    import torch

    base = {**dataclasses.asdict(spec), "model": model_name(spec.config), "name": spec.name}
    try:
        return run_one(spec)
    except Skip as exc:
        return {**base, "status": "skipped", "error": str(exc)}
    except torch.OutOfMemoryError as exc:
        return {**base, "status": "oom", "error": str(exc).splitlines()[0][:300]}
    except Exception as exc:  # a failing implementation is a result, not a crash of the benchmark
        text = f"{type(exc).__name__}: {str(exc)[:300]}"
        # Allocation failures that do not surface as OutOfMemoryError (e.g. cuBLAS workspaces).
        oom = any(m in text for m in ("out of memory", "CUBLAS_STATUS_ALLOC_FAILED"))
        return {**base, "status": "oom" if oom else "error", "error": text}


def ceilings_child() -> dict:
    import torch

    from .ops import measure_ceilings

    if not torch.cuda.is_available():
        raise BenchError("this benchmark needs a CUDA GPU")
    return {**measure_ceilings(), **environment("cuda")}


# ----------------------------------------------------------------------------------------------------------- parent
def child_env() -> dict:
    """The parent's environment with this package's source root first on PYTHONPATH (children import the same
    leantune)."""
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def run_child(args: list[str], result: Path, log: Path, timeout_s: float, *,
              module: str = "leantune.bench.e2e", keep: bool = True) -> dict:
    """Run ``python -m MODULE ARGS`` (e2e children get ``--result RESULT`` appended) with stdout+stderr into
    ``log``; the JSON it wrote to ``result``, or a status of timeout / crashed (with the log's tail).

    The child writes beside ``result`` under a hidden temporary name (``RESULT`` in ``args`` is replaced by it),
    moved onto ``result`` (and a ``.md`` it wrote beside it) only when it succeeds: a failing rerun never deletes a
    good result. With ``keep=False`` nothing is moved: the caller decides what to store from the returned dict.
    """
    fresh = result.with_name(f".new-{result.name}")
    scratch = (fresh, fresh.with_suffix(".md"))
    for path in scratch:  # a killed run's leftovers must not pass for this child's output
        path.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", module, *[str(fresh) if a == str(result) else a for a in args]]
    if module == "leantune.bench.e2e":
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


def require_cuda() -> None:
    import torch

    if not torch.cuda.is_available():
        raise BenchError("`leantune bench` needs a CUDA GPU (none is visible); `leantune bench report` works "
                         "anywhere")


def get_ceilings(out: Path, budget: Budget, matmul_tflops: float | None) -> dict:
    if matmul_tflops:
        return {"matmul_flop_per_s": matmul_tflops * 1e12, "source": "--matmul-tflops"}
    found = run_child(["--ceilings"], out / "ceilings.json", out / "ceilings.log", budget.left())
    return {**found, "source": "measured in this invocation"}


def _attach(result: dict, ceilings: dict) -> dict:
    rate = ceilings.get("matmul_flop_per_s")
    result["matmul_flop_per_s"] = rate
    result["matmul_source"] = ceilings.get("source")
    result["mfu"] = utilization(result.get("tokens_per_s"), result.get("model_flops_per_token"), rate)
    result["hfu"] = utilization(result.get("tokens_per_s"), result.get("hardware_flops_per_token"), rate)
    return result


def run_e2e(configs: list[str], impls: list[str], gcs: list[bool], out: Path, *, seq: int | None = None,
            batch: int | None = None, warmup: int = 2, steps: int = 5, seed: int = 0, layers: int | None = None,
            budget_s: float = 540.0, matmul_tflops: float | None = None, log=print) -> list[dict]:
    """Every (config, gc, impl) run in its own child; JSON per run in ``out``; returns the results of this call."""
    out.mkdir(parents=True, exist_ok=True)
    specs = []
    for config_path in configs:
        config = load_config(config_path, layers)
        default_seq, default_batch = default_shape(config)
        for gc in gcs:
            for impl in impls:
                specs.append(RunSpec(impl, config_path, seq or default_seq, batch or default_batch, gc, warmup,
                                     steps, seed, layers=layers))
    budget = Budget(budget_s)
    ceilings = get_ceilings(out, budget, matmul_tflops)
    log(f"matmul ceiling: {ceilings.get('matmul_flop_per_s', math.nan) / 1e12:.0f} TFLOP/s "
        f"({ceilings.get('source')}{', ' + ceilings['error'] if ceilings.get('error') else ''})")
    results = []
    for spec in specs:
        if not budget.can_start():
            log(f"not run (budget of {budget_s:.0f} s spent): {spec.name}")
            continue
        path = out / f"{spec.name}.json"
        result = run_child(["--one", json.dumps(dataclasses.asdict(spec))], path, out / f"{spec.name}.log",
                           budget.left(), keep=False)  # stored below, with the parent's fields
        budget.record(result.get("wall_s", 0.0))
        result = _attach({**dataclasses.asdict(spec), "model": model_name(spec.config), "name": spec.name,
                          **result}, ceilings)
        # an oom, error or crash of a rerun keeps the earlier measurement (the log has this run's)
        if result.get("status") != "ok" and _ok_result(path):
            log(f"{spec.name}: kept the earlier result in {path} (this run: {result.get('status')})")
        else:
            path.write_text(json.dumps(result, indent=1))
        results.append(result)
        log(_one_line(result))
    return results


def _ok_result(path: Path) -> bool:
    try:
        return json.loads(path.read_text()).get("status") == "ok"
    except (OSError, ValueError, AttributeError):
        return False


def _one_line(r: dict) -> str:
    if r.get("status") != "ok":
        return f"{r['name']}: {r.get('status')} {r.get('error', '')}"
    def num(key, fmt, scale=1.0):
        value = r.get(key)
        return "n/a" if value is None else format(scale * value, fmt)

    return (f"{r['name']}: {num('tokens_per_s', '.0f')} tok/s, peak {num('peak_gib', '.2f')} GiB, loss "
            f"{num('first_loss', '.4f')}, |g| {num('grad_norm', '.4g')}, MFU {num('mfu', '.1f', 100)}%, "
            f"{num('wall_s', '.0f')} s")


def run_max_context(config_path: str, impls: list[str], out: Path, *, lo: int, hi: int, step: int,
                    seed: int = 0, layers: int | None = None, budget_s: float = 540.0, log=print) -> list[dict]:
    """Bisection per implementation (batch 1, gradient checkpointing on); each probe one child with 1 step."""
    out.mkdir(parents=True, exist_ok=True)
    budget = Budget(budget_s)
    results = []
    for impl in impls:
        probes_detail: list[dict] = []

        def fits(seq: int, impl=impl, details=probes_detail) -> bool | None:
            spec = RunSpec(impl, config_path, seq, 1, True, warmup=0, steps=1, seed=seed, layers=layers)
            r = run_child(["--one", json.dumps(dataclasses.asdict(spec))], out / "probe.json",
                          out / f"probe_{spec.name}.log", budget.left(), keep=False)  # kept in probe_details
            budget.record(r.get("wall_s", 0.0))
            details.append({"seq": seq, "status": r.get("status"), "peak_gib": r.get("peak_gib"),
                            "wall_s": r.get("wall_s"), "error": r.get("error"), "gpu": r.get("gpu"),
                            "versions": r.get("versions")})
            peak = "" if r.get("peak_gib") is None else f"peak {r['peak_gib']:.1f} GiB "
            log(f"max-context {impl} seq {seq}: {r.get('status')} {peak}({r.get('wall_s', 0):.0f} s)")
            if r.get("status") in ("ok", "nonfinite"):
                return True
            return False if r.get("status") == "oom" else None

        found = bisect_max_fitting(fits, lo, hi, step, stop=lambda: not budget.can_start())
        result = {"kind": "max_context", "impl": impl, "config": config_path, "model": model_name(config_path),
                  "layers": layers, "lo": lo, "hi": hi, "step": step, **found, "probe_details": probes_detail,
                  # from the probes that ran (the parent never touches the GPU: its context would cost memory)
                  "date": time.strftime("%Y-%m-%d %H:%M"),
                  "gpu": next((d["gpu"] for d in probes_detail if d.get("gpu")), None),
                  "versions": next((d["versions"] for d in probes_detail if d.get("versions")), None)}
        # one file per invocation (`bench report` pools the probes of all): a rerun never overwrites earlier probes
        name = (f"maxctx_{model_name(config_path)}{f'_L{layers}' if layers else ''}_{impl}_"
                f"{time.strftime('%Y%m%d-%H%M%S')}").replace("+", "-")
        (out / f"{name}.json").write_text(json.dumps(result, indent=1))
        results.append(result)
        log(f"max-context {impl}: best {found['best']}, first fail {found['first_fail']}"
            f"{'' if found['complete'] else ' (INCOMPLETE: rerun with --lo/--hi inside this bracket)'}")
    return results


# ------------------------------------------------------------------------------------------------------------- main
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="child process of `leantune bench e2e` / `max-context`")
    parser.add_argument("--one", default=None, help="a RunSpec as JSON: run it and write the result")
    parser.add_argument("--ceilings", action="store_true", help="measure the copy and matmul ceilings")
    parser.add_argument("--result", required=True, help="where to write the JSON result")
    args = parser.parse_args(argv)
    try:
        result = ceilings_child() if args.ceilings else run_one_safe(RunSpec(**json.loads(args.one)))
    except BenchError as exc:
        print(f"leantune: error: {exc}", file=sys.stderr)
        return 1
    Path(args.result).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
