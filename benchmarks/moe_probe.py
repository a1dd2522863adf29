"""Grouped expert GEMMs on the card: leantune's Triton grouped_mm / grouped_outer vs torch._grouped_mm vs a per-expert
loop, at the Qwen3-30B-A3B expert shape (H 2048, I 768 per expert, E 128, top-8, 4096 tokens, bf16, LoRA r16).

    PYTHONPATH=src python benchmarks/moe_probe.py            # the table (< 2 min on one H200)
    PYTHONPATH=src python benchmarks/moe_probe.py --sweep    # also times a few tile configs of grouped_mm

Each product is timed with CUDA events around single calls, median of 50 after warm-up. Routing is a random top-8
per token (rows sorted by expert, offsets by cumsum of a bincount on the device). The per-expert loop reads the
counts on the host once, outside its timing (it is favoured: the real loop also pays that sync per layer). Agreement:
each result against an fp32 per-expert reference (TF32 off); leantune must be no worse than the bf16 per-expert
loop + 1e-2 (docs/design.md, "Tests and tolerance"). Also checks that both launchers make no host sync
(``torch.cuda.set_sync_debug_mode("error")``).
"""

from __future__ import annotations

import argparse
import statistics

import torch

from leantune.ops import moe_kernels

H, I, E, TOP_K, TOKENS, RANK, SCALE = 2048, 768, 128, 8, 4096, 16, 2.0  # noqa: E741 (the field's I)
BF16 = torch.bfloat16
REPS = 50


