"""benchmarks/peak_breakdown.py's replay of the CUDA allocator trace, on hand-made traces (the script itself needs a
GPU): the peak, what is live at it, and blocks allocated before the recording."""

from __future__ import annotations

import json

import bench_scripts
import pytest

peak_breakdown = bench_scripts.load("peak_breakdown")

MLP = [{"filename": "/x/torch/nn/functional.py", "line": 9, "name": "silu"},
       {"filename": "/repo/src/leantune/ops/glu.py", "line": 40, "name": "forward"}]
LOSS = [{"filename": "/y/site-packages/leantune/ops/linear_cross_entropy.py", "line": 7, "name": "_chunked_forward"}]


def alloc(addr, size, frames):
    return {"action": "alloc", "addr": addr, "size": size, "frames": frames}


def free(addr, size, action="free_requested"):
    return {"action": action, "addr": addr, "size": size, "frames": []}


def test_allocation_site_is_the_innermost_frame_of_ours():
    assert peak_breakdown.allocation_site(MLP) == "leantune/ops/glu.py:40 forward"
    assert peak_breakdown.allocation_site(LOSS) == "leantune/ops/linear_cross_entropy.py:7 _chunked_forward"
    other = [{"filename": "<frozen runpy>", "line": 3, "name": "run"}]
    assert peak_breakdown.allocation_site(other) == "<frozen runpy>:3 run"
    assert peak_breakdown.allocation_site([]) == "(no frame)"
    helper = [{"filename": "/repo/src/leantune/ops/_runtime.py", "line": 75, "name": "_torch_empty"}, *MLP[1:]]
    assert peak_breakdown.allocation_site(helper) == "leantune/ops/glu.py:40 forward", "the helper's caller"


def test_peak_stack_names_the_frames_of_the_peak_allocation():
    deep = [{"filename": "/repo/src/leantune/ops/_runtime.py", "line": 75, "name": "_torch_empty"}, *MLP,
            {"filename": "/repo/src/leantune/ops/lora/api.py", "line": 230, "name": "backward"}]
    events = [alloc(1, 300, LOSS), free(1, 300), alloc(2, 200, deep), alloc(3, 50, LOSS), free(3, 50),
              alloc(4, 120, MLP)]  # 1000 + 300, then 1000 + 200 + 120 = 1320: the last allocation sets the peak
    assert peak_breakdown.peak_stack(events, 1000) == ["leantune/ops/glu.py:40 forward"]
    assert peak_breakdown.peak_stack(events[:4], 1000) == ["leantune/ops/linear_cross_entropy.py:7 _chunked_forward"]
    assert peak_breakdown.peak_stack(events[2:3], 0) == ["leantune/ops/glu.py:40 forward",
                                                        "leantune/ops/lora/api.py:230 backward"]


def test_live_set_at_the_peak():
    """A block leaves the count at free_requested, as allocated bytes do, even while another stream still uses it
    (its free_completed comes later and changes nothing)."""
    events = [
        alloc(1, 300, MLP),
        alloc(2, 200, LOSS),
        alloc(3, 50, MLP),  # peak: 1000 + 300 + 200 + 50
        free(1, 300),  # requested: 1250 from here on
        alloc(4, 250, LOSS),  # 1500: below the peak
        free(1, 300, action="free_completed"),  # offload's record_stream'd block handed back: no change
        alloc(5, 40, MLP),  # 1540: still below
        {"action": "segment_alloc", "addr": 9, "size": 4096, "frames": []},
    ]
    peak, sites = peak_breakdown.live_at_peak(events, 1000)
    assert peak == 1550
    assert sites == {peak_breakdown.BEFORE: 1000, "leantune/ops/glu.py:40 forward": 350,
                     "leantune/ops/linear_cross_entropy.py:7 _chunked_forward": 200}
    assert sum(sites.values()) == peak


def test_a_pending_free_does_not_hold_the_peak_up():
    """Freed (requested) but not yet completed: not allocated, so a later block can set the peak alone."""
    events = [alloc(1, 500, MLP), free(1, 500), alloc(2, 400, LOSS), free(1, 500, action="free_completed"),
              alloc(3, 200, MLP)]
    peak, sites = peak_breakdown.live_at_peak(events, 100)
    assert peak == 700  # 100 + 400 + 200, never 100 + 500 + 400
    assert sites[peak_breakdown.BEFORE] == 100 and sum(sites.values()) == 700


def test_frees_of_blocks_from_before_the_recording():
    """Only free_requested of an unknown block is taken from the earlier row: a free_completed whose request came
    before the recording (a warm-up block still in another stream's use) is not subtracted again."""
    events = [free(77, 400), free(76, 30, action="free_completed"), alloc(1, 100, MLP), free(78, 100),
              alloc(2, 500, LOSS)]
    peak, sites = peak_breakdown.live_at_peak(events, 1000)
    # 1000 - 400 + 100 = 700 -> -100 = 600 -> +500 = 1100: the peak, with 500 of the old blocks left
    assert peak == 1100
    assert sites[peak_breakdown.BEFORE] == 500 and sum(sites.values()) == 1100


def test_no_allocation_above_the_start_is_the_start():
    peak, sites = peak_breakdown.live_at_peak([free(5, 10)], 64)
    assert peak == 64 and sites == {peak_breakdown.BEFORE: 64}


def test_requested_bytes_of_a_snapshot():
    snapshot = {"segments": [
        {"blocks": [{"state": "active_allocated", "size": 1024, "requested_size": 1000},
                    {"state": "active_pending_free", "size": 512, "requested_size": 500},
                    {"state": "inactive", "size": 2048, "requested_size": 0}]},
        {"blocks": [{"state": "active_allocated", "size": 2097152, "requested_size": 1048577}]}]}
    assert peak_breakdown.requested_bytes_allocated(snapshot) == 1000 + 1048577


def test_variants_are_checked(tmp_path, capsys):
    with pytest.raises(SystemExit):
        peak_breakdown.main(["--config", "x", "--variants", "leantune:4096", "--out", str(tmp_path)])
    assert "is not IMPL:TILE:CHUNK_MIB" in capsys.readouterr().err


def test_dry_run_builds_each_variant_with_its_tile_and_chunk(tmp_path, capsys, monkeypatch):
    """The CPU dry run: the bench model built per variant, with the variant's MLP tile and loss chunk in force."""
    import importlib

    from transformers import LlamaConfig

    from leantune.bench import build as bench_build

    lce = importlib.import_module("leantune.ops.linear_cross_entropy")
    monkeypatch.setattr(bench_build, "TILE_TOKENS", bench_build.TILE_TOKENS)  # restored after the test
    monkeypatch.setitem(lce.DEFAULT_CHUNK_BYTES, "fast", lce.DEFAULT_CHUNK_BYTES["fast"])
    folder = tmp_path / "model"
    LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64).save_pretrained(folder)
    out = tmp_path / "out"
    code = peak_breakdown.main(["--config", str(folder), "--seq", "40", "--warmup", "1", "--device", "cpu",
                                "--out", str(out), "--variants", "leantune+offload+tiled:16:1", "leantune:8:2"])
    assert code == 0
    results = json.loads((out / "breakdown.json").read_text())
    assert [(r["variant"], r["tile_tokens"], r["chunk_mib"]) for r in results] == [
        ("leantune+offload+tiled:16:1", [16], 1.0), ("leantune:8:2", [], 2.0)]
    assert all(r["frozen_gib"] > 0 for r in results)
    assert "MLP tiles [16], loss chunk 1 MiB" in capsys.readouterr().out
