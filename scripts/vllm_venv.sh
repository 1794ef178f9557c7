#!/usr/bin/env bash
# Lean CPU install of one vLLM release into a virtual environment, for diagnosis and patch work
# without a GPU (see DESIGN.md: a plain `pip install vllm` pulls 8 GB of CUDA wheels).
#   scripts/vllm_venv.sh VERSION VENV_DIR [EXTRA_PIP_ARGS...]
# It installs the CPU torch build, vLLM itself with --no-deps, then vLLM's own requirements minus
# torch, CUDA kernels and serving extras that importing the model registry never touches.
set -euo pipefail
version=$1; venv=$2; shift 2
py=${PYTHON:-python3}
torch_spec=${EAGLE3LAB_TORCH:-torch==2.13.0}
if [ ! -x "$venv/bin/python" ]; then "$py" -m venv "$venv"; fi
pip=(pipq "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-compile)
# pip's noise about this machine's local indexes, and the CUDA packages we leave out on purpose being
# "missing", is filtered; pip's own exit status still decides (pipefail).
pipq() { "$@" 2>&1 | { grep -v -e "^WARNING: Location" -e "which is not installed" -e "which is incompatible" \
  -e "dependency resolver does not currently" || true; }; }
"${pip[@]}" --upgrade pip >/dev/null
"${pip[@]}" "$torch_spec"
"${pip[@]}" --no-deps "vllm==$version"
req=$(mktemp)
"$venv/bin/python" - "$version" > "$req" <<'PY'
import re, sys
from importlib.metadata import requires
skip = re.compile(r"^(torch|torchaudio|torchvision|torchcodec|PyNvVideoCodec|flashinfer|apache-tvm-ffi|tilelang|"
                  r"nvidia-|nvtx|fastsafetensors|quack-kernels|tokenspeed|humming|ray|xgrammar|llguidance|"
                  r"kaldi-native-fbank|numba|model-hosting|anthropic|mcp|opentelemetry|grpcio)", re.I)
for req in requires("vllm") or []:
    if "extra ==" in req or skip.match(req):
        continue
    print(req)
PY
"${pip[@]}" -r "$req" "$@"
rm -f "$req"
"$venv/bin/python" -c "import vllm, torch, transformers; print('vllm', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
