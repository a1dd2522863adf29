"""Several processes through PyTorch's own engines: torchrun's environment, DDP or FSDP2.

Launch. ``torchrun`` (and ``accelerate launch``, which runs it) sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR`` and ``MASTER_PORT``; :func:`check_launch` reads them before anything is loaded and
:func:`init` joins the ``env://`` rendezvous: NCCL for CUDA ranks (rank r on ``cuda:LOCAL_RANK``), gloo for CPU ranks.
Without ``WORLD_SIZE`` a run is one plain process, as always.

Engines (:func:`choose_engine`, :func:`wrap`):
- ``ddp``: ``DistributedDataParallel(find_unused_parameters=False)`` (every adapter takes part in every forward),
  bucketing left to DDP, ``no_sync`` on all but the last micro-batch of a step (:func:`gradient_sync`).
- ``fsdp``: FSDP2, ``fully_shard`` on each decoder layer (the classes the model names in ``_no_split_modules``), then on
  the root (one process whose second copy of the parameters fits: the root alone, :func:`shards_layers`); frozen base
  and adapters are sharded alike. ``MixedPrecisionPolicy(reduce_dtype=float32)`` with the parameters' own dtypes for
  compute: the base as loaded (bf16 on CUDA), PEFT's fp32 adapters kept fp32, so a rank computes what the single-process
  run computes. What is gathered when: a layer's parameters are all-gathered in its pre-forward hook and freed after its
  forward; the root's (embeddings, final norm, ``lm_head``) once per forward of the whole model, so the fused loss sees
  the full ``lm_head`` weight exactly once per micro-batch forward, as a plain tensor inside the root's forward
  (leantune's ops run only inside the forward of the module that owns their weights; outside it the parameters are
  ``DTensor`` shards). In backward each layer is gathered again before its gradients are formed, and gradients are
  reduce-scattered in fp32.
- ``auto``: FSDP2 when the frozen weights take more than half of one device's memory, else DDP (CPU: DDP).

Loss normalisation. The only collectives leantune calls itself are sums of a few numbers: the step's loss for metrics
(:func:`all_reduce_on_device`, read with the step's record), the stop flag of a Ctrl-C / SIGTERM (:func:`any_rank`,
through a gloo group of host tensors), so every rank stops after the same step, and eval sums (:func:`all_reduce_sum`).
The count of target tokens of the whole global step (so every token weighs the same whichever rank holds it) is counted
by every rank on the host (``leantune train``: every rank holds the whole split), or all-reduced when a caller does not
pass it. Both engines average gradients over ranks; the loss that is backpropagated is therefore the rank's share of the
global token mean times the world size (:func:`loss_scale`), which makes N ranks x K micro-batches the same update as
one process with the whole batch.

Faults: a rank that raises prints ``leantune: error (rank r): ...`` and exits non-zero; torchrun then ends the other
ranks (SIGTERM, SIGKILL after 30 s), and a rank blocked in a collective with a dead peer fails on its own.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .errors import LeantuneError

ENGINES = ("auto", "ddp", "fsdp")
# How long a collective may wait for a peer before it fails: longer than any step or checkpoint save of a sane run,
# short enough that a wedged rank does not hold a node for the default 30 minutes.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)


@dataclass(frozen=True)
class World:
    """Where this process stands: ``rank`` of ``size`` processes, ``engine`` "none" (one plain process), "ddp" or
    "fsdp", and ``reason``, the line that says why that engine."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    engine: str = "none"
    reason: str = ""

    @property
    def main(self) -> bool:
        """Rank 0: the one that prints, plots and writes the run's files."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.engine != "none"


def _env_int(name: str) -> int:
    value = os.environ.get(name, "")
    try:
        number = int(value)
    except ValueError:
        raise LeantuneError(f"{name}={value!r} in the environment is not an integer (set by torchrun)") from None
    if number < 0:
        raise LeantuneError(f"{name}={number} in the environment is negative")
    return number


def check_launch(requested: str, device: str) -> World | None:
    """The launch as the environment describes it, checked before any model is loaded.

    Returns None for one plain process (``WORLD_SIZE`` unset), else a World with the rank numbers (engine not yet
    chosen). Raises LeantuneError: ``--distributed ddp|fsdp`` without a launcher, a malformed torchrun environment,
    CUDA ranks without CUDA (NCCL needs it) or with ``LOCAL_RANK`` beyond the visible devices.
    """
    if requested not in ENGINES:
        raise LeantuneError(f"--distributed must be one of {', '.join(ENGINES)}, got {requested!r}")
    if "WORLD_SIZE" not in os.environ:
        if requested != "auto":
            raise LeantuneError(f"--distributed {requested} needs a launcher (WORLD_SIZE is unset): run "
                                f"torchrun --nproc_per_node N -m leantune train --distributed {requested} ...")
        return None
    size, rank, local_rank = _env_int("WORLD_SIZE"), _env_int("RANK"), _env_int("LOCAL_RANK")
    if size < 1 or rank >= size:
        raise LeantuneError(f"RANK={rank} and WORLD_SIZE={size} in the environment do not fit together")
    if device == "cuda":
        if not torch.cuda.is_available():
            raise LeantuneError("--device cuda across processes uses NCCL, which needs CUDA, and no CUDA device is "
                                "visible; use --device cpu (gloo) or a machine with GPUs")
        if local_rank >= torch.cuda.device_count():
            raise LeantuneError(f"LOCAL_RANK={local_rank} but only {torch.cuda.device_count()} CUDA device(s) are "
                                f"visible: launch at most {torch.cuda.device_count()} processes per node")
    return World(rank=rank, size=size, local_rank=local_rank)


_OWNED = []  # the process group leantune created (a caller's own group is left to the caller)
_HOST = []  # a gloo group over the same ranks for host numbers when the default group is NCCL (see host_group)


def init(world: World, device: str) -> str:
    """Join the ``env://`` rendezvous (NCCL on CUDA, gloo on CPU) unless the caller already did; returns this rank's
    device string."""
    if device == "cuda":
        torch.cuda.set_device(world.local_rank)
        device = f"cuda:{world.local_rank}"
    if dist.is_initialized():
        if dist.get_world_size() != world.size or dist.get_rank() != world.rank:
            raise LeantuneError(f"a process group of {dist.get_world_size()} ranks already exists, but the "
                                f"environment says rank {world.rank} of {world.size}")
    elif device.startswith("cuda"):
        dist.init_process_group("nccl", timeout=COLLECTIVE_TIMEOUT, device_id=torch.device(device))
        _OWNED.append(dist.group.WORLD)
    else:
        dist.init_process_group("gloo", timeout=COLLECTIVE_TIMEOUT)
        _OWNED.append(dist.group.WORLD)
    _HOST.clear()
    if dist.get_backend() != "gloo":  # every rank passes here, in the same order (new_group is collective)
        try:
            _HOST.append(dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT))
        except (RuntimeError, ValueError) as exc:  # e.g. no gloo in this build: the flag then goes through NCCL
            print(f"leantune: warning: no gloo group for the per-step stop flag ({str(exc).splitlines()[0]}); "
                  "it is summed on the device, which waits for each step to finish", flush=True)
    return device


def host_group():
    """The process group for numbers that live on the host (the stop flag): gloo, so that reading the sum back
    waits for the peers only. Through the default NCCL group the sum would sit behind the step's queued kernels,
    and reading it would wait for the device to finish the step (the next step's host work could not overlap it).
    None: the default group (gloo already)."""
    return _HOST[0] if _HOST else None


def report_failure(world: World, exc: BaseException) -> None:
    """On a rank of a several-process run, print ``leantune: error (rank r): Type: message`` to stderr at once, before
    the exception unwinds further: torchrun then ends the peers, and a crash in any later teardown (a peer's
    collective failing under gloo) cannot swallow the cause. Ctrl-C / SIGTERM stops print nothing here."""
    if world.size > 1 and not isinstance(exc, (KeyboardInterrupt, SystemExit)):
        first = str(exc).splitlines()[0] if str(exc) else ""
        print(f"leantune: error (rank {world.rank}): {type(exc).__name__}: {first}", file=sys.stderr, flush=True)


def shutdown() -> None:
    """Destroy the process group :func:`init` created (none other)."""
    if _OWNED and dist.is_initialized():
        _OWNED.clear()
        _HOST.clear()  # destroyed with the default group
        dist.destroy_process_group()


def on_main(decide):
    """``decide()`` run by rank 0 alone, its result (or its LeantuneError) on every rank, so that decisions about
    the output folder are made once; plain ``decide()`` without a process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return decide()
    outcome = [None, None]
    if dist.get_rank() == 0:
        try:
            outcome = [decide(), None]
        except LeantuneError as exc:
            outcome = [None, str(exc)]
    dist.broadcast_object_list(outcome, src=0)
    if outcome[1] is not None:
        raise LeantuneError(outcome[1])
    return outcome[0]


def frozen_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters that do not require grad (the frozen base weights)."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)


def choose_engine(requested: str, world: World, model: torch.nn.Module, device: str) -> World:
    """``world`` with its engine and the reason: as asked, or for ``auto`` FSDP2 when the frozen weights would take
    more than half of one device's memory (room is needed for activations and the optimizer), else DDP."""
    weights = frozen_bytes(model)
    if requested != "auto":
        reason = f"--distributed {requested}"
        engine = requested
    elif device.startswith("cuda"):
        capacity = torch.cuda.get_device_properties(world.local_rank).total_memory
        engine = "fsdp" if weights > capacity / 2 else "ddp"
        relation = "more" if engine == "fsdp" else "no more"
        reason = (f"--distributed auto: the frozen weights ({weights / 2**30:.1f} GiB) take {relation} than half of "
                  f"one device's {capacity / 2**30:.1f} GiB")
    else:
        engine, reason = "ddp", "--distributed auto: CPU processes replicate the model (DDP)"
    return World(world.rank, world.size, world.local_rank, engine, reason)


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated blocks: modules whose class the transformers model lists in ``_no_split_modules``."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = set(getattr(base, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise LeantuneError(f"--distributed fsdp: cannot find the decoder layers of {type(base).__name__} (it names "
                            "none in _no_split_modules); use --distributed ddp")
    return layers


def wrap(model: torch.nn.Module, world: World, device: str, from_main: bool = False) -> torch.nn.Module:
    """The model under ``world.engine``: a DDP wrapper, or the same model with FSDP2 applied in place.

    ``from_main``: only rank 0 holds the weights (stored weights read once, on the CPU); the other ranks built the
    same model on the meta device. DDP: those ranks allocate theirs on ``device`` and DDP's construction broadcasts
    rank 0's parameters and buffers. FSDP2: rank 0's full state dict is taken before sharding, every rank allocates
    its shards, and ``set_model_state_dict(broadcast_from_rank0=True)`` sends each tensor once, each rank keeping its
    shard; the buffers no state dict holds (rotary frequencies) are broadcast from rank 0 too. No rank but 0 ever
    holds the whole model (a 70B model is read once, not once per rank).
    """
    if world.engine == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        if from_main and not world.main:
            _allocate(model, device)
        else:
            model.to(device)
        device_ids = [torch.device(device).index] if device.startswith("cuda") else None
        return DistributedDataParallel(model, device_ids=device_ids, find_unused_parameters=False)
    if world.engine == "fsdp":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        full, kept = {}, None
        if from_main and world.main:  # taken before sharding moves the parameters; the CPU tensors stay referenced
            full, kept = model.state_dict(), [b.detach().clone() for b in _unsaved_buffers(model)]
        mesh = init_device_mesh(torch.device(device).type, (world.size,))
        policy = MixedPrecisionPolicy(reduce_dtype=torch.float32)
        layers = decoder_layers(model)
        if shards_layers(model, world, device):
            for layer in layers:
                fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        if from_main:
            _allocate(model, device)
            set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True,
                                                                       broadcast_from_rank0=True))
            for i, buffer in enumerate(_unsaved_buffers(model)):
                if kept is not None:
                    buffer.copy_(kept[i])
                dist.broadcast(buffer, src=0)
        return model
    return model


