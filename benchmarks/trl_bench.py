"""TRL's SFTTrainer / DPOTrainer / GRPOTrainer several ways, same model, data and settings: TRL's own loss head
(``trl``), TRL with ``use_liger_kernel=True`` (``trl+liger``), and leantune's head and layers (``leantune``:
``patch_trainer``; ``leantune+default-gc``: the same with ``freeze_heap=False``, which shows what freezing the heap
buys; ``leantune+offload`` and ``leantune+offload+tiled``: with offloaded checkpoints, and MLP tiles of 4096 tokens,
for the long GRPO batch).

Each implementation trains in its own process (Liger patches modules). The model is ``leantune bench``'s (a config's
random-init bf16 model, weights drawn from (seed, name), PEFT LoRA r16 on all 7 projections with fp32 adapters,
non-reentrant gradient checkpointing); the data are random token rows: SFT rows of exactly ``--seq`` tokens,
pre-tokenised; DPO rows of a ``--seq / 2``-token prompt with chosen and rejected completions of ``--seq / 2`` each
(decoded text TRL tokenises, truncated to ``--seq``). A step is timed from the trainer's step begin to its end
(CUDA-synchronised): forward, backward and optimizer. tokens/s counts the tokens the trainer fed the model in the
timed steps (its ``num_input_tokens_seen``: DPO's chosen and rejected rows; the reference pass is not counted).
Peak memory is ``max_memory_allocated`` after the warm-up steps (with ``--warmup 0``, of the whole run). The first
step's loss and grad norm must agree with TRL's own head's: the table flags a relative difference above 1e-2 (loss)
or 3e-2 (grad norm), bf16 (GRPO's bounds: :func:`agreement`).

GRPO (``--trainer grpo``, trl 1.16): a step is one optimizer step over one prompt's group of ``--num-generations``
completions (``per_device_train_batch_size`` ``--micro-batch``, default the whole group in one forward;
``gradient_accumulation_steps`` = ``steps_per_generation`` = group / micro-batch, so one generation batch per
optimizer step and no old-log-prob pass, ``num_iterations`` 1). Generation is replaced through TRL's
``rollout_func`` hook (:class:`FixedRollouts`): each prompt is ``--prompt-len`` token ids drawn from its text, each
completion exactly ``--completion-len`` ids drawn from (seed, call), never an EOS, pad or special token, so no
completion is cut short or masked; the same draws in every implementation. ``generate`` and TRL's
``_generate_single_turn`` raise if called. Everything after generation is TRL's and is timed: decoding for the
reward, the reward (:func:`hashed_reward`, a CRC of the ids: deterministic, spread within a group), the reference
pass (``--beta`` > 0; no gradient; given a PEFT model, TRL 1.16 adds a frozen ``ref`` adapter copied from the
policy's and scores the reference with it, a full LoRA forward over the group), the group advantages, the policy's
forward with the loss (``--loss-type``, default TRL's ``dapo``) and backward, and the optimizer step. The substitute's
own time (drawing ids, microseconds) is subtracted from each step. tokens/s counts the prompt + completion tokens
of the policy's training forward in the timed steps (``num_generations * (prompt_len + completion_len)`` per step:
TRL's own ``num_input_tokens_seen``; the reference pass over the same tokens is not counted again).
TRL 1.16's GRPOTrainer with ``use_liger_kernel=True`` applies Liger's layer kernels only (RMSNorm, RoPE, SwiGLU):
it sets ``liger_kernel_config["fused_linear_cross_entropy"] = False`` and keeps its own chunked log-prob head, and
has no switch to Liger's fused GRPO loss; the table says so.

``--memory-cap-gib G`` caps the process at G GiB (``torch.cuda.set_per_process_memory_fraction``, as ``leantune
bench e2e --memory-cap-gib``); a run that runs out of memory is a row with status ``oom``, not a crash. The long
GRPO batch (issue #27: >= 110K tokens at 8B in 80 GiB) is one group of 8 completions of 14,208 tokens after a
128-token prompt trained in one micro-batch: 8 x 14,336 = 114,688 tokens in one forward and backward (113,664 of
them completion tokens); accumulation over micro-batches would not raise the peak, so the "completion batch" is
what one forward holds.

On the device machine, from the repo root (after ``source benchmarks/gpu_env.sh``; carry .gpu and .whl, whose trl,
datasets, dill, multiprocess and liger-kernel wheels the device image lacks):

    python3 benchmarks/trl_bench.py --config .gpu/llama3-8b --trainer sft --seq 4096 --out $OUT/trl-sft
    python3 benchmarks/trl_bench.py --config .gpu/llama3-8b --trainer grpo --out $OUT/trl-grpo
    python3 benchmarks/trl_bench.py --config .gpu/llama3-8b --trainer grpo --completion-len 14208 --warmup 1 \\
        --steps 1 --impls leantune+offload --memory-cap-gib 80 --out $OUT/grpo-long

``--device cpu`` is the dry run the tests make on a tiny model.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import time
import zlib
from array import array
from pathlib import Path
from types import SimpleNamespace

IMPLS = ("trl", "trl+liger", "leantune", "leantune+default-gc", "leantune+offload", "leantune+offload+tiled")
DEFAULT_IMPLS = {"sft": IMPLS[:4], "dpo": IMPLS[:4], "grpo": ("trl", "trl+liger", "leantune")}
TILE_TOKENS = 4096  # leantune+offload+tiled's MLP tile (bench e2e's)
# leantune.patch's switches per leantune implementation (through patch_trainer)
PATCH = {"leantune": {}, "leantune+default-gc": {}, "leantune+offload": {"offload_checkpoints": True},
         "leantune+offload+tiled": {"offload_checkpoints": True, "tile_mlp": TILE_TOKENS}}
GIB = 2**30
LIGER_GRPO_NOTE = ("trl+liger under GRPO: TRL 1.16 applies Liger's layer kernels only (RMSNorm, RoPE, SwiGLU; "
                   "fused_linear_cross_entropy forced off): the log-prob head is TRL's own chunked one; TRL 1.16 has "
                   "no switch to Liger's fused GRPO loss.")


def _rows(args, tokenizer, vocab_size):
    import torch

    g = torch.Generator().manual_seed(args.seed + 2)
    n = args.warmup + args.steps
    if args.trainer == "sft":
        return {"input_ids": torch.randint(0, vocab_size, (n * args.batch, args.seq), generator=g).tolist()}
    if args.trainer == "grpo":  # one prompt per step; its text only names it (FixedRollouts draws its ids)
        return {"prompt": [f"prompt {i}" for i in range(n)]}
    half = args.seq // 2
    text = lambda: tokenizer.decode(torch.randint(0, len(tokenizer), (half,), generator=g).tolist())  # noqa: E731
    rows = [(text(), " " + text(), " " + text()) for _ in range(n * args.batch)]
    return {"prompt": [r[0] for r in rows], "chosen": [r[1] for r in rows], "rejected": [r[2] for r in rows]}


class FixedRollouts:
    """GRPOTrainer's ``rollout_func`` (trl 1.16) in place of generation: for the prompt rows TRL hands it (one per
    completion: its sampler repeats each prompt ``num_generations`` times), the prompt's ``prompt_len`` token ids
    (drawn from a generator seeded by the prompt text's CRC, so a group shares them) and one completion of exactly
    ``completion_len`` ids (drawn from (seed, call number)), both from the ids below ``vocab_size`` that the
    tokenizer has, minus TRL's EOS ids, the pad id and the tokenizer's special ids; ``logprobs`` None (no
    importance-sampling correction: TRL computes that only under vLLM).

    Attributes:
        calls: how many times TRL called it (one per generation batch).
        seconds: its total time, s (subtracted from the timed steps).
    """

    def __init__(self, prompt_len: int, completion_len: int, vocab_size: int, seed: int):
        self.prompt_len, self.completion_len, self.vocab_size, self.seed = prompt_len, completion_len, vocab_size, seed
        self.calls, self.seconds, self._ids, self._prompts = 0, 0.0, None, {}

    def _allowed(self, trainer):
        import torch

        tokenizer = trainer.processing_class
        banned = {*trainer.eos_token_ids, tokenizer.pad_token_id, *tokenizer.all_special_ids}
        return torch.tensor([i for i in range(min(self.vocab_size, len(tokenizer))) if i not in banned])

    def __call__(self, prompts: list, trainer) -> dict:
        import torch

        start = time.perf_counter()
        if self._ids is None:
            self._ids = self._allowed(trainer)
        ids = self._ids
        for text in prompts:
            if text not in self._prompts:
                g = torch.Generator().manual_seed(zlib.crc32(str(text).encode()))
                self._prompts[text] = ids[torch.randint(len(ids), (self.prompt_len,), generator=g)].tolist()
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.calls)
        completions = ids[torch.randint(len(ids), (len(prompts), self.completion_len), generator=g)]
        self.calls += 1
        out = {"prompt_ids": [self._prompts[text] for text in prompts], "completion_ids": completions.tolist(),
               "logprobs": None}
        self.seconds += time.perf_counter() - start
        return out


def hashed_reward(completions, completion_ids, **_) -> list[float]:
    """GRPO's reward, in [0, 1): a CRC of each completion's token ids (deterministic, so every implementation sees
    the same rewards; random across a group, so its advantages are not zero)."""
    return [zlib.crc32(array("q", ids).tobytes()) / 2**32 for ids in completion_ids]


def _forbid_generation(trainer, hf, counter: dict) -> None:
    """Make real generation raise (and count the attempt): TRL's generation path and the models' ``generate``."""

    def forbidden(*_, **__):
        counter["generate_calls"] += 1
        raise RuntimeError("trl_bench: real generation was called; the benchmark's rollout_func replaces it")

    trainer._generate_single_turn = forbidden
    trainer.model.generate = forbidden
    hf.generate = forbidden


def _grpo_trainer(args, model, tokenizer, config, data, output_dir, cuda):
    import trl

    micro = args.micro_batch or args.num_generations
    settings = dict(output_dir=output_dir, max_steps=args.warmup + args.steps, per_device_train_batch_size=micro,
                    gradient_accumulation_steps=args.num_generations // micro, num_generations=args.num_generations,
                    max_completion_length=args.completion_len, beta=args.beta, num_iterations=1,
                    learning_rate=1e-4, logging_steps=1, report_to=[], save_strategy="no", seed=args.seed,
                    bf16=cuda, use_cpu=not cuda, disable_tqdm=True,
                    optim="adamw_torch_fused" if cuda else "adamw_torch", use_liger_kernel=args.impl == "trl+liger",
                    dataloader_num_workers=0, shuffle_dataset=False, gradient_checkpointing=True,
                    # explicit: TRL re-enables checkpointing with these after its no-grad passes; offload needs it
                    gradient_checkpointing_kwargs={"use_reentrant": False})
    if args.loss_type is not None:
        settings["loss_type"] = args.loss_type
    rollouts = FixedRollouts(args.prompt_len, args.completion_len, config.vocab_size, args.seed + 3)
    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"  # rollout_func's "experimental" notice
    trainer = trl.GRPOTrainer(model=model, args=trl.GRPOConfig(**settings), reward_funcs=hashed_reward,
                              train_dataset=data, processing_class=tokenizer, rollout_func=rollouts)
    return trainer, rollouts


def _cap_memory(cap_gib: float) -> None:
    """``torch.cuda.set_per_process_memory_fraction`` to ``cap_gib`` GiB of the current card (ValueError above its
    size)."""
    import torch

    card = torch.cuda.current_device()
    total = torch.cuda.get_device_properties(card).total_memory
    if cap_gib * GIB > total:
        raise ValueError(f"--memory-cap-gib {cap_gib:g} exceeds the card's {total / GIB:.1f} GiB")
    torch.cuda.set_per_process_memory_fraction(cap_gib * GIB / total, card)


def _identity(args, impl: str | None = None) -> dict:
    """What a result row says about its run: implementation, trainer, batch shape, cap."""
    row = {"impl": impl or args.impl, "trainer": args.trainer, "memory_cap_gib": args.memory_cap_gib}
    if args.trainer != "grpo":
        row.update(seq=args.seq, batch=args.batch)
    else:
        row.update(num_generations=args.num_generations, prompt_len=args.prompt_len,
                   completion_len=args.completion_len, micro_batch=args.micro_batch or args.num_generations,
                   beta=args.beta, loss_type=args.loss_type)
    return row


def child(args) -> dict:
    import datasets
    import torch
    import trl
    from transformers import AutoTokenizer, TrainerCallback

    from leantune.bench.build import build
    from leantune.integrations.trl import loss_head_calls, patch_trainer

    cuda = args.device == "cuda"
    if args.impl == "trl+liger":
        try:
            import liger_kernel  # noqa: F401
        except ImportError as exc:
            return {**_identity(args), "status": "skipped", "error": f"liger_kernel not importable ({exc})"}
    if cuda and args.memory_cap_gib is not None:  # what a smaller card would allow this process
        _cap_memory(args.memory_cap_gib)
    spec = SimpleNamespace(impl="hf+peft", config=args.config, layers=args.layers, device=args.device,
                           seed=args.seed, gc=True, lora_r=16, lora_alpha=32)
    model, config = build(spec)
    tokenizer = AutoTokenizer.from_pretrained(args.config)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    data = datasets.Dataset.from_dict(_rows(args, tokenizer, config.vocab_size))
    output_dir = str(Path(args.out) / f"trainer-{args.impl}")
    rollouts, generation = None, {"generate_calls": 0}
    if args.trainer == "grpo":
        trainer, rollouts = _grpo_trainer(args, model, tokenizer, config, data, output_dir, cuda)
        _forbid_generation(trainer, model.get_base_model(), generation)
    else:
        common = dict(output_dir=output_dir, max_steps=args.warmup + args.steps + (1 if args.profile else 0),
                      per_device_train_batch_size=args.batch, learning_rate=1e-4, logging_steps=1, report_to=[],
                      save_strategy="no", seed=args.seed, bf16=cuda, use_cpu=not cuda, disable_tqdm=True,
                      optim="adamw_torch_fused" if cuda else "adamw_torch", max_length=args.seq,
                      use_liger_kernel=args.impl == "trl+liger", dataloader_num_workers=0,
                      include_num_input_tokens_seen=True)
        if args.trainer == "sft":
            trainer = trl.SFTTrainer(model=model, args=trl.SFTConfig(**common), train_dataset=data,
                                     processing_class=tokenizer)
        else:
            trainer = trl.DPOTrainer(model=model, args=trl.DPOConfig(**common), train_dataset=data,
                                     processing_class=tokenizer)
    if args.impl.startswith("leantune"):  # +default-gc: Python's collector left as it is (what the freeze buys)
        patch_trainer(trainer, freeze_heap=args.impl != "leantune+default-gc", **PATCH[args.impl])

    class Clock(TrainerCallback):
        def __init__(self):
            self.times, self.tokens, self.generation, self.frozen = [], [], [], []
            self.start = self.generated = 0.0
            self.seen = 0

        def on_step_begin(self, args_, state, *_, **__):
            if cuda:
                torch.cuda.synchronize()
            if profiler is not None and len(self.times) == args.warmup + args.steps:  # the extra, untimed step
                profiler.start()
                self.profile_t0 = time.perf_counter()
            self.start, self.seen = time.perf_counter(), state.num_input_tokens_seen
            self.generated = rollouts.seconds if rollouts else 0.0

        def on_step_end(self, args_, state, *_, **__):
            if cuda:
                torch.cuda.synchronize()
            if profiler is not None and self.profile_t0 is not None:
                profiler.stop()
                self.profile_wall_s, self.profile_t0 = time.perf_counter() - self.profile_t0, None
                return
            generation_s = (rollouts.seconds if rollouts else 0.0) - self.generated
            self.generation.append(generation_s)
            self.times.append(time.perf_counter() - self.start - generation_s)  # the training part only
            self.tokens.append(state.num_input_tokens_seen - self.seen)
            self.frozen.append(gc.get_freeze_count())
            if len(self.times) == args.warmup and cuda:
                torch.cuda.reset_peak_memory_stats()

    profiler = None
    if args.profile and args.trainer != "grpo":  # one more step after the timed ones, under torch.profiler
        from torch.profiler import ProfilerActivity, profile
        profiler = profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU])
    clock = Clock()
    clock.profile_t0 = clock.profile_wall_s = None
    trainer.add_callback(clock)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    try:
        trainer.train()
    except torch.OutOfMemoryError as exc:  # a result (status oom), with what was measured before it
        return {**_identity(args), "status": "oom", "error": str(exc).splitlines()[0][:300],
                "steps_done": len(clock.times), "step_s": clock.times, "tokens": clock.tokens,
                "peak_gib": torch.cuda.max_memory_allocated() / GIB if cuda else None,
                "generate_calls": generation["generate_calls"], "rollout_calls": rollouts.calls if rollouts else None}
    profiled = {}
    if profiler is not None and clock.profile_wall_s is not None:
        from leantune.bench.stepstats import busy_fraction, device_intervals, top_kernels

        events = profiler.profiler.kineto_results.events()
        intervals, kernels = device_intervals(events, args.device)
        profiled = {"profiled_step_ms": 1e3 * clock.profile_wall_s, "kernels_per_step": kernels,
                    "busy_fraction": busy_fraction(intervals, clock.profile_wall_s * 1e9) if intervals else None,
                    "top_kernels": top_kernels(events, args.device, 1)}
    logs = [h for h in trainer.state.log_history if "loss" in h]
    timed, tokens = clock.times[args.warmup:], clock.tokens[args.warmup:]
    return {**_identity(args), "status": "ok" if math.isfinite(logs[0]["loss"]) else "nonfinite",
            "steps": len(timed), "step_s": timed, "tokens": tokens, "tokens_per_s": sum(tokens) / sum(timed),
            "frozen_objects": min(clock.frozen), "generation_s": clock.generation[args.warmup:],
            "rollout_calls": rollouts.calls if rollouts else None, "generate_calls": generation["generate_calls"],
            "peak_gib": torch.cuda.max_memory_allocated() / GIB if cuda else None,
            "first_loss": logs[0]["loss"], "first_grad_norm": logs[0].get("grad_norm"),
            "first_kl": logs[0].get("kl"), "first_entropy": logs[0].get("entropy"),
            "first_reward_std": logs[0].get("reward_std"),
            "loss_head_calls": loss_head_calls(trainer.model),
            "summary_loss_runs": (getattr(trainer.model.get_base_model(), "leantune_summary", None) or {}).get(
                "loss_runs"),
            "versions": {m: __import__(m).__version__ for m in ("torch", "transformers", "peft", "trl")},
            "gpu": torch.cuda.get_device_name() if cuda else None, "date": time.strftime("%Y-%m-%d %H:%M"),
            **profiled}


def child_safe(args) -> dict:
    """:func:`child`, with running out of memory anywhere (the build, a cuBLAS workspace) a result: status oom."""
    import torch

    try:
        return child(args)
    except torch.OutOfMemoryError as exc:
        return {**_identity(args), "status": "oom", "error": str(exc).splitlines()[0][:300]}
    except RuntimeError as exc:  # allocation failures that do not surface as OutOfMemoryError
        if not any(m in str(exc) for m in ("out of memory", "CUBLAS_STATUS_ALLOC_FAILED")):
            raise
        return {**_identity(args), "status": "oom", "error": f"{type(exc).__name__}: {str(exc)[:300]}"}


def agreement(row: dict, base: dict | None) -> str:
    """"reference", "ok", or "FLAG: ..." when the first step's numbers are off TRL's own head's (bf16 bounds): the
    loss (1e-2 relative) and grad norm (3e-2 relative). GRPO's first loss is mostly no check of the head: the policy
    starts at its reference and the ratio is exactly 1 in the forward, so the loss is -mean(advantage) (~1e-9,
    whatever the head) plus beta times the logged KL (0, or bf16 noise where the no-gradient reference pass rounds
    differently from the policy's); there the loss must agree to 1e-2 relative plus 1e-6 plus beta times both runs'
    KL, and the logged entropy (the head's per-token output, averaged) to 1e-2 relative."""
    if base is None:
        return "no reference"
    if row is base:
        return "reference"
    checks = [("first_grad_norm", 3e-2, 0.0)]
    if row.get("trainer") == "grpo":
        kl = abs(row.get("first_kl") or 0.0) + abs(base.get("first_kl") or 0.0)
        checks += [("first_loss", 1e-2, 1e-6 + row["beta"] * kl), ("first_entropy", 1e-2, 0.0)]
    else:
        checks += [("first_loss", 1e-2, 0.0)]
    flags = [f"{key} {row[key]:.4g} vs {base[key]:.4g}"
             for key, rel, absolute in checks
             if not abs(row[key] - base[key]) <= rel * abs(base[key]) + absolute]
    return "FLAG: " + ", ".join(flags) if flags else "ok"


def _shape(r: dict) -> str:
    """The batch of one step: ``seq x batch``, or GRPO's ``completions x (prompt + completion)``; and the cap."""
    if r.get("trainer") == "grpo":
        text = f"{r['num_generations']} x ({r['prompt_len']}+{r['completion_len']})"
        if r.get("micro_batch") not in (None, r["num_generations"]):
            text += f", micro {r['micro_batch']}"
    else:
        text = f"{r.get('seq')} x {r.get('batch')}"
    return text + (f", cap {r['memory_cap_gib']:g} GiB" if r.get("memory_cap_gib") is not None else "")


def table(results: list[dict]) -> str:
    base = next((r for r in results if r["impl"] == "trl" and r.get("status") == "ok"), None)
    liger = next((r for r in results if r["impl"] == "trl+liger" and r.get("status") == "ok"), None)
    lines = ["| trainer | impl | batch | tokens/s | x TRL | x TRL+Liger | median step ms | peak GiB | first loss "
             "| first grad norm | leantune head calls | agreement |", "|---" * 12 + "|"]
    for r in results:
        peak = "—" if r.get("peak_gib") is None else f"{r['peak_gib']:.2f}"
        if r.get("status") != "ok":
            lines.append(f"| {r.get('trainer', '')} | {r['impl']} | {_shape(r)} | {r.get('status')}: "
                         f"{r.get('error', '')[:80]} | | | | {peak} | | | | |")
            continue
        x = r["tokens_per_s"] / base["tokens_per_s"] if base else math.nan
        x_liger = f"{r['tokens_per_s'] / liger['tokens_per_s']:.2f}" if liger else "—"
        median_ms = 1e3 * statistics.median(r["step_s"])
        lines.append(f"| {r['trainer']} | {r['impl']} | {_shape(r)} | {r['tokens_per_s']:,.0f} | {x:.2f} | "
                     f"{x_liger} | {median_ms:.0f} | {peak} | {r['first_loss']:.4g} | {r['first_grad_norm']:.4g} | "
                     f"{r['loss_head_calls']} | {agreement(r, base)} |")
    if any(r.get("trainer") == "grpo" and r["impl"] == "trl+liger" for r in results):
        lines += ["", LIGER_GRPO_NOTE]
    return "\n".join(lines)


def _check(p, args) -> list[str]:
    """The implementations to run; argparse's error (exit 2) for bad options, before any implementation runs."""
    impls = args.impls.split(",") if args.impls else list(DEFAULT_IMPLS[args.trainer])
    unknown = [impl for impl in impls if impl not in IMPLS]
    if unknown:
        p.error(f"unknown implementation(s) {', '.join(unknown)}; expected some of {', '.join(IMPLS)}")
    if args.memory_cap_gib is not None and not args.memory_cap_gib > 0:
        p.error(f"--memory-cap-gib must be a positive number of GiB, got {args.memory_cap_gib}")
    for name in ("seq", "batch", "steps", "prompt_len", "completion_len"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0:
        p.error(f"--warmup must be >= 0, got {args.warmup}")
    if args.trainer == "grpo":
        if args.num_generations < 2:
            p.error(f"--num-generations must be >= 2 (GRPO's group advantages), got {args.num_generations}")
        micro = args.micro_batch or args.num_generations
        if micro < 1 or args.num_generations % micro:
            p.error(f"--micro-batch must divide --num-generations ({args.num_generations}), got {micro}")
        if not args.beta >= 0:
            p.error(f"--beta must be >= 0, got {args.beta}")
    return impls


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="model folder with config.json and a tokenizer")
    p.add_argument("--trainer", choices=("sft", "dpo", "grpo"), default="sft")
    p.add_argument("--impls", default=None, help="comma-separated; default trl,trl+liger,leantune for grpo, else "
                   "the first four of " + ",".join(IMPLS))
    p.add_argument("--seq", type=int, default=4096, help="SFT/DPO row length, tokens")
    p.add_argument("--batch", type=int, default=1, help="SFT/DPO rows per step")
    p.add_argument("--num-generations", type=int, default=8, help="GRPO: completions per prompt (one step's group)")
    p.add_argument("--completion-len", type=int, default=2048, help="GRPO: tokens per completion, exactly")
    p.add_argument("--prompt-len", type=int, default=128, help="GRPO: prompt tokens")
    p.add_argument("--micro-batch", type=int, default=None,
                   help="GRPO: completions per forward (per_device_train_batch_size); default the whole group")
    p.add_argument("--beta", type=float, default=0.04, help="GRPO: KL coefficient (> 0: the reference pass runs)")
    p.add_argument("--loss-type", default=None, help="GRPO: GRPOConfig.loss_type (default TRL's)")
    p.add_argument("--memory-cap-gib", type=float, default=None,
                   help="cap each implementation's process at this many GiB of the card (CUDA only)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", action="store_true",
                   help="SFT/DPO: one more step after the timed ones under torch.profiler (untimed): GPU-busy "
                        "fraction, kernels and the top kernels of that step in each implementation's JSON")
    p.add_argument("--layers", type=int, default=None, help="override num_hidden_layers")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--out", required=True, help="folder for one JSON per implementation and table.md")
    p.add_argument("--impl", default=None, help=argparse.SUPPRESS)  # the child's implementation
    args = p.parse_args(argv)
    impls = _check(p, args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.impl is not None:
        result = child_safe(args)
        (out / f"{args.trainer}-{args.impl.replace('+', '-')}.json").write_text(json.dumps(result, indent=1))
        return 0
    results = []
    for impl in impls:
        log = out / f"{args.trainer}-{impl.replace('+', '-')}.log"
        with open(log, "w") as f:
            code = subprocess.call([sys.executable, __file__, *(argv if argv is not None else sys.argv[1:]),
                                    "--impl", impl], stdout=f, stderr=subprocess.STDOUT, env=os.environ.copy())
        path = out / f"{args.trainer}-{impl.replace('+', '-')}.json"
        results.append(json.loads(path.read_text()) if code == 0 and path.exists() else
                       {**_identity(args, impl), "status": f"exit {code}",
                        "error": log.read_text()[-300:].replace("\n", " ")})
    text = table(results)
    (out / f"{args.trainer}-table.md").write_text(text + "\n")
    print(text)
    return 0 if any(r.get("status") in ("ok", "oom") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
