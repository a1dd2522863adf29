"""Issue 3, fast mode: where a token chunk's time goes, and whether a Triton dW kernel beats cuBLAS's addmm_.

At Liger's peak the fast mode runs 32 chunks of 512 tokens (N16384 H4096 V128256 bf16). Per chunk: logits = h W^T,
the cross-entropy kernel (gradient in place), dh = G W, dW += G^T h. The last is a cuBLAS GEMM with beta = 1 whose
epilogue reads and writes the whole 0.98 GiB dW (NOTES.md, "Issue 3 fast mode"). This script

1. times each step of one chunk, and dW with beta = 0 (``torch.mm(out=)``) beside beta = 1 (``addmm_``): the
   difference is what the read-modify-write costs;
2. times ``dw_accumulate`` (below) over a small config grid against ``addmm_``; its C tile is loaded before the K
   loop (PREFETCH=1) so that the read overlaps the main loop, or after it (PREFETCH=0, what an epilogue does).

Usage: GPU  ``PYTHONPATH=src python3 benchmarks/lce_dw.py``;
       CPU  ``TRITON_INTERPRET=1 .venv/bin/python benchmarks/lce_dw.py --check`` (the kernel against float64 on tiny
       shapes that are not multiples of the tiles).
"""
import argparse
import itertools

import torch
import triton
import triton.language as tl


