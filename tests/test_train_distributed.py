"""`leantune train` under torchrun (gloo, 2 CPU processes) with DDP and FSDP2 against one plain process.

One launch serves the module (distributed_train_worker.py): per engine a whole run, a run stopped after step 2 by a
SIGTERM that only rank 0 receives, and its ``--resume``; then a run in which rank 1 fails. The reference is the same
global batch in this process: --batch-size 2 x --grad-accum 2 against 2 ranks x --batch-size 2 x --grad-accum 1.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from reference import assert_close
from safetensors.torch import load_file
from test_train import write_chat_jsonl, write_tiny_model

from leantune import distributed
from leantune.errors import LeantuneError
from leantune.train.config import make_config
from leantune.train.loop import train

HERE = Path(__file__).parent
ENGINES = ["ddp", "fsdp"]
LAUNCH_TIMEOUT = 600  # seconds; the launch takes ~20 s on 2 idle cores


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("distributed-train")
    model, data = write_tiny_model(root / "model"), write_chat_jsonl(root / "chat.jsonl")
    out = root / "out"
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("LEANTUNE_BACKEND", "WORLD_SIZE", "RANK")}
    env["OMP_NUM_THREADS"] = "1"
    _stored_model(model, root / "stored")  # before the launch: the ranks read it
    _broken_copy(root / "stored", root / "stored-broken")
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(HERE / "distributed_train_worker.py"), str(model), str(data), str(out)],
                          env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]

    sys.path.insert(0, str(HERE))
    from distributed_train_worker import settings  # the same settings, one process, the whole global batch

    reference = train(settings(str(model), str(data), str(out / "reference"), "auto", grad_accum=2), progress=False)
    train(settings(str(model), str(data), str(out / "reference-nf4"), "auto", grad_accum=2, quantize="nf4"),
          progress=False)
    stored = _stored_model(model, root / "stored")
    train(settings(str(stored), str(data), str(out / "reference-stored"), "auto", grad_accum=2), progress=False)
    return {"out": out, "ranks": ranks, "proc": proc, "seconds": time.monotonic() - start,
            "reference": reference}


def _stored_model(config_json: Path, folder: Path) -> Path:
    """The tiny model with stored weights (safetensors) and its tokenizer, drawn once (seeded)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if not (folder / "model.safetensors").exists():
        torch.manual_seed(7)
        AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_json.parent)).save_pretrained(folder)
        for path in config_json.parent.iterdir():
            if path.name != "config.json":
                (folder / path.name).write_bytes(path.read_bytes())
    return folder


def _broken_copy(folder: Path, broken: Path) -> None:
    """``folder`` with one tensor missing from its weights (rank 0's load fails)."""
    from safetensors.torch import save_file

    broken.mkdir()
    for path in folder.iterdir():
        (broken / path.name).write_bytes(path.read_bytes())
    weights = load_file(str(folder / "model.safetensors"))
    weights.pop(sorted(weights)[0])
    save_file(weights, str(broken / "model.safetensors"), metadata={"format": "pt"})


def records(folder: Path, kind: str) -> list[dict]:
    lines = (folder / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["type"] == kind]


def adapter(folder: Path) -> dict:
    return load_file(str(folder / "adapter" / "adapter_model.safetensors"))


def _same_run(folder: Path, ref: Path) -> None:
    """The distributed run in ``folder`` made the one-process run ``ref``: every step's loss, grad norm and tokens,
    every eval loss (1e-5), the final adapter (fp32 tolerance)."""
    ours, theirs = records(folder, "train"), records(ref, "train")
    assert [r["step"] for r in ours] == [r["step"] for r in theirs] == [1, 2, 3, 4]  # rank 0 alone wrote them
    for a, b in zip(ours, theirs):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"]), (a, b)
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5 * abs(b["grad_norm"]), (a, b)
        assert a["tokens"] == b["tokens"]  # the global step's tokens
    for a, b in zip(records(folder, "eval"), records(ref, "eval")):
        assert abs(a["eval_loss"] - b["eval_loss"]) <= 1e-5 * abs(b["eval_loss"])
    ref_weights, weights = adapter(ref), adapter(folder)
    assert weights.keys() == ref_weights.keys() and weights
    for name in ref_weights:
        assert_close(name, weights[name], ref_weights[name], torch.float32)


