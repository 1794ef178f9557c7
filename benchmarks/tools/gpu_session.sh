#!/usr/bin/env bash
# Device side of a GPU session (see benchmarks/tools/README.md for the calls that lead here).
# vLLM 0.26.0 is staged in /tmp/site (benchmarks/tools/stage_vllm.sh); this script installs our notebook stack
# (carried as py3.12 wheels in .device-wheels/) and eagle3lab itself from a snapshot of a commit
# (.device-snap/src.tgz: `git archive`, so half-edited files of the working tree never reach the device),
# then runs one step. Everything it writes that matters goes under $OUT.
#   setup      install wheels + eagle3lab (with its vllm.general_plugins entry point) into /tmp/site2
#   workbook   eagle3lab run --params params/embedded-gpu.yaml (00-05 with the vLLM engine; WB_UNTIL=03 stops
#              after 03, the rest stays pending; WB_PARAMS=params/embedded-glm4-moe-gpu.yaml runs another profile;
#              WB_ARGS adds run options, e.g. "-p target.embedded.train_time_budget_s=30")
#   resume     eagle3lab run --resume on that run folder (a device call is limited to 10 minutes: a run that
#              does not fit one call continues in the next, on the same warm machine)
#   proofs     benchmarks/tools/gpu_engine_proofs.py on that run (suite single)
#   tp         benchmarks/tools/gpu_engine_proofs.py --suite tp on that run
#   speed      benchmarks/tools/gpu_engine_proofs.py --suite speed (target deepened to LAYERS layers; resumable; SPEED_ENGINES
#              in order, repeats allowed: native,forced,native,forced; SPEED_DIR=/tmp/speed2 measures afresh)
#   ratio      benchmarks/tools/gpu_engine_proofs.py --suite ratio (forced vs native, every instance alive at once, repetitions
#              in turn; RATIO_ENGINES, RATIO_ROUNDS, RATIO_LAYERS: default the run's target as it is; RATIO_REP_S: the
#              shortest repetition, 1.0 s; RATIO_BATCHES: 1,8,32; RATIO_ROUNDS_S: no round starts after this many
#              seconds of rounds, RATIO_UNTIL: nor after this time (epoch seconds); RATIO_ROUNDS then only bounds them)
#   extract    benchmarks/tools/gpu_engine_proofs.py --suite extract (hidden-state extraction vs plain prefill; with
#              EXTRACT_PARAMS=params/embedded-gpu.yaml on a fresh target of that profile's shapes)
#   served     benchmarks/tools/gpu_engine_proofs.py --suite served
#   tests      the GPU-marked tests (TESTS_K: pytest's -k expression)
#   yardstick  benchmarks/tools/precision_error.py --device cuda on this machine's workbook run (after WB_UNTIL=00 workbook
#              at least): how far the GPU profile's bf16 target strays from float32, 05's tie yardstick
#   bg         run BG_STEPS (these steps, in order) in the background, its $OUT /tmp/bgout: a suite longer than one
#              call's 10 minutes lives on over several calls while the machine stays warm
#   poll       wait until the background steps end or POLL_S (560) seconds pass, then return their log and a
#              snapshot of /tmp/bgout (kept repetitions included) as bg/
#   caches     tar the kernel caches into $OUT as 15 MiB parts (reassemble into .device-snap/caches.tgz, carry them next time)
# The proof steps (proofs, tp, speed, extract, served) use a carried run (.device-snap/run.tgz) when this
# machine has no workbook run.
# At the end everything under $OUT but the caches' parts is packed into $OUT/results.tgz: a device call returns at
# most 8 files.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=/tmp/site:/tmp/site2
export EAGLE3LAB_BATCH=1 TOKENIZERS_PARALLELISM=false
export JUPYTER_PATH=/tmp/site2/share/jupyter  # nbconvert's templates, installed with --target
here=$(pwd)