def shards_layers(model: torch.nn.Module, world: World, device: str) -> bool:
    """Whether FSDP2 gets a group per decoder layer (True) or the root's one group only (False: one process whose
    second copy of the parameters fits).

    One process has nothing to shard: its "shard" is a whole copy of each parameter, and the gathered copy is a
    second one. Per layer, each layer's copy is made in its pre-forward hook and again before its backward (one
    copy launch per parameter) and dropped after each, with hooks around every layer forward, checkpoint
    recompute and backward: host time that a one-process step pays on every layer (world size 1 ran at 0.60x the
    plain run's tokens/s on an H200 at 1B; benchmarks/fsdp_host_profile.py). With the root's group alone the copy
    is made once per forward and kept until after the backward, and the hooks run once per step; the parameters
    take twice their bytes for the step. So one process keeps per-layer groups only when twice the parameters
    would pass half of the CUDA device's memory (the case where ``--distributed auto`` picks FSDP2 at all), and
    always on the CPU drops them. The numbers are the same either way (a one-process gather and reduction are
    copies)."""
    if world.size > 1:
        return True
    if torch.device(device).type != "cuda":
        return False
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    index = torch.device(device).index
    capacity = torch.cuda.get_device_properties(torch.cuda.current_device() if index is None else index).total_memory
    return 2 * weights > capacity / 2


