"""The run of ``leantune train``, read top to bottom as torchtune's recipes read setup / train / cleanup:

1. ``_prepare``: every check and every load (model, tokenizer, data, LoRA, optimizer); nothing is written yet, so
   every user error leaves the output folder as it was.
2. ``_claim``: lock the output folder, set aside the run being replaced, write run.json, restore a checkpoint.
3. ``_fit``: the optimizer steps, with evals, checkpoints, and a checkpoint then a stop on Ctrl-C or SIGTERM; the
   objects alive before it are frozen out of Python's full collections meanwhile (``heap``).
4. ``_finish``: the last checkpoint, the final eval, the adapter, tokenizer, summary.json and loss.png.

The run-folder rules (what may be replaced, resumed or locked) are in ``run_folder``, the signal rules in ``signals``.
This file is a little longer than 500 lines because it is the one recipe a reader follows top to bottom (STYLE.md);
its helpers with a job of their own live beside it (``step_log``, ``divergence``, ``reporting``, ``sources``).

Gradient accumulation: the K micro-batches of a step share one divisor, the number of target tokens of the whole
step (``num_items_in_batch`` at the model boundary), so the summed micro-batch losses are the token mean over the
step and the gradients equal those of one batch K times larger (``accumulate_gradients``).

Data order: step s of epoch e = s // steps_per_epoch takes rows ``perm_e[i*B*K*W:(i+1)*B*K*W]`` of a permutation
seeded with ``seed + e`` (W processes, 1 without a launcher), so the data position is the step number and a resumed
run sees exactly the rows it would have. Rank r takes the r-th B*K of them: the same seed gives the same global
batches for every world size W with the same B*K*W.

Several processes (``distributed``, under torchrun): the step's target count is summed over ranks before the first
micro-batch, so every target token of the global step weighs the same whichever rank holds it; the engine (DDP or
FSDP2) reduces the gradients on the last micro-batch only. Rank 0 alone prints, writes the run's files and plots;
every rank takes part in checkpoints (the state is gathered) and evaluates the whole eval split (an FSDP2 forward is
collective, so every rank runs the same forwards). A stop by Ctrl-C / SIGTERM is agreed on after each step, so all
ranks save the same checkpoint and stop together.

Reproducibility: on CPU (fp32) a run, and a run resumed from any checkpoint, ends with bit-identical weights for the
same thread count. On CUDA, bf16 results are reproducible up to the run-to-run noise of atomic adds (weight-gradient
reductions in the Triton kernels and in cuBLAS split-K) and of SDPA's backward; the data order and LoRA init stay
exact. Non-finite losses are recorded as null (strict JSON); a diverging run stops (``divergence``). Metrics also
go to ``--report-to`` (``reporting``).
"""

from __future__ import annotations

import math
import os
import resource
import shutil
import signal
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .. import distributed
from ..distributed import World
from ..errors import LeantuneError
from ..graphs import CapturedStep
from ..heap import long_lived_frozen
from ..patch import is_patched
from ..patch.document_attention import remember_documents, use_document_attention
from . import checkpoint, reporting, run_folder
from .config import TrainConfig, default_seq_len
from .data import PackedData, chitchat_path, load_run_data
from .divergence import DivergenceGuard, good_checkpoints
from .metrics import MetricsLog, plot_losses, say, speak, to_json
from .model import (
    check_quantize,
    load_model,
    load_tokenizer,
    resolve_dtype,
    resolve_model,
    use_chat_template,
    wrap_lora,
)
from .signals import GracefulInterrupt, SignalsDeferred, TerminateAborts
from .sources import canonical, parse_spec
from .step_log import StepLog, raise_deferred_errors

# ---------------------------------------------------------------------------------------------------------------
# One step

GRAPH_WARMUP = 3  # --cuda-graphs: eager steps before the capture (Triton compilation, cuBLAS workspaces)
STEP_CAPTURE = None  # --cuda-graphs: CapturedStep's capture (None: CUDA graphs on CUDA); tests set a CPU recorder