# Run "$@" in a process group of its own, killed as a whole after $1 seconds: a notebook kernel or a vLLM
# engine core left behind would hold the GPU for the next step.
bounded() {
  local t=$1; shift
  setsid "$@" & local pid=$!
  ( trap 'kill $s 2>/dev/null; exit 0' TERM; sleep "$t" & s=$!; wait $s
    kill -TERM -- "-$pid"; sleep 15; kill -KILL -- "-$pid" ) >/dev/null 2>&1 & local guard=$!
  wait "$pid"; local rc=$?
  kill "$guard" 2>/dev/null; return $rc
}
# The run the proof steps work on: this machine's workbook run, else a run carried in .device-snap/run.tgz (a run
# made elsewhere, e.g. on the CPU: the proofs that need no trained GPU target then skip the workbook's 10 minutes).
proof_run() {
  local run; run=$(ls -d /tmp/e3out/*/ 2>/dev/null | head -1)
  # carried once: later calls on the same warm machine find it unpacked and need not carry it again
  if [ -z "$run" ] && [ ! -d /tmp/cpurun/artifacts ] && [ -f .device-snap/run.tgz ]; then
    rm -rf /tmp/cpurun && mkdir -p /tmp/cpurun && tar -xzf .device-snap/run.tgz -C /tmp/cpurun
  fi
  [ -z "$run" ] && [ -d /tmp/cpurun/artifacts ] && run=/tmp/cpurun
  [ -n "$run" ] || { echo "no run: run the workbook step first, or carry .device-snap/run.tgz" >&2; return 1; }
  echo "$run"
}
copy_run() {
  local run; run=$(ls -d /tmp/e3out/*/ | head -1)
  mkdir -p "$OUT/workbook"
  (cd "$run" && cp -r *.html *.ipynb *.js metrics.json metrics run.log params.yaml logs "$OUT/workbook/" 2>/dev/null)
  (cd "$run/artifacts" && tar -czf "$OUT/workbook/small-artifacts.tgz" data/heldout_prompts.jsonl data/meta.json \
      acceptance drafter/config.json target/config.json 2>/dev/null)
  # A step cut by the call's limit leaves an executed-so-far notebook and no page: render it, named as partial.
  for nb in "$OUT"/workbook/*.ipynb; do
    [ -f "${nb%.ipynb}.html" ] || python3 -c "import sys; from eagle3lab.report import export_html as e; e(sys.argv[1], sys.argv[2])" \
      "$nb" "${nb%.ipynb}-partial.html" 2>/dev/null || true
  done
}
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
  cd /tmp/src && bounded "${WB_TIMEOUT:-560}" python3 -m eagle3lab run --params "${WB_PARAMS:-params/embedded-gpu.yaml}" \
      --outputs /tmp/e3out --no-progress ${WB_UNTIL:+--until $WB_UNTIL} ${WB_ONLY:+--only $WB_ONLY} ${WB_ARGS:-} \
      > "$OUT/workbook.txt" 2>&1
  grep -v "Kernel is running over TCP" "$OUT/workbook.txt" | tail -20
  copy_run; cd "$here";;
resume)
  run=$(ls -d /tmp/e3out/*/ | head -1)
  cd /tmp/src && bounded "${WB_TIMEOUT:-560}" python3 -m eagle3lab run --resume "$run" --no-progress \
      ${WB_UNTIL:+--until $WB_UNTIL} > "$OUT/resume.txt" 2>&1
  grep -v "Kernel is running over TCP" "$OUT/resume.txt" | tail -20
  copy_run; cd "$here";;
proofs)
  run=$(proof_run) || continue
  cd /tmp/src && timeout "${PROOF_TIMEOUT:-570}" python3 benchmarks/tools/gpu_engine_proofs.py "$run" "$OUT/proofs" --prompts 32 --max-tokens 64 \
      2>&1 | tail -60
  cd "$here";;
tp)
  run=$(proof_run) || continue
  cd /tmp/src && bounded "${PROOF_TIMEOUT:-570}" python3 benchmarks/tools/gpu_engine_proofs.py "$run" "$OUT/tp" --suite tp \
      --tp 2 --prompts 32 --max-tokens 64 > "$OUT/tp.txt" 2>&1; tail -40 "$OUT/tp.txt"
  cd "$here";;
