"""A patched PEFT model under FSDP2 and DDP (gloo, 2 CPU processes), as a library user runs it.

One torchrun launch per engine serves every case of this module (distributed_library_worker.py): the ranks' share
of a batch with very unequal target counts gives the loss and LoRA gradients of one plain process on the whole batch
(both backends); accelerate's FSDP2 preparation (FSDP launch) and HF Trainer (DDP launch) train a patched model with
the unpatched one's losses and gradient norms.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
ENGINES = ["fsdp", "ddp"]


def launch(worker: str, args: list[str], out: Path, nproc: int = 2, timeout: int = 600) -> list[dict]:
    """Run ``worker`` under torchrun with ``nproc`` gloo ranks; returns each rank's JSON."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", "1")}
    env.pop("LEANTUNE_BACKEND", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           str(HERE / worker), *args, str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    results = []
    for rank in range(nproc):
        path = out / f"rank{rank}.json"
        assert path.exists(), f"rank {rank} wrote nothing; torchrun exit {proc.returncode}:\n{proc.stderr[-4000:]}"
        results.append(json.loads(path.read_text()))
        assert "error" not in results[-1], results[-1]["error"]
    assert proc.returncode == 0, proc.stderr[-4000:]
    return results


@pytest.fixture(scope="module", params=ENGINES)
def ranks(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"library-{request.param}")
    return request.param, launch("distributed_library_worker.py", [request.param], out)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_ranks_match_one_process_with_unequal_targets(ranks, backend):
    engine, results = ranks
    targets = [r[f"direct_{backend}"]["local_targets"] for r in results]
    assert min(targets) < 10 < max(targets), targets  # one rank holds a handful of targets, the other dozens
    for r in results:
        case = r[f"direct_{backend}"]
        assert case["missing_grads"] == []
        assert case["dtensor"] == (engine == "fsdp")
        assert abs(case["loss"] - case["ref_loss"]) <= 1e-5 * abs(case["ref_loss"]), case
        worst = max(case["grad_errors"].values())
        assert worst <= 1e-5, (engine, backend, worst)


def test_fsdp_gathers_lm_head_once_per_forward_and_each_layer_once(ranks):
    """The fused loss reads the whole lm_head inside the root's forward: one all-gather of the root's parameters per
    micro-batch forward (not one per loss chunk), one per decoder layer."""
    engine, results = ranks
    for r in results:
        gathers = r["direct_torch"]["gathers"]
        if engine == "ddp":
            assert gathers == []
            continue
        with_lm_head = [names for names in gathers if any("lm_head" in n for n in names)]
        assert len(with_lm_head) == 1, gathers
        assert len(gathers) == 2 + 1  # two decoder layers and the root


def test_accelerate_and_trainer_train_patched_model_with_unpatched_losses(ranks):
    engine, results = ranks
    main = results[0]
    patched, unpatched = main["patched"], main["unpatched"]
    assert patched["dtensor"] == (engine == "fsdp")  # accelerate really sharded it (FSDP2 keeps DTensor params)
    assert patched["wrapper"] == ("FSDPPeftModel" if engine == "fsdp" else "DistributedDataParallel")
    assert len(patched["losses"]) == len(unpatched["losses"]) == 3
    for ours, theirs in zip(patched["losses"], unpatched["losses"]):
        assert abs(ours - theirs) <= 1e-5 * abs(theirs)
    for ours, theirs in zip(patched["grad_norms"], unpatched["grad_norms"]):
        assert abs(ours - theirs) <= 1e-5 * abs(theirs)
