"""One rank of tests/test_distributed_library.py, started by torchrun (gloo, CPU): a patched PEFT model under FSDP2 or
DDP, driven directly, through accelerate's FSDP2 preparation, and through HF Trainer (DDP), against the same model
unpatched or in one plain process.

accelerate turns FSDP on only for GPU process groups, so on CPU its FSDP2 path is driven through its own
``fsdp2_prepare_model`` (what ``Accelerator.prepare`` calls for ``fsdp_version: 2``) with a plain loop; HF Trainer
runs the DDP launch.

Usage: torchrun --nproc_per_node 2 distributed_library_worker.py ENGINE OUT_DIR   (ENGINE: fsdp | ddp)
Each rank writes OUT_DIR/rank{r}.json; a failure is written there too, so the test reports it instead of hanging.
"""

import json
import os
import sys
import traceback

import torch
import torch.distributed as dist

ROWS, SEQ, VOCAB = 4, 24, 256


def build(patched: bool):
    import peft
    import transformers

    import leantune

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    model = peft.get_peft_model(model, lora)
    if patched:
        leantune.patch(model)
    return model


def batch():
    """Rows with very unequal target counts: rank 0's share has 1 + 3 targets, rank 1's dozens."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
    labels = ids.clone()
    labels[0, :] = -100
    labels[0, 7] = ids[0, 7]
    labels[1, :-3] = -100
    return ids, labels


def lora_grads(model) -> dict:
    out = {}
    for name, p in model.named_parameters():
        if p.requires_grad and p.grad is not None:
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            out[name] = g.detach().double()
    return out


def direct(engine: str, backend: str, rank: int, world: int) -> dict:
    """Loss and LoRA gradients of the global batch: one plain process vs ``world`` ranks (global token count
    all-reduced, loss scaled by the world size as the engines average)."""
    from leantune import distributed

    os.environ["LEANTUNE_BACKEND"] = backend
    ids, labels = batch()
    reference = build(patched=True)
    count = (labels[:, 1:] != -100).sum()
    ref_loss = reference(input_ids=ids, labels=labels, num_items_in_batch=count).loss
    ref_loss.backward()
    ref_grads = lora_grads(reference)

    model = build(patched=True)
    w = distributed.World(rank=rank, size=world, engine=engine)
    wrapped = distributed.wrap(model, w, "cpu")
    share = slice(rank * ROWS // world, (rank + 1) * ROWS // world)
    local = int((labels[share, 1:] != -100).sum())
    total = int(distributed.all_reduce_sum([local], w, "cpu")[0])
    loss = wrapped(input_ids=ids[share], labels=labels[share], num_items_in_batch=torch.tensor(total)).loss
    (loss * distributed.loss_scale(w)).backward()
    global_loss = distributed.all_reduce_sum([loss.item()], w, "cpu")[0]
    grads = lora_grads(model)
    errors = {name: ((grads[name] - ref).norm() / ref.norm()).item() for name, ref in ref_grads.items()}
    dtensor = any(type(p).__name__ == "DTensor" for p in model.parameters())
    gathers = count_all_gathers(lambda: wrapped(input_ids=ids[share], labels=labels[share],
                                                num_items_in_batch=torch.tensor(total)))
    return {"loss": global_loss, "ref_loss": ref_loss.item(), "local_targets": local, "grad_errors": errors,
            "missing_grads": sorted(set(ref_grads) - set(grads)), "dtensor": dtensor, "gathers": gathers}


def count_all_gathers(forward) -> list[list[str]]:
    """The parameter names of every FSDP2 all-gather during ``forward()`` (empty under DDP)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as groups

    calls, real = [], groups.foreach_all_gather

    def counting(fsdp_params, *args, **kwargs):
        calls.append([str(p._param_fqn) for p in fsdp_params])
        return real(fsdp_params, *args, **kwargs)

    groups.foreach_all_gather = counting
    try:
        forward()
    finally:
        groups.foreach_all_gather = real
    return calls


def trainer(patched: bool) -> dict:
    """Three steps of HF Trainer under DDP, batch 2 x accumulation 2 per rank."""
    from transformers import Trainer, TrainingArguments

    model = build(patched)
    g = torch.Generator().manual_seed(2)
    rows = []
    for _ in range(16):
        ids = torch.randint(0, VOCAB, (SEQ,), generator=g)
        rows.append({"input_ids": ids, "labels": ids.clone()})
    options = dict(output_dir=os.path.join(sys.argv[2], "trainer"), per_device_train_batch_size=2,
                   gradient_accumulation_steps=2, max_steps=3, learning_rate=1e-3, logging_steps=1, report_to=[],
                   use_cpu=True, save_strategy="no", seed=0, data_seed=0, dataloader_drop_last=True)
    run = Trainer(model=model, args=TrainingArguments(**options), train_dataset=rows)
    run.train()
    sharded = any(type(p).__name__ == "DTensor" for p in run.model_wrapped.parameters())
    wrapper = type(run.model_wrapped).__name__
    losses = [h["loss"] for h in run.state.log_history if "loss" in h]
    norms = [h["grad_norm"] for h in run.state.log_history if "grad_norm" in h]
    return {"losses": losses, "grad_norms": norms, "dtensor": sharded, "wrapper": wrapper}


def accelerate_fsdp2(accelerator, patched: bool) -> dict:
    """Three AdamW steps of a model prepared by accelerate's FSDP2 code (transformer-based wrap of the decoder
    layers, reshard after forward), each rank on its own rows."""
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model

    accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap", reshard_after_forward=True,
        transformer_cls_names_to_wrap=["LlamaDecoderLayer"])
    model = fsdp2_prepare_model(accelerator, build(patched))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    g = torch.Generator().manual_seed(3 + dist.get_rank())
    losses, norms = [], []
    for _ in range(3):
        ids = torch.randint(0, VOCAB, (2, SEQ), generator=g)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1e9)
        norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    sharded = sum(type(p).__name__ == "DTensor" for p in model.parameters())
    return {"losses": losses, "grad_norms": norms, "dtensor": sharded > 0, "wrapper": type(model).__name__}


def main() -> None:
    engine, out = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    result = {}
    try:
        for backend in ("torch", "triton"):
            result[f"direct_{backend}"] = direct(engine, backend, rank, world)
        os.environ["LEANTUNE_BACKEND"] = "torch"
        if engine == "fsdp":
            from accelerate import Accelerator

            accelerator = Accelerator(cpu=True)
            result["unpatched"] = accelerate_fsdp2(accelerator, patched=False)
            result["patched"] = accelerate_fsdp2(accelerator, patched=True)
        else:
            result["unpatched"] = trainer(patched=False)
            result["patched"] = trainer(patched=True)
    except Exception:  # noqa: BLE001 - reported to the test, which fails with it
        result["error"] = traceback.format_exc()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    if "error" in result:
        os._exit(1)  # a peer may be waiting in a collective: end now, torchrun ends the rest
    dist.barrier()
    dist.destroy_process_group()
    # results are written: skip the interpreter's teardown, where one DDP run in a fresh-clone CI (2026-12-07) had
    # a rank abort in a C++ destructor ("terminate called without an active exception", SIGABRT) after its work
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