def accumulate_gradients(model, micro_batches: list[PackedData], device: str, world: World = World(),
                         step_targets: int | None = None) -> torch.Tensor:
    """Forward and backward every micro-batch, each loss divided by the global step's total target tokens.

    Gradients accumulate in ``.grad``; returns this process's share of the step's mean loss per target token (the
    sum of its micro losses, a 0-dim tensor on ``device``, never read back here; summed over ranks it is the global
    step's mean). With K micro-batches of B rows on W ranks this equals one batch of K*B*W rows (loss and gradients;
    tested). Several processes: the global step's target count is ``step_targets`` when the caller counted it on
    the host (``leantune train`` does: every rank holds the whole split, ``PackedData.counts``), else one
    all-reduce of it (which reads the sum back: a host sync); gradients reduced by the engine on the last
    micro-batch only.

    No device-to-host sync (docs/design.md, "No host sync in a step"): the target count comes from the host-built
    rows, inputs go up from pinned memory without blocking, the packed rows' documents are told to the attention and
    mask code from the host copy (``remember_documents``), and the loss stays on the device.
    """
    num_items_t = _step_num_items(micro_batches, device, world, step_targets)
    scale = distributed.loss_scale(world)  # the engines average over ranks; the token mean sums
    total = None
    for k, batch in enumerate(micro_batches):
        position_ids = _to_device(batch.position_ids, device)
        remember_documents(position_ids, batch.position_ids)
        with distributed.gradient_sync(model, world, enabled=k == len(micro_batches) - 1):
            loss = model(input_ids=_to_device(batch.input_ids, device), position_ids=position_ids,
                         labels=_to_device(batch.labels, device), num_items_in_batch=num_items_t,
                         use_cache=False).loss
            (loss * scale if scale != 1.0 else loss).backward()
        total = loss.detach() if total is None else total + loss.detach()
    return total


def _step_num_items(micro_batches: list[PackedData], device: str, world: World,
                    step_targets: int | None = None) -> torch.Tensor:
    """The global step's target-token count (summed over ranks; ``step_targets`` when the caller counted it), a
    0-dim int64 tensor on ``device`` (>= 1)."""
    if step_targets is None:
        local = sum(batch.num_targets() for batch in micro_batches)  # host-built rows: no device read
        step_targets = int(distributed.all_reduce_sum([local], world, device)[0])
    return torch.full((), max(step_targets, 1), dtype=torch.int64, device=device)


def _to_device(tensor: torch.Tensor, device: str) -> torch.Tensor:
    """A host-built tensor on ``device``: through pinned memory without blocking on CUDA (a pageable copy waits for
    the device's queue to drain: a host sync), as is on the CPU."""
    if torch.device(device).type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


@torch.no_grad()
def evaluate(model, data: PackedData, batch_size: int, device: str) -> float:
    """Mean loss per target token over ``data`` (no dropout)."""
    was_training = model.training
    model.eval()
    num_items = torch.full((), max(data.num_targets(), 1), dtype=torch.int64, device=device)
    only_loss = {"skip_logits": True} if is_patched(model) else {}  # a patched model in eval mode forms logits
    total = torch.zeros((), dtype=torch.float64, device=device)
    for start in range(0, len(data), batch_size):
        batch = data.select(slice(start, start + batch_size))
        position_ids = _to_device(batch.position_ids, device)
        remember_documents(position_ids, batch.position_ids)
        total += model(input_ids=_to_device(batch.input_ids, device), position_ids=position_ids,
                       labels=_to_device(batch.labels, device), num_items_in_batch=num_items, use_cache=False,
                       **only_loss).loss.double()
    model.train(was_training)
    raise_deferred_errors()
    return total.item()  # one read at the end


def cosine_schedule(optimizer, total_steps: int, warmup_steps: int, min_lr_ratio: float):
    """Linear warmup from lr/warmup to lr, then cosine decay to ``min_lr_ratio * lr`` at ``total_steps``."""

    def factor(step: int) -> float:  # step = optimizer steps taken so far
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def step_rows(step: int, n_rows: int, rows_per_step: int, seed: int) -> torch.Tensor:
    """Row indices of optimizer step ``step`` (data position = step; see the module docstring)."""
    steps_per_epoch = n_rows // rows_per_step
    epoch, index = divmod(step, steps_per_epoch)
    perm = torch.randperm(n_rows, generator=torch.Generator().manual_seed(seed + epoch))
    return perm[index * rows_per_step:(index + 1) * rows_per_step]


# ---------------------------------------------------------------------------------------------------------------
# The run


