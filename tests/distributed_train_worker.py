"""One rank of tests/test_train_distributed.py, started once by torchrun (gloo, 2 CPU processes) for the whole module.

Usage: torchrun --standalone --nproc_per_node 2 distributed_train_worker.py MODEL DATA OUT [--launcher-stop]
For each engine (DDP, FSDP2) it runs ``leantune.train.train`` three times: a whole run, a run stopped after step 2 by
a SIGTERM that only rank 0 receives, and the ``--resume`` of that run. Then rank 1 fails at step 2 of a last run
(an injected error): both processes must exit non-zero, rank 1 with its message. Each finished case is recorded in
OUT/rank{r}.json as it ends, so the test sees how far every rank got.
"""

import json
import os
import signal
import sys
import time

import torch
import torch.distributed

from leantune.errors import LeantuneError
from leantune.train import config as train_config
from leantune.train.loop import train

STEPS = 4


def settings(model: str, data: str, output: str, engine: str, **extra) -> train_config.TrainConfig:
    values = dict(model=model, data=data, output=output, seq_len=64, batch_size=2, grad_accum=1, max_steps=STEPS,
                  lr=3e-3, warmup_steps=1, eval_every=2, eval_size=4, save_every=0, seed=0, lora_r=4,
                  distributed=engine, device="cpu")
    values.update(extra)
    return train_config.make_config(flag_values=values)


def stopped_by_the_launcher(model: str, data: str, out: str, rank: int) -> None:
    """A slow run that the test ends with SIGTERM to torchrun itself (which forwards it to every rank)."""
    result = train(settings(model, data, os.path.join(out, "launcher-stop"), "ddp", max_steps=200),
                   progress=False, on_step=lambda step: time.sleep(0.2))
    with open(os.path.join(out, f"launcher-rank{rank}.json"), "w") as f:
        json.dump({"interrupted": result.interrupted, "signal": result.stop_signal,
                   "steps": result.summary["steps"]}, f)
    sys.exit(128 + result.stop_signal if result.interrupted else 0)


def main() -> None:
    model, data, out = sys.argv[1:4]
    rank = int(os.environ["RANK"])
    if sys.argv[4:] == ["--launcher-stop"]:
        torch.set_num_threads(1)
        return stopped_by_the_launcher(model, data, out, rank)
    # one process group for all runs (a gloo group cannot be rebuilt in the same processes); train() reuses it
    torch.distributed.init_process_group("gloo")
    torch.set_num_threads(1)
    record = {}

    def save():
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(record, f)

    for engine in ("ddp", "fsdp"):
        result = train(settings(model, data, os.path.join(out, f"{engine}-whole"), engine), progress=False)
        record[f"{engine}-whole"] = {"interrupted": result.interrupted, "summary": result.summary}
        save()

        def signal_rank0(step):
            if step == 2 and rank == 0:
                os.kill(os.getpid(), signal.SIGTERM)

        folder = os.path.join(out, f"{engine}-resumed")
        stopped = train(settings(model, data, folder, engine), progress=False, on_step=signal_rank0)
        record[f"{engine}-stopped"] = {"interrupted": stopped.interrupted, "signal": stopped.stop_signal,
                                       "steps": stopped.summary["steps"]}
        save()
        resumed = train(settings(model, data, folder, engine, resume=True), progress=False)
        record[f"{engine}-resumed"] = {"interrupted": resumed.interrupted, "summary": resumed.summary}
        save()

    # long-context options under FSDP2: offloaded checkpoints (every layer input, whatever its size) and the tiled
    # MLP give the weights of the plain FSDP2 run
    import functools

    from leantune.patch import offload

    patch_package = sys.modules["leantune.patch"]
    patch_package.enable_offloaded_checkpoints = functools.partial(offload.enable_offloaded_checkpoints, min_bytes=0)
    result = train(settings(model, data, os.path.join(out, "fsdp-offload-tiled"), "fsdp",
                            gradient_checkpointing="on", offload_checkpoints=True, tile_mlp=16), progress=False)
    record["fsdp-offload-tiled"] = {"interrupted": result.interrupted,
                                    "packed": offload.offloader_of(result.model).packed}
    save()

    # QLoRA (NF4 frozen weights, replicated: FSDP2 shards the parameters, the NF4 codes are buffers) on both engines
    for engine in ("ddp", "fsdp"):
        result = train(settings(model, data, os.path.join(out, f"{engine}-nf4"), engine, quantize="nf4"),
                       progress=False)
        record[f"{engine}-nf4"] = {"interrupted": result.interrupted}
        save()

    # stored weights: rank 0 reads them, rank 1 builds on the meta device and receives them through the engine
    from leantune.train import loop

    stored = os.path.join(os.path.dirname(os.path.dirname(model)), "stored")
    where = []
    load_model = loop.load_model
    loop.load_model = lambda kind, path, dtype, device, seed: where.append(device) or load_model(
        kind, path, dtype, device, seed)
    for engine in ("ddp", "fsdp"):
        result = train(settings(stored, data, os.path.join(out, f"{engine}-stored"), engine), progress=False)
        record[f"{engine}-stored"] = {"interrupted": result.interrupted, "loaded_on": where[-1]}
        save()
    loop.load_model = load_model
    # a stored model rank 0 cannot load: every rank gets rank 0's error (none waits for weights that never come)
    try:
        train(settings(stored + "-broken", data, os.path.join(out, "broken"), "fsdp"), progress=False)
        record["broken"] = "trained"
    except LeantuneError as exc:
        record["broken"] = str(exc)
    save()

    def fail_rank1(step):
        if step == 2 and rank == 1:
            raise RuntimeError("injected failure on rank 1 at step 2")

    record["fault"] = "started"
    save()
    train(settings(model, data, os.path.join(out, "fault"), "ddp"), progress=False, on_step=fail_rank1)
    record["fault"] = "survived"  # must not be reached: the failing rank ends the run on every rank
    save()


if __name__ == "__main__":
    main()
