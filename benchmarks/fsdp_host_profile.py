"""Host time of `leantune train`'s steps, plain or under torchrun (FSDP2 / DDP), through the real training loop.

Usage (CPU, gloo; the shapes are small so that the Python on the host dominates):
  PYTHONPATH=src python benchmarks/fsdp_host_profile.py OUT [--layers 8] [--hidden 256] [--seq 64] [--steps 12]
  PYTHONPATH=src torchrun --standalone --nproc_per_node 1 benchmarks/fsdp_host_profile.py OUT --distributed fsdp
It writes a tiny Llama config.json and a byte-level tokenizer in OUT/model, runs ``leantune.train.train`` with
gradient checkpointing on (as benchmarks/gpu_checks.sh fsdp1 does), times each optimizer step on the host
(time.perf_counter between ``on_step`` calls) and profiles the steps after ``--warm`` with cProfile. Prints the
median step ms and the top functions by cumulative and own time; writes OUT/profile-{engine}.pstats.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import time
from pathlib import Path

import torch


def write_model(folder: Path, layers: int, hidden: int) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                            chat_template=template).save_pretrained(folder)
    LlamaConfig(vocab_size=259 + 3, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                num_attention_heads=max(1, hidden // 64), num_key_value_heads=max(1, hidden // 128),
                max_position_embeddings=4096, tie_word_embeddings=True).save_pretrained(folder)
    return folder / "config.json"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warm", type=int, default=2)
    parser.add_argument("--distributed", default="auto")
    parser.add_argument("--gc", default="on")
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--no-profile", action="store_true", help="time the steps only (cProfile slows Python ~2x)")
    args = parser.parse_args()
    from leantune.train.config import make_config
    from leantune.train.loop import train

    torch.set_num_threads(1)
    out = Path(args.out)
    rank = int(os.environ.get("RANK", "0"))
    model = write_model(out / "model", args.layers, args.hidden) if rank == 0 else out / "model" / "config.json"
    engine = args.distributed if "WORLD_SIZE" in os.environ else "plain"
    config = make_config(flag_values=dict(
        model=str(model), output=str(out / f"run-{engine}"), seq_len=args.seq, batch_size=1, max_steps=args.steps,
        eval_every=0, eval_size=4, save_every=0, max_examples=200, gradient_checkpointing=args.gc,
        distributed=args.distributed, device="cpu", overwrite=True))
    marks, cpu_marks, profiler = [], [], cProfile.Profile()

    def on_step(step: int) -> None:
        marks.append(time.perf_counter())
        cpu_marks.append(time.thread_time())  # this thread's CPU time: less disturbed by a busy machine
        if step == args.warm and not args.no_profile:
            profiler.enable()
        if step == args.steps:
            profiler.disable()

    train(config, progress=False, on_step=on_step)
    if rank != 0:
        return
    steps_ms = [1e3 * (b - a) for a, b in zip(marks, marks[1:])][args.warm - 1:]
    cpu_ms = [1e3 * (b - a) for a, b in zip(cpu_marks, cpu_marks[1:])][args.warm - 1:]
    profiled = 0 if args.no_profile else args.steps - args.warm
    summary = {"engine": engine, "median_step_ms": statistics.median(steps_ms), "min_step_ms": min(steps_ms),
               "median_cpu_ms": statistics.median(cpu_ms), "min_cpu_ms": min(cpu_ms),
               "p10_step_ms": sorted(steps_ms)[len(steps_ms) // 10],
               "steps_ms": [round(t, 2) for t in steps_ms], "profiled_steps": profiled, "layers": args.layers,
               "hidden": args.hidden, "seq": args.seq}
    if args.no_profile:
        print(json.dumps(summary))
        return
    stream = io.StringIO()
    stats = pstats.Stats(profiler, stream=stream)
    stats.dump_stats(str(out / f"profile-{engine}.pstats"))
    stats.sort_stats("cumulative").print_stats(args.top)
    stats.sort_stats("tottime").print_stats(args.top)
    print(json.dumps(summary))
    print(stream.getvalue())


if __name__ == "__main__":
    main()