@pytest.mark.parametrize("engine", ENGINES)
def test_two_ranks_train_as_one_process_with_the_whole_batch(runs, engine):
    _same_run(runs["out"] / f"{engine}-whole", runs["out"] / "reference")
    summary = runs["ranks"][0][f"{engine}-whole"]["summary"]
    assert (summary["world_size"], summary["engine"], summary["global_batch"]) == (2, engine, 4)


@pytest.mark.parametrize("engine", ENGINES)
def test_stored_weights_read_by_rank_0_alone_train_as_one_process(runs, engine):
    """A stored model under several processes: rank 0 reads the weights, rank 1 builds on the meta device and gets
    them through the engine (DDP's broadcast, FSDP2's set_model_state_dict); the one-process run's losses and
    adapter."""
    assert [rank[f"{engine}-stored"]["loaded_on"] for rank in runs["ranks"]] == ["cpu", "meta"]
    _same_run(runs["out"] / f"{engine}-stored", runs["out"] / "reference-stored")


def test_a_stored_model_rank_0_cannot_load_stops_every_rank_with_its_message(runs):
    messages = [rank["broken"] for rank in runs["ranks"]]
    assert messages[0] == messages[1] and messages[0].startswith("cannot load model "), messages
    assert "the checkpoint lacks" in messages[0]


@pytest.mark.parametrize("engine", ENGINES)
def test_qlora_on_two_ranks_trains_as_one_process(runs, engine):
    """--quantize nf4 under DDP and FSDP2: the one-process QLoRA run's losses and adapter."""
    assert not runs["ranks"][0][f"{engine}-nf4"]["interrupted"]
    _same_run(runs["out"] / f"{engine}-nf4", runs["out"] / "reference-nf4")


@pytest.mark.parametrize("engine", ENGINES)
def test_a_signal_to_one_rank_stops_every_rank_and_resume_equals_the_whole_run(runs, engine):
    for rank in runs["ranks"]:  # rank 1 got no signal: it stopped because rank 0 did, after the same step
        assert rank[f"{engine}-stopped"] == {"interrupted": True, "signal": signal.SIGTERM, "steps": 2}
        assert rank[f"{engine}-resumed"]["interrupted"] is False
    resumed, whole = runs["out"] / f"{engine}-resumed", runs["out"] / f"{engine}-whole"
    assert [r["step"] for r in records(resumed, "train")] == [1, 2, 3, 4]
    for name, ref in adapter(whole).items():
        assert_close(name, adapter(resumed)[name], ref, torch.float32)


@pytest.mark.parametrize("engine", ENGINES)
def test_the_adapter_of_a_distributed_run_is_a_plain_peft_folder(runs, engine):
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = runs["out"] / f"{engine}-whole"
    base = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(runs["out"].parent / "model"))
    model = PeftModel.from_pretrained(base, folder / "adapter")
    loaded = {k.replace(".default", ""): v for k, v in model.state_dict().items() if "lora_" in k}
    for name, tensor in adapter(folder).items():
        assert torch.equal(loaded[name], tensor), name


def test_offloaded_checkpoints_and_tiled_mlp_under_fsdp2_train_as_plain_fsdp2(runs):
    for rank in runs["ranks"]:
        case = rank["fsdp-offload-tiled"]
        assert not case["interrupted"] and case["packed"] > 0  # the layer inputs went to the host
    ours, ref = adapter(runs["out"] / "fsdp-offload-tiled"), adapter(runs["out"] / "fsdp-whole")
    for name in ref:
        assert_close(name, ours[name], ref[name], torch.float32)


