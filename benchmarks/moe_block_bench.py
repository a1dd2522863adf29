"""MoE training step on the card: HF+PEFT (transformers' experts implementation, PEFT ``target_parameters`` LoRA on
the expert stacks) vs the same model under ``leantune.patch`` (``ops.moe_experts``), at the Qwen3-30B-A3B layer
shape (H 2048, 32/4 heads of 128, E 128 experts of I 768, top-8, LoRA r16 on attention and experts, bf16,
4096 x 1 tokens, router aux loss on), ``--layers`` decoder layers (default 2) and a small vocabulary.

    PYTHONPATH=src python benchmarks/moe_block_bench.py                 # one H200, < 3 min
    PYTHONPATH=src python benchmarks/moe_block_bench.py --tiny          # CPU dry run of the script itself

Per side: median step time (forward + backward) over 10 steps after 3 warm-up steps, peak memory above the model,
the first loss and the LoRA gradient norm (they must agree: bf16, so within ~1e-2 relative), and, for leantune, the
number of device-to-host syncs in a step (``torch.cuda.set_sync_debug_mode("warn")``: each sync warns once per call
site; HF's own router and aux loss included). HF's experts implementation: ``--experts grouped_mm`` (transformers'
default on the card) or ``eager`` (its per-expert loop with ``nonzero``).
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM

import leantune


def build(args, device):
    shape = dict(hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                 num_experts_per_tok=8, moe_intermediate_size=768, intermediate_size=6144)
    if args.tiny:
        shape = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
                     num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=96)
    config = AutoConfig.for_model("qwen3_moe", num_hidden_layers=args.layers, vocab_size=4096,
                                  output_router_logits=True, router_aux_loss_coef=0.001, **shape)
    config._attn_implementation = "sdpa"
    config._experts_implementation = args.experts
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(device, torch.bfloat16)
    lora = LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                      target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
                      init_lora_weights=False)
    return get_peft_model(model, lora).train()


def step(model, input_ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=input_ids, labels=input_ids).loss
    loss.backward()
    return loss


def measure(model, input_ids, device, reps):
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    loss = step(model, input_ids)
    grads = [p.grad.float().norm() for p in model.parameters() if p.requires_grad and p.grad is not None]
    first = (loss.item(), torch.stack(grads).norm().item())
    for _ in range(2):
        step(model, input_ids)
    sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        step(model, input_ids)
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30 if device.type == "cuda" else 0.0
    return statistics.median(times), peak, first


def count_syncs(model, input_ids):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step(model, input_ids)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return [str(w.message).splitlines()[0] for w in seen if "synchroniz" in str(w.message)]


def first_sync_site(model, input_ids):
    """Where the first synchronising call of a step is made (its Python frames), or None."""
    import traceback

    torch.cuda.set_sync_debug_mode("error")
    try:
        step(model, input_ids)
    except RuntimeError as error:
        frames = [f for f in traceback.extract_tb(error.__traceback__) if "torch/" not in f.filename]
        return "\n".join(f"{f.filename}:{f.lineno} {f.line}" for f in frames[-4:])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return None


def top_kernels(side, model, input_ids, device, n=15):
    """One step under torch.profiler: the kernels by total device time (where the step's GPU time goes)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        step(model, input_ids)
        if device.type == "cuda":
            torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    events.sort(key=lambda e: -e.device_time_total)
    total = sum(e.device_time_total for e in events) / 1e3
    print(f"== {side}: {total:.1f} ms of kernels in one step")
    for e in events[:n]:
        print(f"   {e.device_time_total / 1e3:7.2f} ms  x{e.count:<5} {e.key[:100]}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--experts", default="grouped_mm", choices=["grouped_mm", "eager", "batched_mm"])
    parser.add_argument("--profile", action="store_true", help="also print each side's top kernels (one step)")
    args = parser.parse_args()
    device = torch.device("cpu" if args.tiny else "cuda")
    tokens = 64 if args.tiny else args.tokens
    reps = 2 if args.tiny else 10
    model = build(args, device)
    input_ids = torch.randint(0, 4096, (1, tokens), device=device)
    hf_ms, hf_peak, hf_first = measure(model, input_ids, device, reps)
    if args.profile:
        top_kernels("HF+PEFT " + args.experts, model, input_ids, device)
    leantune.patch(model)
    print("leantune_summary counts:", model.leantune_summary["counts"])
    lt_ms, lt_peak, lt_first = measure(model, input_ids, device, reps)
    if args.profile:
        top_kernels("leantune", model, input_ids, device)
    print(f"{'side':<22}{'step ms':>10}{'tokens/s':>12}{'peak GiB':>10}{'loss':>10}{'grad norm':>12}")
    for name, ms, peak, (loss, norm) in (("HF+PEFT " + args.experts, hf_ms, hf_peak, hf_first),
                                         ("leantune", lt_ms, lt_peak, lt_first)):
        print(f"{name:<22}{ms:>10.1f}{tokens / ms * 1e3:>12.0f}{peak:>10.2f}{loss:>10.4f}{norm:>12.4f}")
    print(f"speedup {hf_ms / lt_ms:.2f}x; loss rel {abs(lt_first[0] - hf_first[0]) / abs(hf_first[0]):.2e}, "
          f"grad norm rel {abs(lt_first[1] - hf_first[1]) / hf_first[1]:.2e}")
    if device.type == "cuda":
        syncs = count_syncs(model, input_ids)
        print(f"syncs in a leantune step (any source): {len(syncs)}")
        if syncs:
            print("first one at:", first_sync_site(model, input_ids), sep="\n")


if __name__ == "__main__":
    main()
