"""What is alive at the peak of a training step: the bytes held at ``max_memory_allocated``, grouped by the line
that allocated them, for a few setups of one model (CUDA).

Each variant builds ``leantune bench``'s model (``bench.build``: same weights, LoRA r16 on all 7 projections, fused
AdamW with its state allocated up front), runs ``--warmup`` steps, then one step under
``torch.cuda.memory._record_memory_history``. The allocator's trace is replayed (``live_at_peak``) to the moment the
allocated bytes were highest (in requested bytes; ``max_memory_allocated`` counts rounded blocks, so the two peaks
differ slightly); what was allocated before the step (weights, adapters, optimizer state) is one row,
every other live block is charged to its first Python frame inside leantune, transformers, peft or torch.optim.
A variant is ``IMPL:TILE:CHUNK_MIB``: a ``bench`` implementation, the tiled MLP's tile in tokens (the ``tiled``
ones), and the fused loss's chunk budget in MiB (``memory="fast"``). On the device machine, from the repo root:

    python3 benchmarks/peak_breakdown.py --config .gpu/llama3-8b --seq 4096 --out $OUT/peak \\
        --variants leantune+offload+tiled:4096:128 leantune+offload+tiled:2048:128 leantune+offload+tiled:2048:32

Prints, per variant, peak minus frozen weights (as ``bench e2e`` reports it), the step time, and the largest rows;
writes ``breakdown.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from collections import defaultdict
from pathlib import Path

GiB = 2**30
MiB = 2**20
BEFORE = "allocated before the step (weights, adapters, optimizer state)"
OURS = ("leantune/", "transformers/", "peft/", "torch/optim/")
HELPERS = ("leantune/ops/_runtime.py",)  # the allocator helper every kernel output comes from: charge its caller
MAX_ENTRIES = 2_000_000  # allocator trace entries kept (one 8B step at 4096 tokens makes tens of thousands)


def _ours(frame) -> bool:
    return any(part in frame["filename"] for part in OURS) and not any(h in frame["filename"] for h in HELPERS)


def allocation_site(frames) -> str:
    """``file:line function`` of the innermost frame inside leantune, transformers, peft or torch.optim (the first
    frame when none is), past leantune's allocator helper; ``frames`` innermost first, as the allocator's trace
    gives them."""
    for frame in frames:
        if _ours(frame):
            name = frame["filename"].split("site-packages/")[-1].split("src/")[-1]
            return f"{name}:{frame['line']} {frame['name']}"
    if frames:
        return f"{frames[0]['filename']}:{frames[0]['line']} {frames[0]['name']}"
    return "(no frame)"


def live_at_peak(events, allocated_before: int) -> tuple[int, dict[str, int]]:
    """(peak bytes, {site: bytes live at the peak}) from one device's allocator trace events.

    ``alloc`` adds a block; ``free_requested`` takes it away, the moment the allocator's allocated-bytes count (what
    ``max_memory_allocated`` follows) drops; ``free_completed`` comes later for a block another stream still used
    (``record_stream``: offload's copies) and is ignored, as are the segment events. Sizes are the trace's, the
    bytes requested (a block's rounded size can be up to ~1 MiB larger when it is not split). ``allocated_before``:
    requested bytes allocated when recording began; a free of a block allocated before then is taken from that
    row."""

    def replay(stop=None):
        live: dict[int, tuple[int, list]] = {}
        before = current = peak = allocated_before
        peak_index = -1
        for i, event in enumerate(events[:stop]):
            if event["action"] == "alloc":
                live[event["addr"]] = (event["size"], event.get("frames", []))
                current += event["size"]
                if current > peak:
                    peak, peak_index = current, i
            elif event["action"] == "free_requested":
                if event["addr"] in live:
                    current -= live.pop(event["addr"])[0]
                else:  # allocated before the recording began
                    before -= event["size"]
                    current -= event["size"]
        return peak, peak_index, before, live

    peak, peak_index, _, _ = replay()
    _, _, before, live = replay(peak_index + 1)  # the state right after the peak's allocation
    sites = defaultdict(int, {BEFORE: before})
    for size, frames in live.values():
        sites[allocation_site(frames)] += size
    return peak, dict(sites)


def peak_stack(events, allocated_before: int, depth: int = 8) -> list[str]:
    """The frames of ours (innermost first, at most ``depth``) of the allocation that set the peak: where in the step
    it happened."""
    current = peak = allocated_before
    sizes, at = {}, []
    for event in events:
        if event["action"] == "alloc":
            sizes[event["addr"]] = event["size"]
            current += event["size"]
            if current > peak:
                peak, at = current, event.get("frames", [])
        elif event["action"] == "free_requested":
            current -= sizes.pop(event["addr"], event["size"])
    return [allocation_site([f]) for f in [f for f in at if _ours(f)][:depth]]


def requested_bytes_allocated(snapshot) -> int:
    """Requested bytes of the blocks a tensor holds in an allocator snapshot (``torch.cuda.memory._snapshot()``)."""
    return sum(block["requested_size"] for segment in snapshot["segments"] for block in segment["blocks"]
               if block["state"] == "active_allocated")


def run_variant(config: str, seq: int, warmup: int, variant: str, device: str = "cuda") -> dict:
    """One variant's breakdown (module docstring); ``device="cpu"`` is a dry run (the same build and steps, no
    memory figures) for the tests."""
    import importlib

    import torch
    import torch.utils.checkpoint as checkpoint_module

    from leantune.bench import build as bench_build
    from leantune.bench.flops import frozen_weight_bytes
    from leantune.bench.step import RunSpec, adamw_with_state
    from leantune.patch.tiled_mlp import TiledForward

    lce = importlib.import_module("leantune.ops.linear_cross_entropy")  # the module, not the op of that name

    impl, tile, chunk_mib = variant.split(":")
    bench_build.TILE_TOKENS = int(tile)
    lce.DEFAULT_CHUNK_BYTES["fast"] = int(chunk_mib) * MiB
    spec = RunSpec(impl=impl, config=config, seq=seq, batch=1, gc=True, device=device)
    model, model_config = bench_build.build(spec, device)
    ids = torch.randint(0, model_config.vocab_size, (1, seq), device=device,
                        generator=torch.Generator(device=device).manual_seed(2))
    optimizer = adamw_with_state([p for p in model.parameters() if p.requires_grad], 1e-4, fused=device == "cuda")

    def step():
        optimizer.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()

    for _ in range(warmup):
        step()
    optimizer.zero_grad(set_to_none=True)
    tiles = sorted({m.forward.tile_tokens for m in model.modules() if isinstance(m.forward, TiledForward)})
    result = {"variant": variant, "seq": seq, "tile_tokens": tiles,
              "chunk_mib": lce.DEFAULT_CHUNK_BYTES["fast"] / MiB, "frozen_gib": frozen_weight_bytes(model) / GiB}
    if device != "cuda":
        step()
        return result
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    device_index = torch.cuda.current_device()
    torch.cuda.memory._record_memory_history(max_entries=MAX_ENTRIES, stacks="python")  # C++ frames: slow, unused
    start = torch.cuda.memory._snapshot()
    allocated_before = requested_bytes_allocated(start)
    skip = len(start["device_traces"][device_index])  # an earlier variant's entries, if torch kept them
    t = time.perf_counter()
    # Recording Python stacks loses checkpoint's early-stop signal inside autograd.Function.apply in torch 2.11
    # ("returned NULL without setting an exception", pytorch/pytorch#179536): recompute whole layers for this step.
    with checkpoint_module.set_checkpoint_early_stop(False):
        step()
    torch.cuda.synchronize()
    step_ms = 1e3 * (time.perf_counter() - t)
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    events = snapshot["device_traces"][device_index]
    if len(events) >= MAX_ENTRIES:  # the oldest entries were dropped: the replay would start mid-step
        raise RuntimeError(f"the allocator trace filled its {MAX_ENTRIES} entries; raise MAX_ENTRIES")
    peak, sites = live_at_peak(events[skip:], allocated_before)
    where = peak_stack(events[skip:], allocated_before)
    max_allocated = torch.cuda.max_memory_allocated()
    result.update({
        "step_ms_recorded": step_ms, "peak_gib": max_allocated / GiB, "replayed_peak_gib": peak / GiB,  # requested
        "peak_minus_frozen_gib": max_allocated / GiB - result["frozen_gib"],
        "peak_stack": where,
        "sites_mib": {k: v / MiB for k, v in sorted(sites.items(), key=lambda kv: -kv[1])},
    })
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--variants", nargs="+", required=True, help="IMPL:TILE:CHUNK_MIB ...")
    parser.add_argument("--top", type=int, default=12, help="rows printed per variant")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda", help="cpu: a dry run of the builds and steps (tests)")
    args = parser.parse_args(argv)
    import torch

    for variant in args.variants:
        if variant.count(":") != 2:
            parser.error(f"--variants: {variant!r} is not IMPL:TILE:CHUNK_MIB")
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for variant in args.variants:
        results.append(run_variant(args.config, args.seq, args.warmup, variant, args.device))
        gc.collect()  # the variant's model (and its pinned host pool) goes with its frame
        if args.device == "cuda":
            torch.cuda.empty_cache()
        (args.out / "breakdown.json").write_text(json.dumps(results, indent=1))
    for r in results:
        if "sites_mib" not in r:
            print(f"{r['variant']}: dry run on {args.device}, MLP tiles {r['tile_tokens']}, "
                  f"loss chunk {r['chunk_mib']:g} MiB")
            continue
        print(f"\n### {r['variant']}: peak - frozen {r['peak_minus_frozen_gib']:.3f} GiB (peak {r['peak_gib']:.2f}, "
              f"replayed {r['replayed_peak_gib']:.2f}), recorded step {r['step_ms_recorded']:.0f} ms")
        print("peak allocated in: " + " < ".join(r["peak_stack"]))
        print("| MiB at the peak | allocated at |\n|---|---|")
        for site, mib in list(r["sites_mib"].items())[: args.top]:
            print(f"| {mib:,.1f} | {site} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