@dataclass
class RunResult:
    """What ``train`` returns: the summary dict, whether it stopped early (and on which signal), and the output
    directory."""

    summary: dict
    interrupted: bool = False
    stop_signal: int | None = None  # signal.SIGINT or signal.SIGTERM when interrupted
    output: Path = field(default_factory=Path)
    model: object = None  # the trained PeftModel (for callers in the same process, e.g. tests)


@dataclass
class _Run:
    """Everything ``_prepare`` loaded and checked, and the counters the later stages keep."""

    config: TrainConfig
    output: Path
    resume_from: Path | None
    device: str
    dtype: torch.dtype
    kind: str
    model_path: Path
    data_path: Path
    tokenizer: object
    train_data: PackedData
    eval_data: PackedData
    data_info: dict
    total_steps: int
    warmup: int
    model: object = None
    optimizer: object = None
    scheduler: object = None
    metrics: MetricsLog | None = None
    start_step: int = 0
    train_tokens: int = 0
    train_seconds: float = 0.0
    world: World = World()
    wrapped: object = None  # what the forward runs: the DDP wrapper, else ``model`` itself (FSDP2 shards in place)
    resume_state: dict | None = None  # state.json of the checkpoint restored in _prepare
    initial_eval_loss: float | None = None  # the divergence guard's reference (kept in each state.json)
    reporters: reporting.Reporters | None = None  # rank 0's --report-to
    guard: DivergenceGuard | None = None
    captured: CapturedStep | None = None  # --cuda-graphs: the step's graphs (``_graph_step``)
    graph_hosts: dict = field(default_factory=dict)  # id(device position_ids) -> (them, their host copy)
    seq_len_default: bool = False  # --seq-len not given: the device's default (config.DEFAULT_SEQ_LEN) was taken
    data_fingerprint: str = ""  # run_folder.data_fingerprint of the data files, kept in run.json for --resume


def train(config: TrainConfig, *, progress: bool = True, on_step=None) -> RunResult:
    """Run ``leantune train`` with ``config`` (already validated); see the module docstring.

    ``on_step(step)`` is called after each optimizer step (tests use it to simulate Ctrl-C). Raises LeantuneError
    for every user error before anything in ``config.output`` is written or removed. While it writes there, the
    folder holds a lock file with this process's pid: a second run into it is refused.
    """
    replaced: list = []  # (the .replaced-* folder, the names of the previous run) once this run starts moving it
    run = None  # once prepared: its reporters are closed whatever happens
    output = Path(config.output)
    # long sequences fragment the caching allocator (a 319,488-token probe failed with 12 GiB reserved but unused);
    # read at the first CUDA allocation, so it applies unless the caller chose otherwise or already used CUDA
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    try:
        with TerminateAborts():
            try:
                run = _prepare(config)
                _claim(run, replaced)
                with long_lived_frozen():  # no full GC walks over the model's objects between steps
                    stopped = _fit(run, progress and run.world.main, on_step)
                result = stopped if stopped is not None else _finish(run, replaced)
            except BaseException as exc:
                if run is not None:
                    distributed.report_failure(run.world, exc)
                with SignalsDeferred():
                    if replaced and not run_folder.new_run_has_checkpoint(output, *replaced[0]):
                        run_folder.put_back(output, *replaced[0])
                raise
    finally:
        if run is not None and run.reporters is not None:
            run.reporters.close()
        run_folder.release_lock(output)
        speak(True)
    distributed.barrier(run.world)  # rank 0 has released the folder when any rank returns
    distributed.shutdown()  # after a normal end only: a failing rank exits at once and torchrun ends the others
    return result


