# Source on the device machine from the repo root: installs carried wheels (.whl/) into /tmp/site and sets
# PYTHONPATH so that `python3 -m leantune ...` runs from the source tree; defines `left` (seconds to DEADLINE).
export PYTHONUNBUFFERED=1 PYTHONPATH=src
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=src:/tmp/site
fi
OUT=${OUT:-/tmp/out}
DEADLINE=${DEADLINE:-570}
left() { echo $(( DEADLINE - SECONDS )); }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers, peft; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)"
