"""Profile one LoRA training step (fwd+bwd) of a Llama-shaped model, unpatched vs leantune.patch, on the GPU.

Prints step time, host time, and the CUDA kernels that dominate each. Usage:
PYTHONPATH=src python3 benchmarks/profile_step.py --config .gpu/llama3-8b --layers 4 --seq 4096 [--batch 2] [--gc]
"""
import argparse
import time

import torch
from peft import LoraConfig, get_peft_model
from torch.profiler import ProfilerActivity, profile
from transformers import AutoConfig, AutoModelForCausalLM

import leantune

parser = argparse.ArgumentParser()
parser.add_argument("--config", required=True)
parser.add_argument("--layers", type=int, default=4)
parser.add_argument("--seq", type=int, default=4096)
parser.add_argument("--batch", type=int, default=1)
parser.add_argument("--gc", action="store_true")
args = parser.parse_args()
config = AutoConfig.from_pretrained(args.config)
config.num_hidden_layers = args.layers
with torch.device("cuda"):
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, init_lora_weights=False, lora_dropout=0.0,
                                         target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                         "up_proj", "down_proj"]))
if args.gc:
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), device="cuda")


def step():
    model.zero_grad(set_to_none=True)
    model(input_ids=ids, labels=ids).loss.backward()


for name in ("unpatched", "patched"):
    if name == "patched":
        leantune.patch(model)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) / 5 * 1e3
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        step()
        torch.cuda.synchronize()
    events = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)
    gpu = sum(e.device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA) / 1e3
    print(f"== {name}: step {ms:.1f} ms wall, GPU kernels {gpu:.1f} ms ({args.layers} layers, {args.seq} x {args.batch})")
    for e in events[:22]:
        if e.device_time_total > 0 and e.device_type == torch.autograd.DeviceType.CUDA:
            print(f"   {e.device_time_total / 1e3:7.2f} ms  x{e.count:<4} {e.key[:90]}")
