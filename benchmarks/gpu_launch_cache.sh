#!/usr/bin/env bash
# One device call (~9 min) that decides the launch cache (src/leantune/ops/_launch.py) and re-measures issues 2-4:
#   1. host-time probes (JIT vs direct launch, each op with the cache off/on, peers)       benchmarks/hostprof.py
#   2. the GPU tests of every Triton op with the cache on (the cached launch path only runs on a GPU)
#   3. the op benchmark with the cache off, then on (same machine, same run: comparable)
#   4. kernel-time breakdown of the LoRA blocks (GEMM share, issue 4)                     benchmarks/overhead.py
# Usage on the device (carry .whl): bash benchmarks/gpu_launch_cache.sh ; everything lands in $OUT (one tarball).
set -uo pipefail
source benchmarks/gpu_env.sh
DEADLINE=${DEADLINE:-560}
OPS=${OPS:-rms_norm,rope,swiglu,lora_qkv,lora_qkv_bf16,lora_mlp,lora_mlp_bf16,linear_cross_entropy}
mkdir -p "$OUT/r"
python3 benchmarks/hostprof.py rms_norm,rope,lora_qkv 2>&1 | tee "$OUT/r/hostprof.txt" | grep -v "^\s*$"
LEANTUNE_LAUNCH_CACHE=1 timeout $(( $(left) - 330 )) python3 -m pytest -q -x -p no:cacheprovider -k "triton or launch" \
  tests/test_rms_norm.py tests/test_rope.py tests/test_glu.py tests/test_lora.py tests/test_cross_entropy.py \
  tests/test_linear_cross_entropy.py tests/test_launch.py > "$OUT/r/pytest_cache_on.log" 2>&1
echo "GPU tests, launch cache on: $(tail -1 "$OUT/r/pytest_cache_on.log")"
# cache off: the host-sensitive ops only; cache on: everything (each op in its own process, within the budget)
LEANTUNE_LAUNCH_CACHE=0 python3 -m leantune bench ops --ops rms_norm,rope,lora_qkv,lora_qkv_bf16 \
  --out "$OUT/r/ops_cache0" --budget-s $(( ($(left) - 60) / 3 )) 2>&1 | tail -20
LEANTUNE_LAUNCH_CACHE=1 python3 -m leantune bench ops --ops "$OPS" --out "$OUT/r/ops_cache1" \
  --budget-s $(( $(left) - 60 )) 2>&1 | tail -40
timeout $(( $(left) - 5 )) python3 benchmarks/overhead.py lora_qkv,lora_mlp,lora_mlp_bf16 > "$OUT/r/overhead.txt" 2>&1
tail -20 "$OUT/r/overhead.txt"
tar czf "$OUT/launch_cache.tgz" -C "$OUT" r && rm -rf "$OUT/r"
echo "done at $SECONDS s"