def _allocate(model: torch.nn.Module, device: str) -> None:
    """Storage on ``device`` for a model built on the meta device (values come from rank 0), ties kept."""
    model.to_empty(device=device)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if hasattr(base, "tie_weights"):
        base.tie_weights()  # to_empty gives each module its own tensor: a tied lm_head would come apart


def _unsaved_buffers(model: torch.nn.Module) -> list[torch.Tensor]:
    """The buffers no state dict holds (``persistent=False``, e.g. rotary frequencies), in module order."""
    return [module._buffers[name] for module in model.modules() for name in sorted(module._non_persistent_buffers_set)
            if module._buffers.get(name) is not None]


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside a DDP wrapper (FSDP2 shards in place: the model itself)."""
    return getattr(model, "module", model) if type(model).__name__ == "DistributedDataParallel" else model


@contextlib.contextmanager
def gradient_sync(model: torch.nn.Module, world: World, enabled: bool):
    """Within the block, gradients are reduced across ranks only if ``enabled`` (the last micro-batch of a step);
    earlier micro-batches accumulate locally (DDP ``no_sync``, FSDP2 ``set_requires_gradient_sync``)."""
    if world.engine == "ddp" and not enabled:
        with model.no_sync():
            yield
    elif world.engine == "fsdp" and not enabled:
        # FSDP2's setter walks every module of the model (about 2 ms a call at 1B on the host): it is called only
        # around the micro-batches that skip the reduction, and the state outside this block is always True
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        yield


def fused_adamw(device: str, world: World) -> bool:
    """Whether AdamW runs fused (``torch.optim.AdamW(fused=True)``): always on CUDA, and under FSDP2 on the CPU too.

    FSDP2's parameters are DTensors, for which PyTorch's default is the for-each AdamW on CUDA and the per-tensor
    loop on the CPU: every one of its ~12 ops then goes through DTensor's dispatch with the whole parameter list
    (per parameter on the CPU), host time that grows with the adapter count (measured in
    benchmarks/fsdp_host_profile.py). The fused op is one dispatch for all of them; DTensor shards it elementwise, so
    each rank updates its own shard exactly as the plain run updates the whole tensor.
    """
    return torch.device(device).type == "cuda" or world.engine == "fsdp"


def loss_scale(world: World) -> float:
    """Factor on a rank's loss before backward: the engines average gradients over ranks, the global token mean
    sums them."""
    return float(world.size) if world.distributed else 1.0


def all_reduce_sum(values: list[float], world: World, device: str) -> list[float]:
    """Elementwise sum over ranks of a few numbers, in one collective (float64; exact for token counts)."""
    if not world.distributed:
        return list(values)
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor)
    return tensor.tolist()


def all_reduce_on_device(value: torch.Tensor, world: World) -> torch.Tensor:
    """The sum over ranks of a 0-dim tensor, as a float64 tensor on its device, never read back here (the step
    log reads it with the step's other numbers; no host sync). Sums what ``all_reduce_sum`` would (float64)."""
    total = value.detach().reshape(()).to(torch.float64, copy=True)  # a copy: the sum is written in place
    if world.distributed:
        dist.all_reduce(total)
    return total


def any_rank(flag: bool, world: World, device: str) -> bool:
    """True on every rank when ``flag`` is true on any: one collective of a host tensor on the host group (gloo),
    so the answer waits for the peers, never for the device's queue (``device`` unused, kept for the callers)."""
    if not world.distributed:
        return flag
    group = host_group()
    if group is None and dist.get_backend() != "gloo":  # no host group could be made: through the device (a sync)
        return all_reduce_sum([1.0 if flag else 0.0], world, device)[0] > 0
    tensor = torch.tensor([1.0 if flag else 0.0], dtype=torch.float64)
    dist.all_reduce(tensor, group=group)
    return bool(tensor.numpy()[0] > 0)  # numpy: host memory by construction (a device tensor would raise)


def gather_objects(value, world: World) -> list:
    """``value`` of every rank, in rank order (one collective; small picklable values such as RNG states)."""
    if not world.distributed:
        return [value]
    out = [None] * world.size
    dist.all_gather_object(out, value)
    return out


def barrier(world: World) -> None:
    if world.distributed:
        dist.barrier()