@triton.jit
def dw_accumulate(G, X, C, n_rows, n_vocab, n_hidden, stride_g, stride_x, stride_c,
                  BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_V: tl.constexpr,
                  PREFETCH: tl.constexpr, UPCAST: tl.constexpr):
    """C[V, H] += G[K, V]^T @ X[K, H] with fp32 accumulation and one rounding to C's dtype (cuBLAS beta = 1)."""
    pid = tl.program_id(0)
    tiles_v = tl.cdiv(n_vocab, BLOCK_V)
    tiles_h = tl.cdiv(n_hidden, BLOCK_H)
    group = GROUP_V * tiles_h  # grouped order: consecutive programs share X tiles and nearby G columns in L2
    first_v = (pid // group) * GROUP_V
    size_v = min(tiles_v - first_v, GROUP_V)
    pid_v = first_v + (pid % group) % size_v
    pid_h = (pid % group) // size_v
    offs_v = pid_v.to(tl.int64) * BLOCK_V + tl.arange(0, BLOCK_V)
    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_c = (offs_v < n_vocab)[:, None] & (offs_h < n_hidden)[None, :]
    c_ptrs = C + offs_v[:, None] * stride_c + offs_h[None, :]
    if PREFETCH:
        c = tl.load(c_ptrs, mask=mask_c, other=0.0)
    acc = tl.zeros([BLOCK_V, BLOCK_H], dtype=tl.float32)
    for k0 in range(0, n_rows, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        g = tl.load(G + ks[:, None] * stride_g + offs_v[None, :],
                    mask=(ks < n_rows)[:, None] & (offs_v < n_vocab)[None, :], other=0.0)
        x = tl.load(X + ks[:, None] * stride_x + offs_h[None, :],
                    mask=(ks < n_rows)[:, None] & (offs_h < n_hidden)[None, :], other=0.0)
        if UPCAST:  # the interpreter multiplies 16-bit floats as raw bits in tl.dot
            g, x = g.to(tl.float32), x.to(tl.float32)
        acc = tl.dot(tl.trans(g), x, acc)
    if not PREFETCH:
        c = tl.load(c_ptrs, mask=mask_c, other=0.0)
    tl.store(c_ptrs, (acc + c.to(tl.float32)).to(C.dtype.element_ty), mask=mask_c)


def launch(g, x, c, block_v, block_h, block_k, group_v, prefetch, num_warps, num_stages):
    n_rows, n_vocab = g.shape
    grid = (triton.cdiv(n_vocab, block_v) * triton.cdiv(x.shape[1], block_h),)
    dw_accumulate[grid](g, x, c, n_rows, n_vocab, x.shape[1], g.stride(0), x.stride(0), c.stride(0),
                        BLOCK_V=block_v, BLOCK_H=block_h, BLOCK_K=block_k, GROUP_V=group_v, PREFETCH=prefetch,
                        UPCAST=g.device.type == "cpu", num_warps=num_warps, num_stages=num_stages)


def check():
    torch.manual_seed(0)
    for (k, v, h), prefetch in itertools.product([(37, 45, 50), (16, 16, 16), (70, 130, 33)], (0, 1)):
        g = torch.randn(k, v, dtype=torch.bfloat16)
        x = torch.randn(k, h, dtype=torch.bfloat16)
        c = torch.randn(v, h, dtype=torch.bfloat16)
        ref = c.double() + g.double().T @ x.double()
        out = c.clone()
        launch(g, x, out, 16, 16, 16, 2, prefetch, 4, 2)
        err = (out.double() - ref).norm() / ref.norm()
        assert err < 8e-3, (k, v, h, prefetch, err)  # one bf16 rounding of the sum
        print(f"K{k} V{v} H{h} prefetch={prefetch}: rel err {err:.2e}")
    print("ok")


def bench():
    from triton.testing import do_bench

    from leantune.ops.cross_entropy import check_options, loss_rows

    n_tok, n_hidden, n_vocab = 512, 4096, 128256
    dev, dt = "cuda", torch.bfloat16
    h = torch.randn(n_tok, n_hidden, device=dev, dtype=dt)
    w = torch.randn(n_vocab, n_hidden, device=dev, dtype=dt) * 0.02
    labels = torch.randint(0, n_vocab, (n_tok,), device=dev)
    buf = torch.empty(n_tok, n_vocab, device=dev, dtype=dt)
    dh = torch.empty(n_tok, n_hidden, device=dev, dtype=dt)
    dw = torch.zeros(n_vocab, n_hidden, device=dev, dtype=dt)
    loss = torch.empty(n_tok, device=dev)
    lse = torch.empty(n_tok, device=dev)
    opts, _ = check_options(labels, n_vocab, -100, 0.0, None, 0.0, "mean", None)
    scale = torch.tensor(1.0 / (32 * n_tok), device=dev)
    torch.mm(h, w.t(), out=buf)
    rows = [
        ("logits = h W^T", lambda: torch.mm(h, w.t(), out=buf)),
        ("cross-entropy kernel, grad in place", lambda: loss_rows("triton", buf, labels, opts, loss, lse, buf, scale)),
        ("dh = G W", lambda: torch.mm(buf, w, out=dh)),
        ("dW = G^T h (beta 0)", lambda: torch.mm(buf.t(), h, out=dw)),
        ("dW += G^T h (addmm_, beta 1)", lambda: dw.addmm_(buf.t(), h)),
    ]
    print(f"one chunk of {n_tok} tokens, H{n_hidden} V{n_vocab} bf16 (x32 chunks = N16384):")
    total = 0.0
    for name, fn in rows:
        ms = do_bench(fn, warmup=50, rep=300, return_mode="median")
        total += ms if "beta 0" not in name else 0.0
        print(f"  {name:<40} {ms:7.3f} ms   x32 = {32 * ms:6.1f} ms")
    print(f"  sum of the four steps of the fast mode x32 = {32 * total:.1f} ms")
    addmm = do_bench(lambda: dw.addmm_(buf.t(), h), warmup=50, rep=300, return_mode="median")
    results = []
    for bv, bh, bk, gv, pf, nw, ns in itertools.product((128, 256), (128, 256), (64,), (8,), (0, 1), (4, 8), (3, 4)):
        if bv * bh > 128 * 256 or (nw == 4 and bv * bh > 128 * 128):
            continue
        try:
            config = (bv, bh, bk, gv, pf, nw, ns)
            ms = do_bench(lambda config=config: launch(buf, h, dw, *config), warmup=25, rep=200,
                          return_mode="median")
        except Exception as exc:  # out of shared memory / registers for this config
            print(f"  BV{bv} BH{bh} BK{bk} prefetch={pf} warps={nw} stages={ns}: {type(exc).__name__}")
            continue
        results.append((ms, bv, bh, bk, pf, nw, ns))
    results.sort()
    print(f"dW += G^T h: addmm_ {addmm:.3f} ms; Triton dw_accumulate, best first:")
    for ms, bv, bh, bk, pf, nw, ns in results[:10]:
        print(f"  {ms:7.3f} ms ({addmm / ms:4.2f}x addmm_)  BV{bv} BH{bh} BK{bk} prefetch={pf} warps={nw} stages={ns}")
    if results:  # the best config against float64 on this chunk
        ms, bv, bh, bk, pf, nw, ns = results[0]
        base = torch.randn(n_vocab, n_hidden, device=dev, dtype=dt)
        out = base.clone()
        launch(buf, h, out, bv, bh, bk, 8, pf, nw, ns)
        ref = base.double() + buf.double().T @ h.double()
        print(f"best config rel err vs float64: {((out.double() - ref).norm() / ref.norm()).item():.2e}")


def _chunk_gemms(h, g, dh, w, dw):
    return {
        "logits = h W^T": lambda: torch.mm(h, w.t(), out=g),
        "dh = G W": lambda: torch.mm(g, w, out=dh),
        "dW.addmm_(G^T, h)": lambda: dw.addmm_(g.t(), h),
        "dW^T.addmm_(h^T, G)": lambda: dw.t().addmm_(h.t(), g),
    }


def layouts():
    """The same dW += G^T h through other cuBLAS call layouts, and the three GEMMs' time per token by chunk rows
    (what a larger or smaller logits buffer would buy)."""
    from triton.testing import do_bench

    n_hidden, n_vocab, dev, dt = 4096, 128256, "cuda", torch.bfloat16
    w = torch.randn(n_vocab, n_hidden, device=dev, dtype=dt) * 0.02
    dw = torch.zeros(n_vocab, n_hidden, device=dev, dtype=dt)
    for rows in (384, 512, 640, 1024):
        h = torch.randn(rows, n_hidden, device=dev, dtype=dt)
        g = torch.randn(rows, n_vocab, device=dev, dtype=dt) * 1e-5
        dh = torch.empty(rows, n_hidden, device=dev, dtype=dt)
        times = {k: do_bench(fn, warmup=25, rep=200, return_mode="median")
                 for k, fn in _chunk_gemms(h, g, dh, w, dw).items()}
        per_tok = {k: 1e3 * v / rows for k, v in times.items()}
        print(f"rows {rows:5d}: " + "; ".join(f"{k} {v:.3f} ms ({per_tok[k]:.2f} us/token)"
                                              for k, v in times.items()))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="CPU: the kernel vs float64 through the interpreter")
    parser.add_argument("--layouts", action="store_true", help="GPU: dW call layouts and chunk rows, cuBLAS only")
    args = parser.parse_args()
    check() if args.check else layouts() if args.layouts else bench()