def _prepare(config: TrainConfig) -> _Run:
    """Every check and load of the run; nothing in the output folder is written or removed."""
    output = Path(config.output)
    device = config.device or ("cuda" if torch.cuda.is_available() else "cpu")
    launch = distributed.check_launch(config.distributed, device)
    if device == "cuda" and not torch.cuda.is_available():
        raise LeantuneError("--device cuda: no CUDA device is available")
    dtype = resolve_dtype(config.dtype, device)
    size = launch.size if launch is not None else 1
    reporting.check_installed(config.report_to)
    if launch is not None:
        speak(launch.main)
        device = distributed.init(launch, device)
    config, seq_len_chosen = default_seq_len(config, device)  # before the resume check compares it with run.json
    if config.cuda_graphs and launch is not None:
        raise LeantuneError("--cuda-graphs runs one process (the captured step has no gradient all-reduce yet); "
                            "leave it out under torchrun")
    if config.cuda_graphs and not device.startswith("cuda") and STEP_CAPTURE is None:
        say(f"leantune: warning: --cuda-graphs needs CUDA (this run is on {device}): the steps run eagerly, with "
            "the same numbers")
    if seq_len_chosen is not None:
        say(seq_len_chosen)
    resume_from = distributed.on_main(lambda: run_folder.check_output(config))

    kind, model_path = resolve_model(config.model)
    check_quantize(kind, model_path, config.quantize)
    tokenizer = load_tokenizer(kind, model_path)
    use_chat_template(tokenizer, config.chat_template)
    # the embedded set is looked up only when it is used: a run on the user's data needs no chitchat package
    data_path = chitchat_path() if config.data is None else canonical(config.data)
    data_files = [chitchat_path()] if config.data is None else [path for path, _ in parse_spec(config.data)]
    fingerprint = distributed.on_main(lambda: run_folder.data_fingerprint(data_files))
    resumed = (distributed.on_main(lambda: run_folder.check_resume(config, output, model_path, data_path))
               if resume_from is not None else None)
    if resumed is not None:
        run_folder.check_resume_data(resumed, fingerprint)
    rows_per_step = config.batch_size * config.grad_accum * size
    train_data, eval_data, data_info = load_run_data(config, tokenizer, rows_per_step)
    steps_per_epoch = len(train_data) // rows_per_step
    if steps_per_epoch == 0:
        processes = f" x {size} processes" if size > 1 else ""
        raise LeantuneError(f"the training split has {len(train_data)} sequences of {config.seq_len} tokens, fewer "
                            f"than one step's --batch-size x --grad-accum{processes} = {rows_per_step}")
    total_steps = config.max_steps or max(1, math.ceil(config.epochs * steps_per_epoch))
    warmup = config.warmup_steps if config.warmup_steps is not None else max(1, round(0.05 * total_steps))
    if config.warmup_steps is not None and warmup >= total_steps > 1:  # the lr would never reach --lr
        raise LeantuneError(f"--warmup-steps {warmup} is not below the run's {total_steps} steps: the whole run would "
                            "be warm-up below --lr; give fewer warm-up steps, or more --max-steps / --epochs")
    stored = None
    if resumed is not None:
        run_folder.check_resume_steps(resumed, resume_from, total_steps)
        stored = checkpoint.read_checkpoint(resume_from)  # a damaged file: one error line, before the model loads
        if resumed.get("world_size", 1) != size:  # the global batch, the ranks' RNG states: another run
            raise LeantuneError(f"--resume: this run has {size} process(es), the run being resumed had "
                                f"{resumed.get('world_size', 1)}; resume with the same number (its global batch and "
                                "per-rank RNG states depend on it) or start a new --output")
    run = _Run(config, output, resume_from, device, dtype, kind, model_path, data_path, tokenizer, train_data,
               eval_data, data_info, total_steps, warmup,
               seq_len_default=seq_len_chosen is not None or bool((resumed or {}).get("seq_len_default")))
    run.data_fingerprint = fingerprint

    # stored weights under several processes: rank 0 reads them on the CPU, the others build the model on the meta
    # device and receive rank 0's values through the engine (distributed.wrap's from_main); NF4 codes are formed
    # from the loaded weights, so --quantize (and a GGUF file) keeps every rank loading. A random init (a bare
    # config.json) is drawn on the device itself, so it equals the one-process run's draw
    from_main = launch is not None and kind == "hf" and config.quantize is None
    if from_main:  # rank 0's load, or its error on every rank (the others would wait for its weights)
        loaded = []
        distributed.on_main(lambda: loaded.append(load_model(kind, model_path, dtype, "cpu", config.seed)))
        model = loaded[0] if loaded else load_model(kind, model_path, dtype, "meta", config.seed)
    else:
        model = load_model(kind, model_path, dtype, device if launch is None or kind == "config" else "cpu",
                           config.seed)
    if len(tokenizer) > model.get_input_embeddings().num_embeddings:
        raise LeantuneError(f"the tokenizer has {len(tokenizer)} tokens but the model's vocabulary only "
                            f"{model.get_input_embeddings().num_embeddings}")
    context = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    if isinstance(context, int) and config.seq_len > context:
        # positions restart at each packed document: only a document longer than the context goes beyond it
        longest = max((int(d.position_ids.max()) + 1 for d in (run.train_data, run.eval_data)
                       if d is not None and len(d)), default=0)
        if longest > context:
            say(f"leantune: warning: --seq-len {config.seq_len} is longer than the model's context "
                f"(max_position_embeddings = {context}) and a document reaches position {longest - 1}; positions "
                "beyond the context were never trained")
    _attend_per_document(model, config)
    run.model = wrap_lora(model, config)
    run.model.train()
    run.wrapped = run.model
    if launch is not None:
        run.world = distributed.choose_engine(config.distributed, launch, run.model, device)
        run.wrapped = distributed.wrap(run.model, run.world, device, from_main=from_main)
        processes = f"{run.world.size} process{'es' if run.world.size > 1 else ''}"
        say(f"leantune: {processes}, {run.world.engine.upper()} ({run.world.reason}); global batch {rows_per_step} "
            f"sequence{'s' if rows_per_step > 1 else ''} = --batch-size {config.batch_size} x --grad-accum "
            f"{config.grad_accum} x {run.world.size} processes")
    params = [p for p in run.model.parameters() if p.requires_grad]
    graphs = config.cuda_graphs and device.startswith("cuda")
    # a float lr here, so the scheduler's base_lrs stay floats; CapturedStep makes it a device tensor (the
    # scheduler's fill_ then reaches the replays)
    run.optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay,
                                      fused=distributed.fused_adamw(device, run.world),
                                      **({"capturable": True} if graphs else {}))
    run.scheduler = cosine_schedule(run.optimizer, total_steps, warmup, config.min_lr_ratio)
    if resume_from is not None:  # applied before the folder is claimed: a mismatch leaves it as it was
        run.resume_state = checkpoint.load_checkpoint(resume_from, run.model, run.optimizer, run.scheduler, run.world,
                                                      stored)
        run.initial_eval_loss = run.resume_state.get("initial_eval_loss")
    return run


