#!/usr/bin/env bash
# The next session's first device call (~9 min; carry .whl): what the fourth session left unrun on the GPU.
#   1. every Triton test of tests/test_lora.py (its cuBLAS backward path changed after its last full GPU run) and of
#      the autograd contract (the first-derivative-only wrapper on every backward)
#   2. bench ops with the interleaved rounds (new), for the host-bound rows of issues 2 and 4
#   3. benchmarks/qkv_variants.py: split-K vs no split vs no split with small tiles (issue 4's QKV host time)
# Usage on the device: bash benchmarks/gpu_next.sh ; everything lands in $OUT/next.tgz, the tables on stdout.
set -uo pipefail
source benchmarks/gpu_env.sh
mkdir -p "$OUT/next"
timeout 320 python3 -m pytest -q -p no:cacheprovider -k triton tests/test_lora.py tests/test_autograd_contract.py \
  > "$OUT/next/pytest.log" 2>&1
echo "GPU tests (lora, autograd contract): $(tail -1 "$OUT/next/pytest.log")"
python3 -m leantune bench ops --ops rms_norm,lora_qkv,lora_qkv_bf16 --out "$OUT/next/ops" --budget-s 140 2>&1 \
  | grep "^|"
timeout 90 python3 benchmarks/qkv_variants.py 2>&1 | tee "$OUT/next/qkv_variants.txt" | tail -12
tar czf "$OUT/next.tgz" -C "$OUT" next && rm -rf "$OUT/next"
echo "done at $SECONDS s"
