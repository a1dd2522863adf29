"""Where a patched LoRA step's host time goes, and whether the whole step (forward, backward, AdamW) captures in
one CUDA graph. One process, one model, checkpointing on then off:

- eager: >= 20 timed steps; per step the host issue time (until the optimizer step returns, before synchronising)
  and the step time (after it); median / p90;
- a torch.profiler pass over 3 warm steps: kernels per step and the GPU-busy fraction (union of kernel intervals
  over the steps' wall time);
- the device-to-host synchronisations of one step (``set_sync_debug_mode("warn")``), each with the innermost
  frames of its stack;
- the whole step captured in a CUDA graph (static input, fused AdamW with ``capturable=True``, warm-up on a side
  stream), then replayed for the same number of steps: its step time and its loss against the eager loss at lr 0.

Usage (device machine, repo root): PYTHONPATH=src python3 benchmarks/graph_probe.py --config .gpu/llama3-8b
"""
import argparse
import json
import statistics
import sys
import time
import traceback
import warnings

import torch


def busy_fraction(prof, wall_s: float, steps: int):
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start)
    busy, end = 0.0, -1.0
    for s, e in spans:
        if s > end:
            busy += e - s
            end = e
        elif e > end:
            busy += e - end
            end = e
    return busy * 1e-6 / wall_s, len(spans) / steps, busy * 1e-3 / steps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=".gpu/llama3-8b")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--impl", default="leantune")
    ap.add_argument("--gc", default="on,off")
    ap.add_argument("--out", default=None)
    ap.add_argument("--capture", default="fwd,fwdbwd,step")
    ap.add_argument("--modes", default="global")
    ap.add_argument("--no-mask", action="store_true", help="attention through a registered sdpa name that has no "
                    "mask function: transformers builds no mask (and runs no packed-sequence check)")
    ap.add_argument("--side-stream", action="store_true", help="everything (build included) on one non-default stream")
    args = ap.parse_args()
    if args.side_stream:  # the legacy default stream never holds work, so no capture can be made to depend on it
        torch.cuda.set_stream(torch.cuda.Stream())

    from leantune.bench.build import build
    from leantune.bench.step import RunSpec

    results = []
    spec = RunSpec(impl=args.impl, config=args.config, seq=args.seq, batch=args.batch, gc=True, layers=args.layers)
    t0 = time.perf_counter()
    model, config = build(spec)
    print(f"built in {time.perf_counter() - t0:.1f} s", flush=True)
    if args.no_mask:
        from transformers import AttentionInterface
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        AttentionInterface.register("leantune_sdpa", sdpa_attention_forward)
        for m in model.modules():
            cfg = getattr(m, "config", None)
            if cfg is not None and getattr(cfg, "_attn_implementation", None) == "sdpa":
                try:
                    cfg._attn_implementation = "leantune_sdpa"
                except Exception:  # noqa: BLE001
                    cfg._attn_implementation_internal = "leantune_sdpa"
        print("attn", model.config._attn_implementation, flush=True)
    g = torch.Generator(device="cuda").manual_seed(2)
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), generator=g, device="cuda")
    params = [p for p in model.parameters() if p.requires_grad]
    for gc_mode in args.gc.split(","):
        if gc_mode == "on":
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_disable()
        row = {"gc": gc_mode, "impl": args.impl}
        opt = torch.optim.AdamW(params, lr=0.0, fused=True, capturable=True)

        def step():
            opt.zero_grad(set_to_none=True)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            return loss

        for _ in range(3):
            step()
        torch.cuda.synchronize()
        issue, wall = [], []
        for _ in range(args.steps):
            t = time.perf_counter()
            loss = step()
            issue.append(time.perf_counter() - t)
            torch.cuda.synchronize()
            wall.append(time.perf_counter() - t)
        eager_loss = float(loss)
        q = statistics.quantiles([1e3 * w for w in wall], n=10)
        row.update(eager_median_ms=1e3 * statistics.median(wall), eager_p90_ms=q[-1], eager_min_ms=1e3 * min(wall),
                   issue_median_ms=1e3 * statistics.median(issue),
                   tokens_per_s=args.batch * args.seq / statistics.median(wall), eager_loss=eager_loss)
        # profiler pass
        from torch.profiler import ProfilerActivity, profile
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t = time.perf_counter()
            for _ in range(3):
                step()
            torch.cuda.synchronize()
            pw = time.perf_counter() - t
        frac, kernels, busy_ms = busy_fraction(prof, pw, 3)
        row.update(busy_fraction=frac, kernels_per_step=kernels, busy_ms_per_step=busy_ms, profiled_step_ms=pw / 3 * 1e3)
        if args.out:
            prof.export_chrome_trace(f"{args.out}/trace_gc{gc_mode}.json")
        # syncs of one step
        syncs = []

        def record(message, category, filename, lineno, file=None, line=None):
            frames = [f"{f.filename.split('site-packages/')[-1].split('src/')[-1]}:{f.lineno} {f.name}"
                      for f in traceback.extract_stack()[:-1] if "warnings" not in f.filename]
            syncs.append(frames[-6:])

        old = warnings.showwarning
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            step()
        torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = old
        torch.cuda.synchronize()
        row["syncs"] = syncs
        # CUDA graph capture: forward only, forward + backward, whole step; each error mode asked for
        for kind in args.capture.split(","):
            for mode in args.modes.split(","):
                key = f"graph_{kind}_{mode}"
                try:
                    s = torch.cuda.Stream()
                    s.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(s):
                        for _ in range(3):
                            step()
                    torch.cuda.current_stream().wait_stream(s)
                    graph = torch.cuda.CUDAGraph()
                    opt.zero_grad(set_to_none=True)
                    with torch.cuda.graph(graph, capture_error_mode=mode):
                        if kind == "fwd":
                            with torch.no_grad():
                                static_loss = model(input_ids=ids, labels=ids).loss
                        elif kind.endswith("grad"):  # autograd.grad: no AccumulateGrad node (leaf streams)
                            static_loss = model(input_ids=ids, labels=ids).loss
                            for p, g_ in zip(params, torch.autograd.grad(static_loss, params)):
                                p.grad = g_
                            if kind == "stepgrad":
                                opt.step()
                        else:
                            static_loss = model(input_ids=ids, labels=ids).loss
                            static_loss.backward()
                            if kind == "step":
                                opt.step()
                    torch.cuda.synchronize()
                    graph.replay()
                    torch.cuda.synchronize()
                    times = []
                    for _ in range(args.steps):
                        t = time.perf_counter()
                        graph.replay()
                        torch.cuda.synchronize()
                        times.append(time.perf_counter() - t)
                    row[key] = {"median_ms": 1e3 * statistics.median(times), "p90_ms":
                                statistics.quantiles([1e3 * w for w in times], n=10)[-1], "loss": float(static_loss)}
                    del graph
                except Exception as exc:  # noqa: BLE001
                    row[key] = {"error": f"{type(exc).__name__}: {str(exc)[:160]}"}
                    print(key, traceback.format_exc()[-1500:], flush=True)
                    try:
                        torch.cuda.synchronize()
                    except Exception:  # noqa: BLE001
                        pass
                print(key, row[key], flush=True)
        results.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "syncs"}), flush=True)
        for frames in syncs:
            print("  sync:", " <- ".join(reversed(frames[-4:])))
        del opt
        torch.cuda.empty_cache()
    if args.out:
        json.dump(results, open(f"{args.out}/graph_probe_{args.impl}.json", "w"), indent=1)
    print("| gc | impl | eager median ms | p90 | issue ms | busy | kernels/step | eager loss | graphs |")
    for r in results:
        graphs = "; ".join(f"{k[6:]}: {v.get('median_ms', v.get('error', ''))}" for k, v in r.items()
                           if k.startswith("graph_"))
        print(f"| {r['gc']} | {r['impl']} | {r['eager_median_ms']:.1f} | {r['eager_p90_ms']:.1f} | "
              f"{r['issue_median_ms']:.1f} | {r['busy_fraction']:.3f} | {r['kernels_per_step']:.0f} | "
              f"{r['eager_loss']:.5f} | {graphs} |")


if __name__ == "__main__":
    sys.exit(main())
