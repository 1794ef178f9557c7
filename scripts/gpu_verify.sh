#!/usr/bin/env bash
# STATUS (2026-11-29): written for the GPU engine issue, NOT YET RUN on a device (budget ran out).
# GPU verification on the lent H200 (see ../shared/device/README.md; vLLM 0.26.0 staged in /tmp/site).
# Carried: .device-wheels/ (our notebook stack as py3.12 wheels). Writes everything under $OUT.
#   1. installs eagle3lab (with its vllm.general_plugins entry point) and the notebook stack into /tmp/site2
#   2. the GPU-marked tests
#   3. the workbook 00-05 on CUDA (embedded profile sizes, reference engine on the GPU)
#   4. scripts/gpu_vllm_eagle3.py: that run's target + drafter in real vLLM: baseline, native EAGLE-3,
#      legacy simulation (must refuse), legacy simulation + our patch, our forward forced over the native one
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=/tmp/site:/tmp/site2
if [ ! -d /tmp/site2/eagle3lab ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site2 .device-wheels/*.whl 2>&1 | tail -2
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target /tmp/site2 . 2>&1 | tail -2
fi
python3 -c "import vllm, torch, eagle3lab, papermill, plotly; from importlib.metadata import entry_points as e; print('vllm', vllm.__version__, 'torch', torch.__version__, 'plugins', [x.name for x in e(group='vllm.general_plugins')])"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
date -u +%FT%TZ | tee -a "$OUT/gpu.txt"
step=${1:-all}
if [ "$step" = all ] || [ "$step" = tests ]; then
  timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests 2>&1 | tail -25 | tee "$OUT/pytest-gpu.txt"
fi
if [ "$step" = all ] || [ "$step" = workbook ]; then
  rm -rf /tmp/e3out
  timeout 420 python3 -m eagle3lab run --params params/embedded.yaml -p engine.device=cuda --outputs /tmp/e3out --no-progress \
    2>&1 | grep -v "Kernel is running over TCP" | tail -12 | tee "$OUT/workbook.txt"
  run=$(ls -d /tmp/e3out/*/ | head -1)
  mkdir -p "$OUT/workbook"; cp "$run"/*.html "$run"/metrics.json "$run"/run.log "$OUT/workbook/" 2>/dev/null
  # the small artifacts come back too, so a later call can reuse them if the machine went cold
  tar -czf "$OUT/workbook/artifacts.tgz" -C "$run" artifacts/target artifacts/drafter artifacts/data 2>/dev/null
fi
if [ "$step" = all ] || [ "$step" = vllm ]; then
  run=$(ls -d /tmp/e3out/*/ 2>/dev/null | head -1)
  if [ -z "$run" ] && [ -f "${ARTIFACTS:-}" ]; then mkdir -p /tmp/e3out/carried && tar -xzf "$ARTIFACTS" -C /tmp/e3out/carried; run=/tmp/e3out/carried; fi
  timeout 540 python3 scripts/gpu_vllm_eagle3.py "$run" "$OUT/vllm" --prompts 32 --max-tokens 64 --k 3
  tail -5 "$OUT"/vllm/mode-*.log > "$OUT/vllm/tails.txt" 2>/dev/null
fi
