#!/usr/bin/env bash
# GPU smoke check: on a fresh GPU machine, install the CUDA extras into .venv-gpu and run every check
# (python -m hybridflow_lab.smoke) within 7 minutes on a tiny model and 1-2 GPUs; prints one JSON summary
# (also written to gpu_smoke.json) and exits non-zero when a check fails. See docs/vllm.md.
#   scripts/gpu_smoke.sh                      install, then run every check
#   SMOKE_PYTHON=python3 scripts/gpu_smoke.sh use an environment that has the project already (no install)
#   SMOKE_WHEELS=.whl scripts/gpu_smoke.sh    a machine without internet whose python3 has a CUDA torch: add the
#                                             wheels scripts/gpu_wheels.sh fetched (no vLLM: its check is skipped)
#   scripts/gpu_smoke.sh --checks engines     any arguments go to python -m hybridflow_lab.smoke
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 RAY_DEDUP_LOGS=0 PYTHONUNBUFFERED=1
PYTHON=${SMOKE_PYTHON:-}
if [ -n "${SMOKE_WHEELS:-}" ]; then
  SITE=/tmp/hybridflow-smoke-site
  python3 -m pip install --quiet --no-index --no-deps --no-compile --upgrade --target $SITE "$SMOKE_WHEELS"/*.whl
  export PYTHONPATH=$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}  # Ray's workers inherit it and import the project here
  PYTHON=python3
elif [ -z "$PYTHON" ]; then
  # requirements/gpu.txt (make lock-gpu): PyPI's CUDA torch 2.13.0 and vLLM with their nvidia-* libraries, every
  # other version runtime.txt's. A machine without a registry fails here in seconds, not after pip's retries.
  INDEX=${PIP_INDEX_URL:-$(python3 -m pip config get global.index-url 2>/dev/null || echo https://pypi.org/simple)}
  if ! python3 -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1] + '/pip/', timeout=5)" "$INDEX" \
       2>/dev/null; then
    echo "gpu_smoke: no package registry at $INDEX: on a machine without one, carry the wheels" \
         "(scripts/gpu_wheels.sh, then SMOKE_WHEELS=.whl scripts/gpu_smoke.sh) or set SMOKE_PYTHON" >&2
    exit 2
  fi
  VENV=.venv-gpu
  test -x $VENV/bin/python || python3 -m venv $VENV
  grep -v '^deepspeed==' requirements/gpu.txt > $VENV/requirements-gpu.txt
  $VENV/bin/pip install --quiet --no-deps --retries 1 -r $VENV/requirements-gpu.txt
  # DeepSpeed ships a source archive only: built against the torch just installed (its ops build at first use)
  $VENV/bin/pip install --quiet --no-deps --no-build-isolation "$(grep '^deepspeed==' requirements/gpu.txt)"
  $VENV/bin/pip install --quiet --no-deps --no-build-isolation -e .
  PYTHON=$VENV/bin/python
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
# 7 minutes: a lent machine gives one command 10, and the JSON is written after every check
timeout "${SMOKE_TIMEOUT:-420}" "$PYTHON" -m hybridflow_lab.smoke --device cuda --out gpu_smoke.json "$@"