def _attend_per_document(model, config: TrainConfig) -> None:
    """Packed rows restart their positions, for which transformers builds a dense [B, 1, S, S] mask (and SDPA with a
    mask has no flash kernel). Where that mask would pass 1 GiB, attention runs per document instead
    (patch.document_attention: exact, O(tokens) memory); below, transformers' path (measured) is kept."""
    mask_gib = config.batch_size * config.seq_len ** 2 / 2**30
    if mask_gib <= 1:
        return
    if config.cuda_graphs:  # its per-document launches come from each batch's host spans: a graph would keep one
        say(f"leantune: warning: --cuda-graphs: packed rows of --seq-len {config.seq_len} get transformers' dense "
            f"{mask_gib:.1f} GiB attention mask (per-document attention is not captured)")
        return
    why = use_document_attention(model)
    if why is None:
        say(f"leantune: packed rows of --seq-len {config.seq_len}: attention runs per document (one causal SDPA "
            f"each) instead of through transformers' dense {mask_gib:.1f} GiB mask")
    else:
        say(f"leantune: warning: packed rows of --seq-len {config.seq_len} get a dense attention mask of "
            f"{mask_gib:.1f} GiB per micro-batch (leantune's per-document attention does not apply: {why}); at "
            "this length the mask, not the model, bounds memory")