speed)
  run=$(proof_run) || continue
  sd=${SPEED_DIR:-/tmp/speed}; mkdir -p "$sd"  # a fresh SPEED_DIR measures again; the same one resumes
  cd /tmp/src && bounded "${PROOF_TIMEOUT:-570}" python3 benchmarks/tools/gpu_engine_proofs.py "$run" "$sd" --suite speed \
      --layers "${LAYERS:-96}" --engines "${SPEED_ENGINES:-baseline,native,forced}" --prompts 32 --max-tokens 64 > "$sd/speed.txt" 2>&1; tail -40 "$sd/speed.txt"
  rm -f "$sd"/*.pt; cp -r "$sd" "$OUT/$(basename "$sd")"
  cd "$here";;
ratio)
  run=$(proof_run) || continue
  cd /tmp/src && bounded "${PROOF_TIMEOUT:-570}" python3 benchmarks/tools/gpu_engine_proofs.py "$run" "$OUT/ratio" --suite ratio \
      --engines "${RATIO_ENGINES:-native,forced,native,forced}" --rounds "${RATIO_ROUNDS:-10}" ${RATIO_LAYERS:+--layers $RATIO_LAYERS} \
      --rep-min-seconds "${RATIO_REP_S:-1.0}" --batches "${RATIO_BATCHES:-1,8,32}" ${RATIO_ROUNDS_S:+--rounds-seconds $RATIO_ROUNDS_S} \
      ${RATIO_UNTIL:+--rounds-until $RATIO_UNTIL} \
      --prompts 32 --max-tokens 64 > "$OUT/ratio.txt" 2>&1; grep -v '^ ' "$OUT/ratio.txt" | tail -25; cat "$OUT/ratio/ratio.md" 2>/dev/null
  cd "$here";;
extract)
  run=$(proof_run) || continue
  cd /tmp/src && timeout 300 python3 benchmarks/tools/gpu_engine_proofs.py "$run" "$OUT/extract" --suite extract \
      ${EXTRACT_PARAMS:+--target-params $EXTRACT_PARAMS} --extract-samples "${EXTRACT_SAMPLES:-256}" > "$OUT/extract.txt" 2>&1; tail -20 "$OUT/extract.txt"
  cd "$here";;
served)
  run=$(proof_run) || continue
  cd /tmp/src && bounded "${PROOF_TIMEOUT:-300}" python3 benchmarks/tools/gpu_engine_proofs.py "$run" "$OUT/served" --suite served \
      --prompts 16 --max-tokens 64 > "$OUT/served.txt" 2>&1; tail -30 "$OUT/served.txt"
  cd "$here";;
tests)
  # -rP: the passed tests' printed measurements (e.g. AUX_MEASURED) stay in the committed output
  # Unbuffered, and SIGINT first: a run cut by the limit still leaves its output and pytest's summary (12-07: a
  # SIGTERM'd pytest left an empty file).
  cd /tmp/src && PYTHONUNBUFFERED=1 timeout -s INT -k 30 "${TESTS_TIMEOUT:-420}" python3 -m pytest -q -rP -p no:cacheprovider \
      -m gpu tests ${TESTS_K:+-k "$TESTS_K"} > "$OUT/pytest-gpu.txt" 2>&1; grep -E "^(AUX|GREEDY|REFUSED)|passed|failed|Error|assert" "$OUT/pytest-gpu.txt" | tail -30
  cd "$here";;
yardstick)
  run=$(ls -d /tmp/e3out/*/ 2>/dev/null | head -1)
  [ -n "$run" ] || { echo "yardstick: no workbook run on this machine (run WB_UNTIL=00 workbook first)"; continue; }
  cd /tmp/src && timeout "${YARD_TIMEOUT:-300}" python3 benchmarks/tools/precision_error.py "$run" --device cuda \
      --prompts "${YARD_PROMPTS:-64}" --new-tokens "${YARD_TOKENS:-128}" --out "$OUT/precision-error-gpu.json" \
      > "$OUT/yardstick.txt" 2>&1; tail -30 "$OUT/yardstick.txt"
  cd "$here";;
bg)
  # A copy of this script runs them: the next call may bring a fresh copy of the working tree under it.
  rm -rf /tmp/bgout && mkdir -p /tmp/bgout && cp "$here/benchmarks/tools/gpu_session.sh" /tmp/bg-session.sh
  OUT=/tmp/bgout setsid nohup bash /tmp/bg-session.sh ${BG_STEPS:?BG_STEPS: the steps to run} > /tmp/bg.log 2>&1 < /dev/null &
  echo $! > /tmp/bg.pid; echo "background: $BG_STEPS (pid $(cat /tmp/bg.pid))";;
poll)
  pid=$(cat /tmp/bg.pid 2>/dev/null); end=$((SECONDS + ${POLL_S:-560}))
  while [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null && [ $SECONDS -lt $end ]; do sleep 5; done
  if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then echo "background: still running"; else echo "background: ended"; fi
  mkdir -p "$OUT/bg" && cp /tmp/bg.log "$OUT/bg/" 2>/dev/null
  (cd /tmp/bgout 2>/dev/null && tar -czf "$OUT/bg/bgout.tgz" --exclude='*.pt' --exclude='*.safetensors' .)
  tail -25 /tmp/bg.log;;
caches)
  # A file comes back only under 16 MiB (the device README's limits): the tarball travels as 15 MiB parts.
  # Here: cat caches.tgz.part-* > .device-snap/caches.tgz before device_pack.sh; setup restores it.
  tar -czf /tmp/caches.tgz /root/.triton/cache /root/.cache/flashinfer /root/.cache/vllm 2>/dev/null
  # A call returns at most 8 files and 64 MiB together: 3 parts (45 MiB) leave room for results.tgz; beyond that,
  # say so rather than lose files silently.
  size=$(stat -c %s /tmp/caches.tgz)
  if [ "$size" -gt $((45 * 1024 * 1024)) ]; then
    echo "caches: $size bytes, more than 45 MiB would not come back beside results.tgz; not returned"; rm -f /tmp/caches.tgz
  else
    split -b 15M -d -a 2 /tmp/caches.tgz "$OUT/caches.tgz.part-" && rm -f /tmp/caches.tgz; ls -la "$OUT"/caches.tgz.part-*
  fi;;
*) echo "unknown step $step"; exit 2;;
esac; done
( cd "$OUT" && tar -czf /tmp/results.$$.tgz --exclude='./caches.tgz.part-*' . && find . -mindepth 1 ! -name 'caches.tgz.part-*' -delete \
  && mv /tmp/results.$$.tgz results.tgz && ls -la )
