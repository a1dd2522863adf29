"""Issue 3, fast mode: can dh(i) = G W and dW += G^T h overlap on two streams (no extra memory: both only read G)?

The fast mode's chunk loop (32 chunks of 512 tokens at N16384 H4096 V128256 bf16) runs logits, the cross-entropy
kernel, dh and dW one after another: 2.48 ms of cuBLAS per chunk against ~2.0 ms of compute at 800 TFLOP/s, with
dW's epilogue memory-bound while dh is compute-bound (NOTES.md). cuBLAS's nvjet kernels are persistent and fill
every SM, so this script also tries an SM carveout (``torch._C._set_sm_carveout_experimental``) that keeps some SMs
free of cuBLAS kernels. For each variant it times the 32-chunk loop (logits, cross-entropy, dh, dW) with CUDA events
and checks dh and dW against the sequential run.

It also runs the sequential loop with cuBLASLt as torch's preferred BLAS library (``--blas``: only the sequential
variants).

Usage (GPU): ``PYTHONPATH=src python3 benchmarks/lce_streams.py [--blas]``
"""
import torch


def chunk_loop(h, w, labels, buf, dh, dw, rows, streams, opts, scale):
    from leantune.ops.cross_entropy import loss_rows

    n = h.shape[0]
    loss = torch.empty(n, device=h.device)
    lse = torch.empty(n, device=h.device)
    main = torch.cuda.current_stream()
    for start in range(0, n, rows):
        end = start + rows
        g = buf  # one logits/gradient buffer, as in the op: chunk i+1 must wait for both readers of chunk i
        if streams:
            main.wait_stream(streams[0])
            main.wait_stream(streams[1])
        torch.mm(h[start:end], w.t(), out=g)
        loss_rows("triton", g, labels[start:end], opts, loss[start:end], lse[start:end], g, scale)
        if not streams:
            torch.mm(g, w, out=dh[start:end])
            if start == 0:
                torch.mm(g.t(), h[start:end], out=dw)
            else:
                dw.addmm_(g.t(), h[start:end])
            continue
        for s in streams:
            s.wait_stream(main)
        with torch.cuda.stream(streams[0]):
            torch.mm(g, w, out=dh[start:end])
        with torch.cuda.stream(streams[1]):
            if start == 0:
                torch.mm(g.t(), h[start:end], out=dw)
            else:
                dw.addmm_(g.t(), h[start:end])
    if streams:
        main.wait_stream(streams[0])
        main.wait_stream(streams[1])


def main(only_blas=False):
    from leantune.ops.cross_entropy import check_options

    n, hidden, vocab, rows = 16384, 4096, 128256, 512
    dev, dt = "cuda", torch.bfloat16
    torch.manual_seed(0)
    h = torch.randn(n, hidden, device=dev, dtype=dt)
    w = torch.randn(vocab, hidden, device=dev, dtype=dt) * hidden**-0.5
    labels = torch.randint(0, vocab, (n,), device=dev)
    opts, _ = check_options(labels, vocab, -100, 0.0, None, 0.0, "mean", None)
    scale = torch.tensor(1.0 / n, device=dev)
    buf = torch.empty(rows, vocab, device=dev, dtype=dt)
    results = {}
    variants = [("sequential", False, None, "cublas"), ("two streams", True, None, "cublas")]
    variants += [(f"two streams, {k} SMs free", True, k, "cublas") for k in (16, 33, 66)]
    variants += [("sequential, cuBLASLt", False, None, "cublaslt"), ("two streams, cuBLASLt", True, None, "cublaslt")]
    if only_blas:
        variants = [v for v in variants if not v[1]]
    for label, two, carveout, blas in variants:
        streams = [torch.cuda.Stream(), torch.cuda.Stream()] if two else []
        torch._C._set_sm_carveout_experimental(carveout)
        torch.backends.cuda.preferred_blas_library(blas)
        dh = torch.empty(n, hidden, device=dev, dtype=dt)
        dw = torch.empty(vocab, hidden, device=dev, dtype=dt)
        times = []
        for _ in range(4):  # the first is a warm-up
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            chunk_loop(h, w, labels, buf, dh, dw, rows, streams, opts, scale)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        results[label] = (min(times[1:]), dh, dw)
        torch._C._set_sm_carveout_experimental(None)
        torch.backends.cuda.preferred_blas_library("cublas")
    _, dh0, dw0 = results["sequential"]
    for label, (ms, dh, dw) in results.items():  # another carveout may pick other cuBLAS kernels: rounding differs
        diff = max(((a.float() - b.float()).norm() / b.float().norm()).item() for a, b in ((dh, dh0), (dw, dw0)))
        print(f"{label:<28} {ms:7.2f} ms for 32 chunks   rel diff vs sequential {diff:.1e}")
    if only_blas:  # the whole op, fwd+bwd, as bench ops times it (weight requires grad)
        from triton.testing import do_bench

        from leantune.ops import linear_cross_entropy

        hg = h.detach().requires_grad_()
        wg = w.detach().requires_grad_()
        for blas in ("cublas", "cublaslt", "cublas"):
            torch.backends.cuda.preferred_blas_library(blas)

            def step():
                hg.grad = wg.grad = None
                linear_cross_entropy(hg, wg, labels).backward()

            ms = do_bench(step, warmup=3, rep=600, return_mode="median")
            print(f"ops.linear_cross_entropy fwd+bwd, {blas:<9} {ms:7.2f} ms")
        torch.backends.cuda.preferred_blas_library("cublas")


if __name__ == "__main__":
    import sys

    main(only_blas="--blas" in sys.argv)
