"""Patched vs unpatched loss and every LoRA gradient on a random-init model (GPU, bf16), judged against fp32.

Builds the model of ``--config`` (random init, bf16) on the GPU, wraps it in PEFT LoRA r=16 on all 7 projections with
non-zero B (``init_lora_weights=False``, fp32 adapters as PEFT's default), and runs one forward+backward on random
tokens: unpatched, then ``leantune.patch``-ed. Then the same model in fp32 (TF32 off) gives the reference: the patched
bf16 errors must be no worse than the unpatched bf16 errors plus 1e-2 (docs/design.md, "Numerics").

Usage: PYTHONPATH=src python3 benchmarks/patch_check.py --config .gpu/llama3-8b --seq 2048 --out results.json
"""

import argparse
import json
import time

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM

import leantune

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"  # CPU only for a dry run of this script on a tiny config
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def step(model, ids):
    model.zero_grad(set_to_none=True)
    if CUDA:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if CUDA else 0
    start = time.perf_counter()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    if CUDA:
        torch.cuda.synchronize()
    ms = (time.perf_counter() - start) * 1e3
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30 if CUDA else 0.0
    grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.requires_grad}
    return loss.item(), grads, ms, peak


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(args.config)
    t0 = time.perf_counter()
    with torch.device(DEVICE):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS, lora_dropout=0.0,
                                             init_lora_weights=False))
    print(f"built in {time.perf_counter() - t0:.1f} s", flush=True)
    ids = torch.randint(0, config.vocab_size, (1, args.seq), device=DEVICE)

    step(model, ids)  # warm-up
    loss_u, grads_u, ms_u, peak_u = step(model, ids)
    leantune.patch(model)
    print(model.leantune_summary if hasattr(model, "leantune_summary") else "", flush=True)
    step(model, ids)
    loss_p, grads_p, ms_p, peak_p = step(model, ids)
    leantune.unpatch(model)

    model.float()
    torch.backends.cuda.matmul.allow_tf32 = False
    loss_ref, grads_ref, _, _ = step(model, ids)

    names = sorted(grads_ref)
    err_u = {n: rel(grads_u[n], grads_ref[n]) for n in names}
    err_p = {n: rel(grads_p[n], grads_ref[n]) for n in names}
    err_pu = {n: rel(grads_p[n], grads_u[n]) for n in names}
    worse = [n for n in names if err_p[n] > err_u[n] + 1e-2]
    result = {
        "config": args.config, "seq": args.seq, "lora_tensors": len(names),
        "loss": {"unpatched_bf16": loss_u, "patched_bf16": loss_p, "fp32_reference": loss_ref},
        "grad_rel_err_vs_fp32": {"unpatched_median": float(torch.tensor(list(err_u.values())).median()),
                                 "unpatched_max": max(err_u.values()),
                                 "patched_median": float(torch.tensor(list(err_p.values())).median()),
                                 "patched_max": max(err_p.values())},
        "grad_rel_diff_patched_vs_unpatched": {"median": float(torch.tensor(list(err_pu.values())).median()),
                                               "max": max(err_pu.values())},
        "tensors_failing_rule": worse,
        "step_ms": {"unpatched": ms_u, "patched": ms_p}, "extra_peak_gib": {"unpatched": peak_u, "patched": peak_p},
        "gpu": torch.cuda.get_device_name() if CUDA else "cpu", "torch": torch.__version__,
    }
    text = json.dumps(result, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)
    print("PASS" if not worse and abs(loss_p - loss_ref) <= abs(loss_u - loss_ref) + 1e-2 * abs(loss_ref) else "FAIL")


if __name__ == "__main__":
    main()