def test_a_failing_rank_ends_every_rank_with_its_message(runs):
    proc = runs["proc"]
    assert proc.returncode != 0
    # printed by the failing rank before it unwinds (distributed.report_failure), whatever ends the processes after
    assert "leantune: error (rank 1): RuntimeError: injected failure on rank 1 at step 2" in proc.stderr, \
        proc.stderr[-3000:]
    assert all(rank["fault"] == "started" for rank in runs["ranks"])  # no rank went on after the failure
    assert runs["seconds"] < LAUNCH_TIMEOUT


def test_sigterm_to_the_launcher_stops_every_rank_with_a_checkpoint(runs):
    """SIGTERM to torchrun (a scheduler's preemption): it forwards the signal, every rank finishes its step, the
    checkpoint is saved once, and each rank exits 143."""
    out = runs["out"]
    folder = out / "launcher-stop"
    env = {k: v for k, v in os.environ.items() if k not in ("LEANTUNE_BACKEND", "WORLD_SIZE", "RANK")}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                             str(HERE / "distributed_train_worker.py"), str(out.parent / "model" / "config.json"),
                             str(out.parent / "chat.jsonl"), str(out), "--launcher-stop"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            metrics = folder / "metrics.jsonl"
            if metrics.exists() and metrics.read_text().count('"type": "train"') >= 2:
                break
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=90)
    finally:
        proc.kill()
    ranks = [json.loads((out / f"launcher-rank{r}.json").read_text()) for r in range(2)]
    assert all(r["interrupted"] and r["signal"] == signal.SIGTERM for r in ranks), (ranks, err[-3000:])
    steps = {r["steps"] for r in ranks}
    assert len(steps) == 1 and 2 <= steps.pop() < 200  # every rank stopped after the same step
    saved = sorted((folder / "checkpoints").glob("step-*"))
    assert [p.name for p in saved] == [f"step-{ranks[0]['steps']:06d}"]


def test_launch_errors_are_one_line_before_anything_loads(monkeypatch):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert distributed.check_launch("auto", "cpu") is None  # no launcher: one plain process, as always
    with pytest.raises(LeantuneError, match="--distributed fsdp needs a launcher"):
        distributed.check_launch("fsdp", "cpu")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "x")
    with pytest.raises(LeantuneError, match="LOCAL_RANK='x'"):
        distributed.check_launch("ddp", "cpu")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert distributed.check_launch("ddp", "cpu") == distributed.World(rank=1, size=2, local_rank=1)
    if not torch.cuda.is_available():
        with pytest.raises(LeantuneError, match="NCCL, which needs CUDA"):
            distributed.check_launch("ddp", "cuda")
    monkeypatch.setenv("RANK", "2")
    with pytest.raises(LeantuneError, match="do not fit together"):
        distributed.check_launch("ddp", "cpu")
    with pytest.raises(LeantuneError, match="--distributed must be one of"):
        distributed.check_launch("zero3", "cpu")


def test_resuming_with_another_world_size_is_refused(runs):
    folder = runs["out"] / "ddp-whole"
    config = make_config(flag_values=dict(model=str(runs["out"].parent / "model" / "config.json"),
                                          data=str(runs["out"].parent / "chat.jsonl"), output=str(folder),
                                          seq_len=64, batch_size=2, grad_accum=1, max_steps=4, lr=3e-3,
                                          warmup_steps=1, eval_every=2, eval_size=4, save_every=0, seed=0, lora_r=4,
                                          device="cpu", resume=True))
    with pytest.raises(LeantuneError, match="this run has 1 process"):
        train(config, progress=False)


def test_report_failure_prints_the_cause_on_a_rank_of_several_only(capsys):
    from leantune import distributed

    distributed.report_failure(distributed.World(rank=1, size=2), ValueError("bad shard\nsecond line"))
    distributed.report_failure(distributed.World(rank=0, size=1), ValueError("one process: the CLI reports it"))
    distributed.report_failure(distributed.World(rank=0, size=2), KeyboardInterrupt())
    assert capsys.readouterr().err == "leantune: error (rank 1): ValueError: bad shard\n"
