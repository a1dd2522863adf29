"""The checkpoint recomputation's skipped down projection (``ops.lora_mlp(output=False)``, patch/recompute.py), timed
on the CPU: SmolLM2-135M (the embedded model) in fp32 with LoRA r16 on all linears, patched, non-reentrant gradient
checkpointing, one forward + backward of ``--rows`` x ``--seq`` tokens. "skip" is the patched model as it runs;
"full" is the same with the recomputation's detection switched off (the down projection formed again). Sides
alternate over ``--rounds`` rounds of ``--steps`` timed steps each (after one untimed step); prints the median and p90
step seconds per side and whether the loss and the first LoRA gradients are bit for bit equal.

    LEANTUNE_BACKEND=torch PYTHONPATH=src python benchmarks/recompute_skip_cpu.py
"""

from __future__ import annotations

import argparse
import statistics
import time

import peft
import torch
from transformers import AutoModelForCausalLM

import leantune
from leantune import assets
from leantune.patch import blocks


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=8, help="timed steps per side and round")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(assets.smollm2_path(), dtype=torch.float32)
    model = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=32, target_modules="all-linear",
                                                       init_lora_weights=False))
    leantune.patch(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    model.train()
    ids = torch.randint(0, model.config.vocab_size, (args.rows, args.seq))
    detect = blocks.in_checkpoint_recompute

    def step():
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters() if p.requires_grad][:3]

    times, outs = {"skip": [], "full": []}, {}
    for _ in range(args.rounds):
        for side, fn in (("skip", detect), ("full", lambda: False)):
            blocks.in_checkpoint_recompute = fn
            step()
            for _ in range(args.steps):
                t0 = time.perf_counter()
                outs[side] = step()
                times[side].append(time.perf_counter() - t0)
    blocks.in_checkpoint_recompute = detect
    for side, ts in times.items():
        ts = sorted(ts)
        print(f"{side}: {len(ts)} steps, median {statistics.median(ts):.3f} s, p90 {ts[int(0.9 * (len(ts) - 1))]:.3f} s")
    same = torch.equal(outs["skip"][0], outs["full"][0]) and all(
        torch.equal(a, b) for a, b in zip(outs["skip"][1], outs["full"][1]))
    print(f"median skip / full: {statistics.median(times['skip']) / statistics.median(times['full']):.3f}; "
          f"loss and gradients bit for bit equal: {same}")


if __name__ == "__main__":
    main()