def timed_ms(fn, reps: int = REPS) -> float:
    """Median of ``reps`` single calls, each between two CUDA events, after 3 warm-up calls."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def routing(device):
    """Sorted rows of a random top-8 routing: (offsets int32 [E], host spans [(start, end)] for the loop)."""
    experts = torch.rand(TOKENS, E, device=device).topk(TOP_K, dim=-1).indices.reshape(-1)
    counts = torch.bincount(torch.sort(experts).values, minlength=E)
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)
    ends = offsets.tolist()  # host copy for the loop baseline only (outside any timing)
    return offsets, list(zip([0] + ends[:-1], ends))


def loop_mm(a, b, spans, out_dtype=None, lowrank=None):
    """The per-expert loop: c[rows_e] = a[rows_e] @ b[e] (+ scale t[rows_e] @ cf[e]), one GEMM pair per expert."""
    out = torch.zeros(a.shape[0], b.shape[2], dtype=out_dtype or a.dtype, device=a.device)
    for e, (s, t) in enumerate(spans):
        if t > s:
            part = a[s:t] @ b[e]
            if lowrank is not None:
                part = part + lowrank[2] * (lowrank[0][s:t] @ lowrank[1][e])
            out[s:t] = part
    return out


def loop_outer(a, b, spans, out_dtype=torch.float32):
    out = torch.zeros(len(spans), a.shape[1], b.shape[1], dtype=out_dtype, device=a.device)
    for e, (s, t) in enumerate(spans):
        if t > s:
            out[e] = a[s:t].T @ b[s:t]
    return out


def f32(t):
    return t.float() if isinstance(t, torch.Tensor) else t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="also time a few grouped_mm tile configs")
    args = parser.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = False
    offsets, spans = routing(dev)
    m = TOKENS * TOP_K
    x = torch.randn(m, H, device=dev, dtype=BF16)
    w_gu = (torch.randn(E, 2 * I, H, device=dev) * H**-0.5).to(BF16)
    w_d = (torch.randn(E, H, I, device=dev) * I**-0.5).to(BF16)
    h = torch.randn(m, I, device=dev, dtype=BF16)
    d_gu = torch.randn(m, 2 * I, device=dev, dtype=BF16)
    d_y = torch.randn(m, H, device=dev, dtype=BF16)
    xa = torch.randn(m, RANK, device=dev)  # x A_e^T, fp32 (PEFT's fp32 adapters)
    g = torch.randn(m, RANK, device=dev)  # s dY B_e
    b_gu_t = torch.randn(E, RANK, 2 * I, device=dev) * 0.02  # B_e^T of gate_up's LoRA, fp32

    def tgm(a, b, **kw):
        return torch._grouped_mm(a, b, offs=offsets, **kw)

    def plain(a, b):
        """A frozen product c[rows_e] = a[rows_e] @ b[e] in the five forms a case row holds."""
        return (2 * a.shape[0] * a.shape[1] * b.shape[2], lambda: moe_kernels.grouped_mm(a, b, offsets),
                lambda: tgm(a, b), lambda: loop_mm(a, b, spans), lambda: loop_mm(a.float(), b.float(), spans))

    def outer(a, b):
        """c[e] = a[rows_e]^T @ b[rows_e]; the loop runs in fp32 (the adapters' dtype) and is the reference."""
        return (2 * a.shape[0] * a.shape[1] * b.shape[1], lambda: moe_kernels.grouped_outer(a, b, offsets),
                lambda: tgm(a.to(BF16).T, b.to(BF16)), lambda: loop_outer(a.float(), b.float(), spans),
                lambda: loop_outer(a.float(), b.float(), spans))

    lowrank = (xa, b_gu_t, SCALE)
    # name: (flops, leantune, torch._grouped_mm, per-expert loop (the eager bar), fp32 per-expert reference)
    cases = {
        "gate_up fwd  x W^T": plain(x, w_gu.transpose(1, 2)),
        "gate_up fwd + LoRA": (
            2 * m * (H + RANK) * 2 * I,
            lambda: moe_kernels.grouped_mm(x, w_gu.transpose(1, 2), offsets, lowrank=lowrank),
            lambda: tgm(x, w_gu.transpose(1, 2)) + SCALE * tgm(xa.to(BF16), b_gu_t.to(BF16)),
            lambda: loop_mm(x, w_gu.transpose(1, 2), spans, lowrank=lowrank),
            lambda: loop_mm(x.float(), w_gu.float().transpose(1, 2), spans, lowrank=lowrank),
        ),
        "down fwd     h W^T": plain(h, w_d.transpose(1, 2)),
        "down dX      dY W": plain(d_y, w_d),
        "gate_up dX   dGU W": plain(d_gu, w_gu),
        "LoRA dB_gu   dGU^T xa": outer(d_gu, xa),
        "LoRA dA_gu   g^T x": outer(g, x),
    }

    def launches():
        moe_kernels.grouped_mm(x, w_gu.transpose(1, 2), offsets, lowrank=lowrank)
        moe_kernels.grouped_outer(d_gu, xa, offsets)

    launches()  # compiled outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any host sync inside either launcher raises
    try:
        launches()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    print("no host sync in grouped_mm / grouped_outer: ok")

    print(f"Qwen3-30B-A3B experts: {TOKENS} tokens x top-{TOP_K} = {m} rows, E {E}, H {H}, I {I}, r {RANK}; "
          f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"{'product':24} {'leantune ms':>11} {'TFLOP/s':>8} {'_grouped_mm':>11} {'loop ms':>8} "
          f"{'_gmm/lt':>7} {'err lt':>8} {'err _gmm':>8} {'err loop':>8}")
    failures = []
    for name, (flops, ours, theirs, loop, ref_fn) in cases.items():
        ref = ref_fn()
        out = ours()
        err_ours = rel_err(out, ref)
        err_loop = rel_err(loop(), ref)
        try:
            err_torch = rel_err(theirs(), ref)
            ms_torch = timed_ms(theirs)
        except Exception as exc:  # noqa: BLE001 (torch._grouped_mm refusing a layout or dtype: reported, not fatal)
            err_torch, ms_torch = float("nan"), float("nan")
            print(f"  torch._grouped_mm n/a for {name}: {str(exc).splitlines()[0][:90]}")
        ms_ours, ms_loop = timed_ms(ours), timed_ms(loop)
        bar = max(err_loop, err_torch if err_torch == err_torch else 0.0) + 1e-2
        if not err_ours <= bar:
            failures.append(f"{name}: leantune error {err_ours:.3g} > bar {bar:.3g}")
        print(f"{name:24} {ms_ours:11.3f} {flops / ms_ours / 1e9:8.0f} {ms_torch:11.3f} {ms_loop:8.2f} "
              f"{ms_torch / ms_ours:7.2f} {err_ours:8.1e} {err_torch:8.1e} {err_loop:8.1e}")
        del ref, out

    if args.sweep:
        sweep(x, w_gu, d_y, w_d, offsets)
    assert not failures, "; ".join(failures)
    print("agreement within bf16 bounds: ok")


def sweep(x, w_gu, d_y, w_d, offsets) -> None:
    """grouped_mm at a few fixed tile configs (mm_config replaced for the call): informs the default choice."""
    configs = [moe_kernels.MMConfig(*c) for c in [(64, 128, 64, 4, 4), (64, 128, 64, 4, 3), (128, 128, 64, 8, 3),
                                                  (128, 128, 64, 4, 4), (64, 256, 64, 8, 3), (128, 256, 64, 8, 3),
                                                  (64, 64, 64, 4, 4)]]
    default = moe_kernels.mm_config
    print(f"\n{'config (bm, bn, bk, warps, stages)':36} {'gate_up fwd':>11} {'down dX':>8}")
    try:
        for cfg in configs:
            moe_kernels.mm_config = lambda *a, cfg=cfg: cfg
            fwd = timed_ms(lambda: moe_kernels.grouped_mm(x, w_gu.transpose(1, 2), offsets), reps=20)
            dx = timed_ms(lambda: moe_kernels.grouped_mm(d_y, w_d, offsets), reps=20)
            print(f"{str(tuple(cfg)):36} {fwd:11.3f} {dx:8.3f}")
    finally:
        moe_kernels.mm_config = default


if __name__ == "__main__":
    main()
