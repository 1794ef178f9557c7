#!/usr/bin/env bash
# Packs what a GPU session carries (.device-stage from benchmarks/tools/stage_vllm.sh, .device-wheels and
# .device-snap from benchmarks/tools/device_wheels.sh) into .device-pack/chunk-NN, each small enough to travel beside the
# working tree in one device call (a call carries at most 64 MiB in all). On the device, one call per chunk, each
# with carry [".device-pack/receive.sh", ".device-pack/chunk-NN"]:
#     bash .device-pack/receive.sh            keeps the chunk in /tmp/chunks; with the last one it unpacks all,
#                                             installs vLLM into /tmp/site (install.sh) and is ready for
#                                             `bash benchmarks/tools/gpu_session.sh setup ...` in the same call
set -euo pipefail
root=$(git rev-parse --show-toplevel); cd "$root"
grep -qx /.device-pack/ .git/info/exclude || echo /.device-pack/ >> .git/info/exclude
tree=$(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1)
budget=$((64 * 1024 * 1024 - tree - 2 * 1024 * 1024))  # what a call has left beside the tree, 2 MiB spare
[ "$budget" -gt $((8 * 1024 * 1024)) ] || { echo "the working tree ($tree bytes) leaves no room to carry chunks"; exit 2; }
rm -rf .device-pack && mkdir -p .device-pack
tar -cf - .device-stage .device-wheels .device-snap | split -b "$budget" -d -a 2 - .device-pack/chunk-
n=$(ls .device-pack/chunk-* | wc -l)
cat > .device-pack/receive.sh <<SH
#!/bin/bash
# Device side of benchmarks/tools/device_pack.sh: collect the chunks, then unpack and install vLLM.
set -euo pipefail
mkdir -p /tmp/chunks && cp .device-pack/chunk-* /tmp/chunks/
have=\$(ls /tmp/chunks | wc -l); echo "chunks on this machine: \$have of $n"
if [ "\$have" = "$n" ]; then
  cat /tmp/chunks/chunk-* | tar -x && bash .device-stage/install.sh receive install
fi
SH
ls -la .device-pack; echo "tree $tree bytes; $n chunks of at most $budget bytes"
