#!/usr/bin/env bash
# Run on the device machine from the repo root: bash benchmarks/gpu.sh "<pytest args>" "<bench ops>" [impls]
# Installs carried wheels (.whl/) into /tmp/site, runs the given tests on the GPU, then the op benchmark.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=src
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=src:/tmp/site
fi
OUT=${OUT:-/tmp/out}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
python3 -c "import torch, triton, transformers, peft; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)"
if [ -n "${1:-}" ]; then
  python3 -m pytest -q -p no:cacheprovider $1 2>&1 | tee "$OUT/pytest.log" | tail -25
fi
if [ -n "${2:-}" ]; then
  python3 -m leantune.bench.ops --ops "$2" ${3:+--impls "$3"} --out "$OUT/ops.json" 2>"$OUT/bench.log"
  tail -5 "$OUT/bench.log"
fi