def _claim(run: _Run, replaced: list) -> None:
    """Everything the user could get wrong has been checked: from here on the output folder is this run's. A fresh
    run sets aside leantune's own files (check_output allowed it: --overwrite or an incomplete run), never others."""
    config, output, world = run.config, run.output, run.world
    if world.main:  # the other ranks never write in the folder
        output.mkdir(parents=True, exist_ok=True)
        run_folder.acquire_lock(output)
        if run.resume_from is None:
            run_folder.check_output(config)  # another run may have finished here while this one loaded: decide again
            run_folder.set_aside(output, replaced)
        for partial in (output / checkpoint.CHECKPOINTS).glob(".tmp-*"):  # a save cut short by a kill
            shutil.rmtree(partial, ignore_errors=True)
        info = run.data_info
        if info["truncated"]:
            say(f"leantune: warning: {info['truncated']} of {info['examples']} examples were longer than --seq-len "
                f"{config.seq_len} and were truncated")
        # absolute paths: export and --resume may run from another working directory
        run_info = {"tool": "leantune", "config": config.to_dict(), "model_kind": run.kind,
                    "model_path": str(run.model_path.resolve()), "data_path": str(run.data_path.resolve()),
                    "data": info, "device": run.device, "dtype": str(run.dtype), "total_steps": run.total_steps,
                    "warmup_steps": run.warmup, "world_size": world.size, "engine": world.engine,
                    "seq_len_default": run.seq_len_default, "data_fingerprint": run.data_fingerprint,
                    "model_fingerprint": run_folder.model_fingerprint(run.model_path)}
        (output / "run.json").write_text(to_json(run_info, indent=2))
        run.metrics = MetricsLog(output / "metrics.jsonl")
    distributed.barrier(world)  # the folder is claimed before any rank goes on

    if run.resume_from is not None:
        state = run.resume_state
        run.start_step = state["step"]
        if world.main:
            run.metrics.truncate(state["metrics_lines"])
        say(f"leantune: resuming from {run.resume_from} (step {run.start_step} of {run.total_steps})")
    else:
        if world.main:
            run.metrics.reset()
        torch.manual_seed(config.seed + world.rank)  # ranks draw independent dropout masks; rank 0 as one process
    if world.main:
        run.reporters = reporting.Reporters(config.report_to, output, run.start_step, config.to_dict())
        run.metrics.forward = run.reporters.log  # every record logged from here on goes to them too
    if run.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()


def _save(run: _Run, step: int) -> None:
    """The checkpoint of ``step`` (every rank), keeping ``--keep-checkpoints`` and the guard's last good one."""
    good = good_checkpoints(run.output, run.guard)
    lines = run.metrics.lines if run.world.main else 0
    checkpoint.save_checkpoint(run.output, step, run.model, run.optimizer, run.scheduler, lines, run.world,
                               keep=run.config.keep_checkpoints, protected=good[-1] if good else None,
                               extra={"initial_eval_loss": run.initial_eval_loss})


def _fit(run: _Run, progress: bool, on_step) -> RunResult | None:
    """The optimizer steps from ``run.start_step``; returns the result of a run stopped by a signal (after its
    checkpoint), None when every step ran."""
    config, model, device, metrics, world = run.config, run.model, run.device, run.metrics, run.world
    params = [p for p in model.parameters() if p.requires_grad]
    if run.start_step == 0:
        eval_loss = evaluate(model, run.eval_data, config.batch_size, device)
        run.initial_eval_loss = eval_loss
        if world.main:
            metrics.log({"type": "eval", "step": 0, "eval_loss": eval_loss})
    run.guard = DivergenceGuard(config.divergence_factor, config.zero_grad_steps, run.initial_eval_loss)
    run.captured = captured_step(run)  # before the first backward (CapturedStep's stream)
    bar = tqdm(total=run.total_steps, initial=run.start_step, desc="train", unit="step", disable=not progress,
               dynamic_ncols=True)
    log = StepLog(run, bar)
    done = run.start_step
    with GracefulInterrupt() as interrupt:
        for step in range(run.start_step, run.total_steps):
            micro_batches, step_targets, tokens = step_batches(run, step)
            timer = log.start()
            loss, grad_norm, lr = train_step(run, micro_batches, params, step_targets)
            done = step + 1
            log.record(done, timer, loss, grad_norm, lr, tokens)
            if config.eval_every and done % config.eval_every == 0 and done < run.total_steps:
                log.flush()
                eval_loss = evaluate(model, run.eval_data, config.batch_size, device)
                if world.main:
                    metrics.log({"type": "eval", "step": done, "eval_loss": eval_loss})
                say(f"step {done}: eval loss {eval_loss:.4f}")
            if on_step is not None:
                on_step(done)
            # every rank stops after the same step (a host collective: the device's queue is not waited for)
            if distributed.any_rank(interrupt.requested, world, device):
                log.flush()
                interrupt.requested = True
                interrupt.signum = interrupt.signum or signal.SIGTERM  # a peer's signal (torchrun forwards SIGTERM)
                _save(run, done)
                break
            if config.save_every and done % config.save_every == 0 and done < run.total_steps:
                log.flush()
                _save(run, done)
    log.flush()
    bar.close()
    if not interrupt.requested:
        return None
    say(f"leantune: stopped at step {done}; checkpoint saved in {run.output / checkpoint.CHECKPOINTS}; continue "
        "with --resume")
    return RunResult({"steps": done}, interrupted=True, stop_signal=interrupt.signum, output=run.output,
                     model=model)


