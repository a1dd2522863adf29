"""`leantune train --distributed fsdp` in one process (torchrun --nproc_per_node 1), in this process: a gloo group
of one rank over a FileStore, the torchrun variables set.

One process has nothing to shard, so FSDP2 keeps the root's group alone (``distributed.shards_layers``): the run is
the plain run's (losses, gradient norms, adapter), its step reads nothing back from leantune's code (the host
collectives stay off the device), and AdamW runs fused on the DTensor parameters.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from reference import assert_close
from safetensors.torch import load_file
from test_no_sync import SyncCalls
from test_train import tiny_config, write_chat_jsonl, write_tiny_model

from leantune import distributed
from leantune.train import loop


@pytest.fixture
def one_rank(tmp_path, monkeypatch):
    """A process group of one gloo rank in this process, torchrun's variables set; destroyed afterwards."""
    for name, value in (("WORLD_SIZE", "1"), ("RANK", "0"), ("LOCAL_RANK", "0")):
        monkeypatch.setenv(name, value)
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture
def tiny(tmp_path):
    return {"model": write_tiny_model(tmp_path / "model"), "data": write_chat_jsonl(tmp_path / "chat.jsonl", n=40)}


def _records(folder, kind):
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["type"] == kind]


def _settings(tiny, output, **extra):
    return tiny_config(tiny, output, patch="on", gradient_checkpointing="on", save_every=0, max_steps=4, **extra)


def test_one_process_fsdp2_trains_as_the_plain_run_with_the_roots_group_only(tiny, tmp_path, monkeypatch):
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    loop.train(_settings(tiny, tmp_path / "plain"), progress=False)
    for name, value in (("WORLD_SIZE", "1"), ("RANK", "0"), ("LOCAL_RANK", "0")):
        monkeypatch.setenv(name, value)
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        fsdp = loop.train(_settings(tiny, tmp_path / "fsdp", distributed="fsdp"), progress=False)
        assert dist.is_initialized()  # the caller's group is left to the caller
    finally:
        dist.destroy_process_group()
    assert fsdp.summary["engine"] == "fsdp" and fsdp.summary["world_size"] == 1
    model = fsdp.model
    layers = distributed.decoder_layers(model)
    assert isinstance(model, FSDPModule) and not any(isinstance(layer, FSDPModule) for layer in layers)
    lora = [p for p in model.parameters() if p.requires_grad]
    assert lora and all(isinstance(p, DTensor) for p in lora)  # FSDP2 did shard (one rank: whole shards)
    ours, ref = _records(tmp_path / "fsdp", "train"), _records(tmp_path / "plain", "train")
    assert [r["step"] for r in ours] == [r["step"] for r in ref] == [1, 2, 3, 4]
    for a, b in zip(ours, ref):
        # fused AdamW against the plain CPU run's per-tensor loop: the same update up to fp32 rounding
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"]), (a, b)
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5 * abs(b["grad_norm"]), (a, b)
        assert a["tokens"] == b["tokens"]
    assert ours[0]["loss"] == ref[0]["loss"]  # before any update: the same forward, bit for bit
    theirs = load_file(str(tmp_path / "plain" / "adapter" / "adapter_model.safetensors"))
    mine = load_file(str(tmp_path / "fsdp" / "adapter" / "adapter_model.safetensors"))
    assert mine.keys() == theirs.keys() and mine
    for name in theirs:
        assert_close(name, mine[name], theirs[name], torch.float32)


def test_several_processes_keep_a_group_per_layer():
    world = distributed.World(rank=0, size=2, engine="fsdp")
    assert distributed.shards_layers(torch.nn.Linear(2, 2), world, "cpu")
    assert not distributed.shards_layers(torch.nn.Linear(2, 2), distributed.World(size=1, engine="fsdp"), "cpu")


def test_one_process_fsdp2_step_reads_nothing_back(tiny, tmp_path, one_rank, monkeypatch):
    """The distributed step of ``leantune train`` (its rows and counts, two micro-batches, clipping, fused AdamW on
    DTensors, the loss summed over ranks, the step record, the stop flag): no read back from leantune's code."""
    from tqdm.auto import tqdm

    from leantune.train import step_log
    from leantune.train.metrics import MetricsLog

    run = loop._prepare(_settings(tiny, tmp_path / "out", distributed="fsdp", grad_accum=2))
    assert run.world.engine == "fsdp" and run.optimizer.defaults["fused"]
    run.metrics = MetricsLog(tmp_path / "metrics.jsonl")  # the second record writes the first (LOG_LAG)
    run.metrics.reset()
    log = step_log.StepLog(run, tqdm(disable=True))
    params = [p for p in run.model.parameters() if p.requires_grad]
    watch = SyncCalls(monkeypatch)
    for step in range(2):
        with watch:
            micro, step_targets, tokens = loop.step_batches(run, step)
            timer = log.start()
            loss, grad_norm, lr = loop.train_step(run, micro, params, step_targets)
            log.record(step + 1, timer, loss, grad_norm, lr, tokens)
            stop = distributed.any_rank(False, run.world, run.device)
        assert watch.calls == [], (step, watch.calls)
        assert stop is False and torch.is_tensor(loss) and loss.dtype == torch.float64
        assert step_targets == sum(b.num_targets() for b in micro) > 0  # one rank: the global count is its own
        assert tokens == sum(b.input_ids.numel() for b in micro)
    log.flush()
    first = run.metrics.read()[0]
    assert first["step"] == 1 and first["tokens"] == tokens and first["loss"] > 0
