#!/bin/bash
# Prepares vLLM 0.26.0 for the lent GPU machine, which reaches no package registry and takes at most
# 64 MiB of working tree per call. Run it here, in the project's root. It writes .device-stage/
# (added to .git/info/exclude): install.sh and part-00..part-NN, each under 55 MiB.
# (Kept here from the workplace's device notes, so that a GPU session needs nothing outside the repository.)
# Then, on the device tool, one call per part, each with carry [".device-stage/install.sh", ".device-stage/part-NN"]:
#     bash .device-stage/install.sh receive          (every part but the last)
#     bash .device-stage/install.sh receive install  (the last part: assembles and installs into /tmp/site)
# and in every later call on the same warm machine:  export PYTHONPATH=/tmp/site
# The machine keeps /tmp only while it stays warm; install.sh says so when a part is missing.
# Why slimmed: the GPU image has torch 2.11.0+cu130 (what vllm 0.26.0 pins) but no vllm. The wheel loses
# FlashAttention-2 (Hopper uses FA3), the Rust front end and Blackwell-only kernels; nothing else changes.
set -euo pipefail
VLLM=${VLLM:-0.26.0}
root=$(git rev-parse --show-toplevel)
cd "$root"
grep -qx '/.device-stage/' .git/info/exclude 2>/dev/null || echo '/.device-stage/' >> .git/info/exclude
out=$root/.device-stage; rm -rf "$out"; mkdir -p "$out"
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
plat=(--only-binary=:all: --python-version 3.12 --implementation cp)
for p in manylinux_2_35_x86_64 manylinux_2_34_x86_64 manylinux_2_31_x86_64 manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_26_x86_64 manylinux_2_24_x86_64 \
         manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_5_x86_64 manylinux1_x86_64; do plat+=(--platform $p); done
echo "downloading vllm==$VLLM ..."
python3 -m pip download -q --no-deps "${plat[@]}" -d "$work/w" "vllm==$VLLM"
mkdir -p "$work/x" && (cd "$work/x" && unzip -q "$work"/w/vllm-*.whl)
rm -f "$work"/x/vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so "$work"/x/vllm/vllm-rs \
      "$work"/x/vllm/third_party/deep_gemm/_C.cpython-31[0134]-*.so
rm -rf "$work"/x/vllm/third_party/fmha_sm100
mkdir -p "$work/bundle/deps"
echo "compressing the slimmed vllm (about 2 minutes) ..."
(cd "$work/x" && tar -cf - vllm vllm-*.dist-info | xz -T0 -6 > "$work/bundle/vllm.tar.xz")
# vllm's own requirements, less torch and what the GPU image already has (its list, KINDS.md, 2026-11-17)
python3 - "$work"/w/vllm-*.whl > "$work/req.txt" <<'PY'
import sys, zipfile, re
z = zipfile.ZipFile(sys.argv[1]); meta = [n for n in z.namelist() if n.endswith("METADATA")][0]
skip = re.compile(r"^(torch|torchaudio|torchvision|torchcodec|PyNvVideoCodec|tilelang|humming|quack|tokenspeed|"
                  r"nvidia-cutlass-dsl|fastsafetensors|instanttensor|opentelemetry|anthropic|mcp|model-hosting)", re.I)
for line in z.read(meta).decode().splitlines():
    if line.startswith("Requires-Dist:") and "extra ==" not in line:
        req = line.split(":", 1)[1].strip()
        if not skip.match(req): print(req)
PY
image="absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs certifi charset-normalizer click cloudpickle cmake colorama cuda-bindings cuda-core cuda-pathfinder cuda-toolkit einops filelock frozenlist fsspec grpcio h11 hf-xet httpcore httpx huggingface-hub idna jinja2 markupsafe msgpack multidict networkx ninja numba llvmlite numpy nvidia-ml-py packaging pillow pip prometheus-client propcache protobuf psutil py-cpuinfo pygments pyyaml regex requests rich safetensors sentencepiece setuptools shellingham six sympy mpmath tabulate tiktoken tokenizers torch tqdm transformers triton typer typing-extensions urllib3 uvloop opencv-python-headless yarl zipp"
python3 -m pip install -q --dry-run --ignore-installed "${plat[@]}" --target "$work/t" --report "$work/report.json" -r "$work/req.txt"
python3 - "$work/report.json" $image > "$work/need.txt" <<'PY'
import json, re, sys
norm = lambda s: re.sub(r"[-_.]+", "-", s).lower()
have = {norm(x) for x in sys.argv[2:]}
skip = re.compile(r"^(nvidia-|cuda-|tilelang|tokenspeed|z3-|humming|quack|torch|sentry|supervisor|fastapi-cloud|"
                  r"agent-detector|detect-installer|fastar|rignore|opentelemetry|googleapis|mcp|anthropic|fastsafetensors)")
for it in json.load(open(sys.argv[1]))["install"]:
    n, v = norm(it["metadata"]["name"]), it["metadata"]["version"]
    if n in have or (skip.match(n) and n != "nvidia-cudnn-frontend"): continue
    print(f"{n}=={v}")
# imported at engine start by vllm 0.26 but pulled in only through packages skipped above
print("flashinfer-python==0.6.14\napache-tvm-ffi==0.1.10\nnvidia-cudnn-frontend==1.28.0")
PY
echo "downloading $(wc -l < "$work/need.txt") dependency wheels ..."
python3 -m pip download -q --no-deps "${plat[@]}" -d "$work/bundle/deps" -r "$work/need.txt"
(cd "$work/bundle" && tar -cf - vllm.tar.xz deps) | split -b 55M -d -a 2 - "$out/part-"
cat > "$out/install.sh" <<'SH'
#!/bin/bash
# Device side of stage_vllm.sh. 'receive' keeps the carried part in /tmp/stage; 'install' assembles all
# parts into /tmp/site (then: export PYTHONPATH=/tmp/site).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
for step in "$@"; do case $step in
receive) mkdir -p /tmp/stage; for f in "$here"/part-*; do [ -e "$f" ] && cp "$f" /tmp/stage/; done
         echo "parts on this machine: $(ls /tmp/stage | tr '\n' ' ')";;
install) n=$(ls /tmp/stage/part-* | wc -l); want=__PARTS__
         if [ "$n" != "$want" ]; then echo "have $n of $want parts: the machine went cold between calls; send them all again"; exit 3; fi
         rm -rf /tmp/bundle /tmp/site; mkdir -p /tmp/bundle /tmp/site
         cat /tmp/stage/part-* | tar -x -C /tmp/bundle
         xz -d < /tmp/bundle/vllm.tar.xz | tar -x -C /tmp/site
         python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site /tmp/bundle/deps/*.whl
         PYTHONPATH=/tmp/site python3 -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__, 'gpus', torch.cuda.device_count())";;
*) echo "usage: install.sh receive|install ..."; exit 2;;
esac; done
SH
sed -i "s/__PARTS__/$(ls "$out"/part-* | wc -l)/" "$out/install.sh"; chmod +x "$out/install.sh"
ls -la "$out"
echo "send each part in its own device call (see the header of this script)."
