#!/usr/bin/env bash
# Device side of a GPU session (see benchmarks/gpu/README.md for the calls that lead here).
# vLLM 0.26.0 is staged in /tmp/site (../shared/device/stage-vllm.sh); this script installs our notebook stack
# (carried as py3.12 wheels in .device-wheels/) and eagle3lab itself from a snapshot of a commit
# (.device-snap/src.tgz: `git archive`, so half-edited files of the working tree never reach the device),
# then runs one step. Everything it writes that matters goes under $OUT.
#   setup      install wheels + eagle3lab (with its vllm.general_plugins entry point) into /tmp/site2
#   workbook   eagle3lab run --params params/embedded-gpu.yaml (00-05 with the vLLM engine)
#   proofs     scripts/gpu_engine_proofs.py on that run (suite single)
#   tp         scripts/gpu_engine_proofs.py --suite tp on a carried CPU run's artifacts (.device-snap/run.tgz)
#   tests      the GPU-marked tests
#   caches     tar the kernel caches into $OUT (carry them next time)
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=/tmp/site:/tmp/site2
export EAGLE3LAB_BATCH=1 TOKENIZERS_PARALLELISM=false
here=$(pwd)
for step in "$@"; do case $step in
setup)
  rm -rf /tmp/src /tmp/site2 && mkdir -p /tmp/src /tmp/site2
  tar -xzf .device-snap/src.tgz -C /tmp/src
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site2 .device-wheels/*.whl 2>&1 | tail -2
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target /tmp/site2 /tmp/src 2>&1 | tail -2
  if [ -f .device-snap/caches.tgz ]; then tar -xzf .device-snap/caches.tgz -C / 2>/dev/null; echo "kernel caches restored"; fi
  python3 -c "import vllm, torch, eagle3lab, papermill, plotly; from importlib.metadata import entry_points as e; print('vllm', vllm.__version__, 'torch', torch.__version__, 'plugins', [x.name for x in e(group='vllm.general_plugins')])"
  { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; date -u +%FT%TZ; } | tee "$OUT/machine.txt";;
workbook)
  rm -rf /tmp/e3out
  cd /tmp/src && timeout "${WB_TIMEOUT:-560}" python3 -m eagle3lab run --params params/embedded-gpu.yaml --outputs /tmp/e3out \
      --no-progress ${WB_ARGS:-} 2>&1 | grep -v "Kernel is running over TCP" | tail -20 | tee "$OUT/workbook.txt"
  run=$(ls -d /tmp/e3out/*/ | head -1)
  mkdir -p "$OUT/workbook"
  (cd "$run" && cp -r *.html *.js metrics.json metrics run.log params.yaml logs "$OUT/workbook/" 2>/dev/null)
  cd "$here";;
proofs)
  run=$(ls -d /tmp/e3out/*/ | head -1)
  cd /tmp/src && timeout "${PROOF_TIMEOUT:-570}" python3 scripts/gpu_engine_proofs.py "$run" "$OUT/proofs" --prompts 32 --max-tokens 64 \
      2>&1 | tail -60
  cd "$here";;
tp)
  rm -rf /tmp/cpurun && mkdir -p /tmp/cpurun && tar -xzf .device-snap/run.tgz -C /tmp/cpurun
  cd /tmp/src && timeout "${PROOF_TIMEOUT:-570}" python3 scripts/gpu_engine_proofs.py /tmp/cpurun "$OUT/tp" --suite tp --tp 2 \
      --prompts 32 --max-tokens 64 2>&1 | tail -60
  cd "$here";;
tests)
  cd /tmp/src && timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests 2>&1 | tail -25 | tee "$OUT/pytest-gpu.txt"
  cd "$here";;
caches)
  tar -czf "$OUT/caches.tgz" /root/.triton/cache /root/.cache/flashinfer /root/.cache/vllm 2>/dev/null; ls -la "$OUT/caches.tgz";;
*) echo "unknown step $step"; exit 2;;
esac; done
