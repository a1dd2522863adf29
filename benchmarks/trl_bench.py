"""TRL's SFTTrainer / DPOTrainer several ways, same model, data and settings: TRL's own loss head (``trl``), TRL with
``use_liger_kernel=True`` (``trl+liger``), and leantune's head and layers (``leantune``: ``patch_trainer``; and
``leantune+default-gc``: the same with ``freeze_heap=False``, which shows what freezing the heap buys).

Each implementation trains in its own process (Liger patches modules). The model is ``leantune bench``'s (a config's
random-init bf16 model, weights drawn from (seed, name), PEFT LoRA r16 on all 7 projections with fp32 adapters,
non-reentrant gradient checkpointing); the data are random token rows: SFT rows of exactly ``--seq`` tokens,
pre-tokenised; DPO rows of a ``--seq / 2``-token prompt with chosen and rejected completions of ``--seq / 2`` each
(decoded text TRL tokenises, truncated to ``--seq``). A step is timed from the trainer's step begin to its end
(CUDA-synchronised): forward, backward and optimizer. tokens/s counts the tokens the trainer fed the model in the
timed steps (its ``num_input_tokens_seen``: DPO's chosen and rejected rows; the reference pass is not counted).
Peak memory is ``max_memory_allocated`` after the warm-up steps. The first step's loss and grad norm must agree
with TRL's own head's: the table flags a relative difference above 1e-2 (loss) or 3e-2 (grad norm), bf16.

On the device machine, from the repo root (after ``source benchmarks/gpu_env.sh``; carry .gpu and .whl, whose trl,
datasets, dill, multiprocess and liger-kernel wheels the device image lacks):

    python3 benchmarks/trl_bench.py --config .gpu/llama3-8b --trainer sft --seq 4096 --out $OUT/trl-sft

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
from pathlib import Path
from types import SimpleNamespace

IMPLS = ("trl", "trl+liger", "leantune", "leantune+default-gc")


def _rows(args, tokenizer, vocab_size):
    import torch

    g = torch.Generator().manual_seed(args.seed + 2)
    n = args.warmup + args.steps
    if args.trainer == "sft":
        return {"input_ids": torch.randint(0, vocab_size, (n * args.batch, args.seq), generator=g).tolist()}
    half = args.seq // 2
    text = lambda: tokenizer.decode(torch.randint(0, len(tokenizer), (half,), generator=g).tolist())  # noqa: E731
    rows = [(text(), " " + text(), " " + text()) for _ in range(n * args.batch)]
    return {"prompt": [r[0] for r in rows], "chosen": [r[1] for r in rows], "rejected": [r[2] for r in rows]}


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
            return {"impl": args.impl, "trainer": args.trainer, "status": "skipped",
                    "error": f"liger_kernel not importable ({exc})"}
    spec = SimpleNamespace(impl="hf+peft", config=args.config, layers=args.layers, device=args.device,
                           seed=args.seed, gc=True, lora_r=16, lora_alpha=32)
    model, config = build(spec)
    tokenizer = AutoTokenizer.from_pretrained(args.config)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    data = datasets.Dataset.from_dict(_rows(args, tokenizer, config.vocab_size))
    common = dict(output_dir=str(Path(args.out) / f"trainer-{args.impl}"), max_steps=args.warmup + args.steps,
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
        patch_trainer(trainer, freeze_heap=args.impl == "leantune")

    class Clock(TrainerCallback):
        def __init__(self):
            self.times, self.tokens, self.start, self.seen, self.frozen = [], [], 0.0, 0, []

        def on_step_begin(self, args_, state, *_, **__):
            if cuda:
                torch.cuda.synchronize()
            self.start, self.seen = time.perf_counter(), state.num_input_tokens_seen

        def on_step_end(self, args_, state, *_, **__):
            if cuda:
                torch.cuda.synchronize()
            self.times.append(time.perf_counter() - self.start)
            self.tokens.append(state.num_input_tokens_seen - self.seen)
            self.frozen.append(gc.get_freeze_count())
            if len(self.times) == args.warmup and cuda:
                torch.cuda.reset_peak_memory_stats()

    clock = Clock()
    trainer.add_callback(clock)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    timed, tokens = clock.times[args.warmup:], clock.tokens[args.warmup:]
    return {"impl": args.impl, "trainer": args.trainer, "status": "ok" if math.isfinite(logs[0]["loss"]) else
            "nonfinite", "seq": args.seq, "batch": args.batch, "steps": len(timed), "step_s": timed,
            "tokens": tokens, "tokens_per_s": sum(tokens) / sum(timed), "frozen_objects": min(clock.frozen),
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
            "first_loss": logs[0]["loss"], "first_grad_norm": logs[0].get("grad_norm"),
            "loss_head_calls": loss_head_calls(trainer.model),
            "summary_loss_runs": (getattr(trainer.model.get_base_model(), "leantune_summary", None) or {}).get(
                "loss_runs"),
            "versions": {m: __import__(m).__version__ for m in ("torch", "transformers", "peft", "trl")},
            "gpu": torch.cuda.get_device_name() if cuda else None, "date": time.strftime("%Y-%m-%d %H:%M")}


def agreement(row: dict, base: dict | None) -> str:
    """"reference", "ok", or "FLAG: ..." when the first loss or grad norm is off TRL's own head's (bf16 bounds)."""
    if base is None:
        return "no reference"
    if row is base:
        return "reference"
    flags = [f"{key} rel {abs(row[key] - base[key]) / abs(base[key]):.1e}"
             for key, bound in (("first_loss", 1e-2), ("first_grad_norm", 3e-2))
             if not abs(row[key] - base[key]) <= bound * abs(base[key])]
    return "FLAG: " + ", ".join(flags) if flags else "ok"


def table(results: list[dict]) -> str:
    base = next((r for r in results if r["impl"] == "trl" and r.get("status") == "ok"), None)
    lines = ["| trainer | impl | tokens/s | x TRL | median step ms | peak GiB | first loss | first grad norm "
             "| leantune head calls | agreement |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if r.get("status") != "ok":
            lines.append(f"| {r.get('trainer', '')} | {r['impl']} | {r.get('status')}: {r.get('error', '')[:80]} "
                         "| | | | | | | |")
            continue
        x = r["tokens_per_s"] / base["tokens_per_s"] if base else math.nan
        peak = "—" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}"
        median_ms = 1e3 * statistics.median(r["step_s"])
        lines.append(f"| {r['trainer']} | {r['impl']} | {r['tokens_per_s']:,.0f} | {x:.2f} | {median_ms:.0f} | "
                     f"{peak} | {r['first_loss']:.4f} | {r['first_grad_norm']:.4g} | {r['loss_head_calls']} | "
                     f"{agreement(r, base)} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="model folder with config.json and a tokenizer")
    p.add_argument("--trainer", choices=("sft", "dpo"), default="sft")
    p.add_argument("--impls", default=",".join(IMPLS))
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", type=int, default=None, help="override num_hidden_layers")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--out", required=True, help="folder for one JSON per implementation and table.md")
    p.add_argument("--impl", default=None, help=argparse.SUPPRESS)  # the child's implementation
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.impl is not None:
        result = child(args)
        (out / f"{args.trainer}-{args.impl.replace('+', '-')}.json").write_text(json.dumps(result, indent=1))
        return 0
    impls = args.impls.split(",")
    unknown = [impl for impl in impls if impl not in IMPLS]
    if unknown:
        p.error(f"unknown implementation(s) {', '.join(unknown)}; expected some of {', '.join(IMPLS)}")
    results = []
    for impl in impls:
        log = out / f"{args.trainer}-{impl.replace('+', '-')}.log"
        with open(log, "w") as f:
            code = subprocess.call([sys.executable, __file__, *(argv if argv is not None else sys.argv[1:]),
                                    "--impl", impl], stdout=f, stderr=subprocess.STDOUT, env=os.environ.copy())
        path = out / f"{args.trainer}-{impl.replace('+', '-')}.json"
        results.append(json.loads(path.read_text()) if code == 0 and path.exists() else
                       {"impl": impl, "trainer": args.trainer, "status": f"exit {code}",
                        "error": log.read_text()[-300:].replace("\n", " ")})
    text = table(results)
    (out / f"{args.trainer}-table.md").write_text(text + "\n")
    print(text)
    return 0 if any(r.get("status") == "ok" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
