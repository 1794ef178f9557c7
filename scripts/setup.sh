#!/usr/bin/env bash
# Set up .venv/ for the workbook on a CPU machine: CPU torch, a lean vLLM 0.26.0 (for diagnosis and the
# patch; no GPU needed), and eagle3lab with JupyterLab, ipywidgets and its test tools. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/vllm_venv.sh 0.26.0 .venv
.venv/bin/python -m pip install -q --disable-pip-version-check --no-compile -e ".[dev,lab]" 2>&1 \
  | { grep -v "^WARNING: Location" || true; }
.venv/bin/python -m eagle3lab validate params/embedded.yaml > /dev/null
echo "ready: .venv/bin/eagle3lab"
