#!/bin/bash
# One GPU session's checks, as one command (a lent machine is short-lived: CUDA tests first, then the
# benchmark). Needs a python with CUDA torch ($PY, default python3) and the suite's packages; writes
# logs and results/perf/gpu-*.json under $OUT (default results/gpu). Usage: scripts/gpu-check.sh
set -u
PY=${PY:-python3}
OUT=${OUT:-results/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>&1 | tee "$OUT/gpu.txt"
$PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())" 2>&1 | tee -a "$OUT/gpu.txt"
timeout ${TEST_TIMEOUT:-240} $PY -m pytest -q -p no:cacheprovider --durations=5 tests/test_cuda.py 2>&1 | tee "$OUT/tests.log"
timeout ${PERF_TIMEOUT:-330} $PY -m harness.perf.gpu --out "$OUT" ${PERF_ARGS:-} 2>&1 | tee "$OUT/perf.log"
