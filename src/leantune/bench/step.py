"""One benchmark run in its own process: a LoRA training step of one implementation on one model and shape (CUDA).

``leantune bench e2e`` and ``max-context`` start ``python -m leantune.bench.step --one SPEC_JSON --result PATH`` per
run (``harness.run_child``), so that monkey patches (Liger's are module-level) never leak between implementations.
What one run measures (one implementation x one model x seq x batch x gradient checkpointing):

- model: a config folder (or config.json), bf16 weights drawn from (seed, parameter name), PEFT LoRA r=16 on all 7
  projections, set up as the implementation runs it (``build``: hf+peft, hf+peft+liger, leantune,
  leantune+offload, leantune+offload+tiled, and QLoRA's leantune+nf4 and hf+peft+bnb); fused AdamW on the LoRA
  parameters.
- the optimizer state is created up front (one AdamW step with lr 0 on zero gradients), so every step, even the
  first, holds steady-state memory; then ``warmup`` steps, then ``steps`` timed steps (the same token batch every
  step). A timed step is forward, backward and optimizer step with no synchronisation inside (as in training),
  CUDA-synchronised before and after: its wall time (``step_ms``; median, min, p90 in ``stepstats``) and its host
  issue time (``issue_ms``: from the step's start until ``optimizer.step()`` returns, before the closing
  synchronisation; close to the step time when the host paces the step).
- then, when ``profile_steps`` > 0, that many more steps under torch.profiler (apart from the timed ones: the
  profiler slows the host): the GPU-busy fraction (union of kernel intervals / wall time of those steps), busy ms
  and kernels per step (``stepstats.profile_pass``).
- first step: loss and the global L2 norm of all LoRA gradients (before the optimizer update, outside the timed
  part); same seed, same weights, same tokens in every implementation, so these must agree
  (``report.flag_agreement``).
- tokens/s = steps * batch * seq / total timed seconds; peak GiB = ``max_memory_allocated`` over all steps after
  ``reset_peak_memory_stats`` (taken after the model is built); peak minus the bytes of the frozen weights; FLOPs
  per token from ``flops``.

``--ceilings`` instead measures the card's copy and matmul ceilings (``harness.measure_ceilings``) once per
invocation, in its own child before the runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path

from . import stepstats
from .build import IMPLS, Skip, build, known_impl
from .flops import frozen_weight_bytes, hardware_flops_per_token, matmul_params, model_flops_per_token
from .harness import BenchError, GiB, environment, measure_ceilings, model_name


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
    nproc: int = 1  # processes (one GPU each) under torchrun when ``distributed`` is set
    distributed: str = "none"  # "none" (one plain process), "ddp" or "fsdp"
    memory_cap_gib: float | None = None  # torch.cuda.set_per_process_memory_fraction to this many GiB (a smaller card)
    profile_steps: int = 0  # steps of the profiled pass after the timed ones (0: none)
    dora: bool = False  # PEFT's DoRA (use_dora=True) on every adapter

    def __post_init__(self):
        if not known_impl(self.impl):
            raise BenchError(f"unknown implementation {self.impl!r}; expected one of {', '.join(IMPLS)}")
        if self.seq < 1 or self.batch < 1 or self.steps < 1 or self.warmup < 0 or self.profile_steps < 0:
            raise BenchError("seq, batch and steps must be >= 1, warmup and profile_steps >= 0")
        if self.distributed not in ("none", "ddp", "fsdp") or self.nproc < 1:
            raise BenchError(f"distributed must be none, ddp or fsdp and nproc >= 1, got {self.distributed!r} x "
                             f"{self.nproc}")
        if self.nproc > 1 and self.distributed == "none":
            raise BenchError("several processes need --distributed ddp or fsdp")
        if self.memory_cap_gib is not None and not self.memory_cap_gib > 0:
            raise BenchError(f"memory_cap_gib must be a positive number of GiB, got {self.memory_cap_gib}")

    @property
    def name(self) -> str:
        layers = f"_L{self.layers}" if self.layers else ""
        world = "" if self.distributed == "none" else f"_{self.distributed}{self.nproc}"
        cap = "" if self.memory_cap_gib is None else f"_cap{self.memory_cap_gib:g}"
        return (f"{model_name(self.config)}{layers}_{self.impl}_s{self.seq}_b{self.batch}_gc"
                f"{'on' if self.gc else 'off'}{world}{cap}{'_dora' if self.dora else ''}").replace("+", "-")


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def lora_grad_norm(model) -> float:
    """Global L2 norm (float64) of the gradients of every trainable parameter."""
    import torch

    grads = [p.grad for p in model.parameters() if p.requires_grad and p.grad is not None]
    grads = [g.full_tensor() if hasattr(g, "full_tensor") else g for g in grads]  # FSDP2 shards (collective)
    squares = [g.detach().double().pow(2).sum() for g in grads]
    return math.sqrt(float(torch.stack(squares).sum())) if squares else math.nan


def run_one(spec: RunSpec) -> dict:
    """Build, then train ``warmup + steps`` steps; the result dict of one run (see the module docstring).

    Raises Skip, BenchError, and torch.OutOfMemoryError (the caller turns each into a status).
    """
    import torch

    from leantune import distributed

    cuda = spec.device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise BenchError("this benchmark needs a CUDA GPU")
    device, world = spec.device, distributed.World()
    if spec.distributed != "none":  # under torchrun: rank r on cuda:LOCAL_RANK (gloo on the CPU for the tests)
        world = distributed.check_launch(spec.distributed, spec.device)
        if world is None or world.size != spec.nproc:
            raise BenchError(f"--distributed {spec.distributed} runs under torchrun with {spec.nproc} processes")
        device = distributed.init(world, spec.device)
    if cuda and spec.memory_cap_gib is not None:  # what a smaller card would allow this process
        card = torch.device(device)
        if card.index is None:  # the memory fraction wants an index: "cuda" is the current device
            card = torch.device("cuda", torch.cuda.current_device())
        total = torch.cuda.get_device_properties(card).total_memory
        if spec.memory_cap_gib * GiB > total:
            raise BenchError(f"memory cap {spec.memory_cap_gib:g} GiB exceeds the card's {total / GiB:.1f} GiB")
        torch.cuda.set_per_process_memory_fraction(spec.memory_cap_gib * GiB / total, card)
    t0 = time.perf_counter()
    if spec.distributed == "fsdp":  # built on the meta device, sharded, then each rank's shards drawn

        def shard(model):
            nonlocal world
            world = distributed.choose_engine(spec.distributed, world, model, device)
            distributed.wrap(model, world, device)

        model, config = build(spec, device, shard=shard)
        wrapped = model
    else:
        model, config = build(spec, device)
        wrapped = model
        if world.size > 1 or spec.distributed != "none":
            world = distributed.choose_engine(spec.distributed, world, model, device)
            wrapped = distributed.wrap(model, world, device)
    g = torch.Generator(device=device).manual_seed(spec.seed + 2 + world.rank)  # each rank its own tokens
    ids = torch.randint(0, config.vocab_size, (spec.batch, spec.seq), generator=g, device=device)
    params = [p for p in model.parameters() if p.requires_grad]
    _sync(device)
    build_s = time.perf_counter() - t0
    frozen = frozen_weight_bytes(model)  # this rank's share under FSDP2
    graphed = spec.impl.endswith("+graph")
    if graphed and (not cuda or world.size > 1):
        raise Skip("CUDA-graph steps run on one CUDA device (leantune.graphs.CapturedStep)")
    optimizer = adamw_with_state(params, spec.lr, fused=distributed.fused_adamw(device, world), capturable=graphed)
    _sync(device)
    if cuda:
        torch.cuda.reset_peak_memory_stats()

    batch = {"input_ids": ids, "labels": ids}
    if graphed:  # the captured step and its eager warm-up run on a stream of their own (leantune.graphs)
        from leantune.graphs import CapturedStep

        captured = CapturedStep(wrapped, optimizer, warmup=max(1, spec.warmup - 1))
        with torch.cuda.stream(captured.stream):  # the agreement step: eager, on the step's stream, not applied
            captured.stream.wait_stream(torch.cuda.current_stream())
            loss = wrapped(**batch).loss
            loss.backward()
            first_loss, grad_norm = float(loss.detach()), lora_grad_norm(model)
            optimizer.zero_grad(set_to_none=True)
        torch.cuda.current_stream().wait_stream(captured.stream)

        def train_step():
            return captured.step(batch)[0]
    else:
        def train_step():
            optimizer.zero_grad(set_to_none=True)
            loss = wrapped(**batch).loss
            loss.backward()
            optimizer.step()
            return loss

    step_s, issue_s = [], []
    for i in range(spec.warmup + spec.steps):
        if not graphed:
            optimizer.zero_grad(set_to_none=True)
        _sync(device)
        t = time.perf_counter()
        paused = 0.0
        if graphed:
            loss = train_step()
        else:
            loss = wrapped(**batch).loss
            loss.backward()
            if i == 0:  # the agreement step (its reads untimed): same seed, weights, tokens in every implementation
                _sync(device)  # forward and backward count in the step; the reads below do not
                pause = time.perf_counter()
                first_loss = distributed.all_reduce_sum([float(loss.detach())], world, device)[0] / world.size
                grad_norm = lora_grad_norm(model)
                _sync(device)
                paused = time.perf_counter() - pause
            optimizer.step()
        issued = time.perf_counter() - t - paused  # everything queued; the GPU may still be busy
        _sync(device)
        if i >= spec.warmup:
            step_s.append(time.perf_counter() - t - paused)
            issue_s.append(issued)
    last_loss = distributed.all_reduce_sum([float(loss.detach())], world, device)[0] / world.size
    tokens_per_s = world.size * spec.steps * spec.batch * spec.seq / sum(step_s)  # global, rank 0's clock
    peak = torch.cuda.max_memory_allocated() if cuda else None  # before the profiled pass

    profiled = {}
    if spec.profile_steps:
        try:
            profiled = stepstats.profile_pass(train_step, spec.profile_steps, device, lambda: _sync(device))
        except Exception as exc:  # a profiler that cannot run loses its fraction, not the timed steps
            profiled = {"busy_fraction": None, "profile_error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    if peak is not None and world.size > 1:  # the busiest GPU's
        peak = int(_max_over_ranks(peak, device))
    lora_params = sum(p.numel() for p in params)
    return {
        "status": "ok" if math.isfinite(first_loss) and math.isfinite(last_loss) else "nonfinite",
        **dataclasses.asdict(spec), "model": model_name(spec.config), "name": spec.name,
        "first_loss": first_loss, "grad_norm": grad_norm, "last_loss": last_loss,
        "step_ms": [1e3 * s for s in step_s], "issue_ms": [1e3 * s for s in issue_s],
        **stepstats.step_stats([1e3 * s for s in step_s], [1e3 * s for s in issue_s]), **profiled,
        "tokens_per_s": tokens_per_s, "build_s": build_s,
        "peak_gib": None if peak is None else peak / GiB,
        "frozen_weight_gib": frozen / GiB,
        "peak_minus_frozen_gib": None if peak is None else (peak - frozen) / GiB,
        "lora_params": lora_params, "matmul_params": matmul_params(config),
        "world_size": world.size, "engine": world.engine,
        "model_flops_per_token": model_flops_per_token(config, spec.seq),
        "hardware_flops_per_token": hardware_flops_per_token(config, spec.seq, spec.gc),
        "leantune_summary": _summary(model) if spec.impl in ("leantune", "leantune+graph") else None,
        "graph_eager_reason": captured.eager_reason if graphed else None,
        **environment(spec.device),
    }


def adamw_with_state(params: list, lr: float, *, fused: bool, capturable: bool = False):
    """AdamW on ``params`` with its state allocated up front (one step with lr 0 on zero gradients: weights
    unchanged, decoupled weight decay included), so that every step, the first included, holds steady-state memory
    and a one-step max-context probe is a fair test; gradients left unset. ``capturable``: the CUDA-graph form
    (``capturable=True``, the learning rate a device tensor; leantune.graphs)."""
    import torch

    if capturable:
        optimizer = torch.optim.AdamW(params, lr=torch.tensor(float(lr), device=params[0].device), fused=fused,
                                      capturable=True)
    else:
        optimizer = torch.optim.AdamW(params, lr=lr, fused=fused)
    for p in params:
        p.grad = torch.zeros_like(p)
    if capturable:
        optimizer.param_groups[0]["lr"].fill_(0.0)
        optimizer.step()
        optimizer.param_groups[0]["lr"].fill_(float(lr))
        optimizer.zero_grad(set_to_none=True)
        return optimizer
    optimizer.param_groups[0]["lr"] = 0.0
    optimizer.step()
    optimizer.param_groups[0]["lr"] = lr
    optimizer.zero_grad(set_to_none=True)
    return optimizer


def _max_over_ranks(value: float, device: str) -> float:
    import torch
    import torch.distributed as dist

    tensor = torch.tensor([float(value)], dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor.item())


def _summary(model):
    from leantune.patch import SUMMARY_ATTR

    for module in model.modules():
        if SUMMARY_ATTR in module.__dict__:
            return json.loads(json.dumps(dict(module.__dict__[SUMMARY_ATTR].items()), default=str))
    return None


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

    if not torch.cuda.is_available():
        raise BenchError("this benchmark needs a CUDA GPU")
    return {**measure_ceilings(), **environment("cuda")}


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
    if os.environ.get("RANK", "0") == "0":  # under torchrun rank 0 writes the run's result
        Path(args.result).write_text(json.dumps(result, indent=1))
    if "WORLD_SIZE" in os.environ:
        if result.get("status") not in ("ok", "skipped"):
            print(f"leantune: rank {os.environ.get('RANK')}: {result.get('status')}: {result.get('error')}",
                  file=sys.stderr)
            os._exit(1)  # a peer may wait in a collective: torchrun ends the others
        from leantune import distributed

        distributed.shutdown()
        # the result is on disk: leave without C++ static destructors, where a still-joinable library thread made
        # a child abort ("terminate called without an active exception", SIGABRT) twice in about 50 gloo launches
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
