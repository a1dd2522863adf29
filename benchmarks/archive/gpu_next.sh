#!/usr/bin/env bash
# One device call (~8 min; carry .whl) that re-certifies main on the H200:
#   1. every Triton test (and the int64 / > 2^31-element ones) of the op files other than lora and the autograd
#      contract, which ran in the fifth session's first call: these are the tests that had not run on a GPU since
#      every backward went through `_runtime.first_derivative_only`
#   2. bench ops for the open rows of issues 3 and 4 in one run (loss peers: torch.compile, Liger, CCE; LoRA: PEFT)
# Usage on the device: bash benchmarks/gpu_next.sh ; everything lands in $OUT/next.tgz, the tables on stdout.
set -uo pipefail
source benchmarks/gpu_env.sh
mkdir -p "$OUT/next"
timeout 200 python3 -m pytest -q -p no:cacheprovider -k "triton or int64 or 2_31 or large" \
  tests/test_rms_norm.py tests/test_rope.py tests/test_glu.py tests/test_cross_entropy.py \
  tests/test_linear_cross_entropy.py > "$OUT/next/pytest.log" 2>&1
echo "GPU tests (rms_norm, rope, glu, cross_entropy, linear_cross_entropy): $(tail -1 "$OUT/next/pytest.log")"
python3 -m leantune bench ops --out "$OUT/next/ops" --budget-s $(( $(left) - 20 )) \
  --ops linear_cross_entropy,linear_cross_entropy_low,lora_mlp,lora_mlp_bf16,lora_qkv,lora_qkv_bf16 2>&1 | grep "^|"
tar czf "$OUT/next.tgz" -C "$OUT" next && rm -rf "$OUT/next"
echo "done at $SECONDS s"