def step_batches(run: _Run, step: int) -> tuple[list[PackedData], int | None, int]:
    """(micro-batches, step targets, tokens) of optimizer step ``step`` on this rank: its share of the global
    step's rows (``step_rows``) as ``--grad-accum`` micro-batches, and, under several processes, the global step's
    target count (None for one process: ``accumulate_gradients`` counts its micro-batches); tokens: the global
    step's. The counts are the host's: every rank holds the whole split, so each counts what an all-reduce of the
    ranks' counts would give (integers, exactly), without a collective or a device read."""
    config, world = run.config, run.world
    local_rows = config.batch_size * config.grad_accum
    global_rows = step_rows(step, len(run.train_data), local_rows * world.size, config.seed)
    rows = global_rows[world.rank * local_rows:(world.rank + 1) * local_rows]  # this rank's share
    micro_batches = [run.train_data.select(rows[k * config.batch_size:(k + 1) * config.batch_size])
                     for k in range(config.grad_accum)]
    if world.distributed:
        return (micro_batches, *run.train_data.counts(global_rows))
    return micro_batches, None, sum(b.input_ids.numel() for b in micro_batches)


def train_step(run: _Run, micro_batches: list[PackedData], params: list, step_targets: int | None = None):
    """One optimizer step: the micro-batches' forwards and backwards, clipping, the update, the schedule. Returns
    (loss, grad_norm, lr): the loss and the norm as 0-dim tensors on the device (the norm a float NaN when clipping
    is off), never read back here (no device-to-host sync; tests/test_no_sync.py). With ``--cuda-graphs`` the
    same step replays from graphs (``_graph_step``). Several processes: ``step_targets`` is the global step's target
    count (``step_batches``), and the loss returned is the global step's mean, a float64 sum over ranks on the
    device (read at the log point with the step's other numbers)."""
    lr = scheduled_lr(run.scheduler)
    if run.captured is not None:
        loss, grad_norm = _graph_step(run, micro_batches)
        run.scheduler.step()  # a fill_ of the optimizer's lr tensor, which the next replay reads
        return loss, grad_norm, lr
    loss = accumulate_gradients(run.wrapped, micro_batches, run.device, run.world, step_targets)
    grad_norm = _clip(params, run.config.max_grad_norm)
    run.optimizer.step()
    run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    if run.world.distributed:
        loss = distributed.all_reduce_on_device(loss, run.world)
    return loss, grad_norm, lr


def scheduled_lr(scheduler) -> float:
    """The learning rate of the coming step, on the host: LambdaLR's own ``base_lr * factor(step)`` (its
    ``get_last_lr`` holds device tensors once the optimizer's lr is one, and reading those would sync)."""
    return scheduler.base_lrs[0] * scheduler.lr_lambdas[0](scheduler.last_epoch)


def _graph_step(run: _Run, micro_batches: list[PackedData]):
    """One optimizer step through ``run.captured`` (leantune.graphs.CapturedStep): the micro-batches as model
    inputs of one fixed shape (every step takes full --batch-size micro-batches of --seq-len rows: ``step_rows``
    leaves an epoch's remainder rows out), the step's target count as a tensor input, so the summed losses are the
    token mean as in ``accumulate_gradients``; clipping and AdamW inside the captured update. Returns (loss,
    grad_norm) as device tensors (the norm a float NaN when clipping is off)."""
    device = run.device
    num_items_t = _step_num_items(micro_batches, device, run.world)
    run.graph_hosts.clear()
    inputs = []
    for batch in micro_batches:
        position_ids = _to_device(batch.position_ids, device)
        run.graph_hosts[id(position_ids)] = (position_ids, batch.position_ids)
        inputs.append({"input_ids": _to_device(batch.input_ids, device), "position_ids": position_ids,
                       "labels": _to_device(batch.labels, device), "num_items_in_batch": num_items_t,
                       "use_cache": False})
    loss, grad_norm = run.captured.step(inputs)
    return loss, float("nan") if grad_norm is None else grad_norm


