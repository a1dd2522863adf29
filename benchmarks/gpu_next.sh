#!/usr/bin/env bash
# The fourth session's first device call (~9 min; carry .whl): the open GPU runs of NOTES.md in one go.
#   1. bench ops rms_norm: graph_ms captures every implementation now (fresh leaf copies)
#   2. GPU tests of the CPU-scalar num_items path, the +inf-logit change and the split LoRA backward
#   3. benchmarks/lce_dw.py: issue 3's chunk breakdown and the Triton dW-accumulate kernel
#   4. benchmarks/qkv_variants.py: issue 4's split-K vs none, harness / graph / host time
# Usage on the device: bash benchmarks/gpu_next.sh ; everything lands in $OUT/next.tgz, the tables on stdout.
set -uo pipefail
source benchmarks/gpu_env.sh
mkdir -p "$OUT/next"
python3 -m leantune bench ops --ops rms_norm --out "$OUT/next/ops" --budget-s 150 2>&1 | tail -7
timeout 240 python3 -m pytest -q -p no:cacheprovider -k triton tests/test_cross_entropy.py \
  tests/test_linear_cross_entropy.py tests/test_lora.py > "$OUT/next/pytest.log" 2>&1
echo "GPU tests (cross_entropy, linear_cross_entropy, lora): $(tail -1 "$OUT/next/pytest.log")"
timeout 200 python3 benchmarks/lce_dw.py 2>&1 | tee "$OUT/next/lce_dw.txt" | tail -20
timeout 120 python3 benchmarks/qkv_variants.py 2>&1 | tee "$OUT/next/qkv_variants.txt" | tail -10
tar czf "$OUT/next.tgz" -C "$OUT" next && rm -rf "$OUT/next"
echo "done at $SECONDS s"