def captured_step(run: _Run) -> CapturedStep | None:
    """``--cuda-graphs``: the CapturedStep the steps of ``run`` go through (None: eager steps, on the CPU unless a
    test set ``STEP_CAPTURE``)."""
    if not run.config.cuda_graphs or not (run.device.startswith("cuda") or STEP_CAPTURE is not None):
        return None
    return CapturedStep(run.wrapped, run.optimizer, max_grad_norm=run.config.max_grad_norm or None,
                        warmup=GRAPH_WARMUP, capture=STEP_CAPTURE,
                        prepare=lambda inputs: _remember_host_documents(run, inputs))


def _remember_host_documents(run: _Run, inputs) -> None:
    """Before an eager forward of the captured step: the documents of its packed rows, from their host copy (no
    sync). At capture (the step's static buffers, unknown here) transformers' packed-row check forms the document
    index on the device, which the replays then recompute from each step's positions."""
    known = run.graph_hosts.get(id(inputs["position_ids"]))
    if known is not None and known[0] is inputs["position_ids"]:
        remember_documents(*known)


def _finish(run: _Run, replaced: list) -> RunResult:
    """The last checkpoint, the final eval, the adapter and the run's summary; then the replaced run goes."""
    config, output, model, total_steps, world = run.config, run.output, run.model, run.total_steps, run.world
    # the last step saved before the final eval (a kill during it loses no step); a first Ctrl-C / SIGTERM from here
    # on lets the run finish its eval and files, a second aborts
    with GracefulInterrupt():
        _save(run, total_steps)
        final_eval = evaluate(model, run.eval_data, config.batch_size, run.device)
        checkpoint.save_adapter(model, output / "adapter", world)
        if not world.main:
            return RunResult({"steps": total_steps, "final_eval_loss": final_eval}, output=output, model=model)
        run.metrics.log({"type": "eval", "step": total_steps, "eval_loss": final_eval})
        run.tokenizer.save_pretrained(output / "tokenizer")
    records = run.metrics.read()
    evals = [r for r in records if r["type"] == "eval"]
    summary = {
        "steps": total_steps,
        "initial_eval_loss": evals[0]["eval_loss"],
        "final_eval_loss": final_eval,
        "tokens_per_s": run.train_tokens / run.train_seconds if run.train_seconds else None,
        "world_size": world.size,
        "engine": world.engine,
        "global_batch": config.batch_size * config.grad_accum * world.size,
        "peak_memory_gib": _peak_memory_gib(run.device),
        "peak_memory_kind": ("torch.cuda.max_memory_allocated (rank 0)" if run.device.startswith("cuda")
                             else "process peak RSS (rank 0)" if world.distributed else "process peak RSS"),
        "train_tokens_this_session": run.train_tokens,
        "train_seconds_this_session": run.train_seconds,
        "device": run.device,
        "dtype": str(run.dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "patched": is_patched(model),
        "model": str(run.model_path),
        "data": str(run.data_path),
        **{k: run.data_info[k] for k in ("train_rows", "eval_rows", "truncated")},
    }
    (output / "summary.json").write_text(to_json(summary, indent=2))
    run_folder.delete_replaced(output, replaced, asked=config.overwrite or run.resume_from is not None)
    plot_losses(records, output / "loss.png")
    if not math.isfinite(final_eval):
        say(f"leantune: warning: the final eval loss is non-finite ({final_eval}); summary.json records null")
    print(f"leantune: eval loss {_loss_text(evals[0]['eval_loss'])} -> {_loss_text(final_eval)} after "
          f"{total_steps} step{'s' if total_steps != 1 else ''}; wrote {output}")
    return RunResult(summary, output=output, model=model)


def _loss_text(loss: float | None) -> str:
    return f"{loss:.4f}" if loss is not None and math.isfinite(loss) else "non-finite"


def _clip(params: list, max_norm: float):
    """Clip the global gradient norm (over every rank's shard under FSDP2); returns it as a 0-dim tensor, not read
    back (a float NaN when off)."""
    if max_norm <= 0:
        return float("nan")
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def _peak_memory_gib(device: str) -> float:
    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB; process peak RSS
