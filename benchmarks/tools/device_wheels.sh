#!/usr/bin/env bash
# Prepares what benchmarks/tools/gpu_session.sh carries to the lent GPU machine, which reaches no package registry:
#   .device-wheels/  py3.12 manylinux wheels of eagle3lab's dependencies that neither the machine's image nor
#                    the staged vLLM (benchmarks/tools/stage_vllm.sh, run it first) provides: the notebook stack
#                    (papermill, nbconvert, ipykernel, plotly, ...) and three packages `vllm serve` 0.26 imports
#                    that the staging leaves out (model_hosting_container_standards, jmespath, supervisor)
#   .device-snap/src.tgz  `git archive HEAD`: the device installs a commit, never half-edited files
# Both folders are added to .git/info/exclude. Run it here, in the project's root, after committing.
set -euo pipefail
root=$(git rev-parse --show-toplevel); cd "$root"
for d in /.device-wheels/ /.device-snap/; do grep -qx "$d" .git/info/exclude 2>/dev/null || echo "$d" >> .git/info/exclude; done
[ -f .device-stage/install.sh ] || { echo "stage vLLM first: bash benchmarks/tools/stage_vllm.sh"; exit 2; }
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
plat=(--only-binary=:all: --python-version 3.12 --implementation cp)
for p in manylinux_2_35_x86_64 manylinux_2_34_x86_64 manylinux_2_31_x86_64 manylinux_2_28_x86_64 manylinux_2_27_x86_64 \
         manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do plat+=(--platform $p); done
# what the staged vLLM brings: the wheels inside its parts
cat .device-stage/part-* | tar -t | sed -n 's|^deps/||p' | sed 's/-[0-9].*//' > "$work/staged.txt"
# eagle3lab's own dependencies, less torch and transformers (the image's builds are the ones vLLM pins)
python3 - > "$work/req.txt" <<'PY'
import re, tomllib
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
for d in deps:
    if not re.match(r"^(torch|transformers|tokenizers|safetensors)\b", d):
        print(d)
print("model_hosting_container_standards\njmespath\nsupervisor")
PY
python3 -m pip install -q --dry-run --ignore-installed "${plat[@]}" --target "$work/t" --report "$work/report.json" \
  -r "$work/req.txt"
# the image's packages (benchmarks/tools/stage_vllm.sh lists them, from KINDS.md)
image="absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs certifi charset-normalizer click cloudpickle cmake colorama cuda-bindings cuda-core cuda-pathfinder cuda-toolkit einops filelock frozenlist fsspec grpcio h11 hf-xet httpcore httpx huggingface-hub idna jinja2 markupsafe msgpack multidict networkx ninja numba llvmlite numpy nvidia-ml-py packaging pillow pip prometheus-client propcache protobuf psutil py-cpuinfo pygments pyyaml regex requests rich safetensors sentencepiece setuptools shellingham six sympy mpmath tabulate tiktoken tokenizers torch tqdm transformers triton typer typing-extensions urllib3 uvloop opencv-python-headless yarl zipp pandas pytest python-dateutil pytz tzdata"
python3 - "$work/report.json" "$work/staged.txt" $image > "$work/need.txt" <<'PY'
import json, re, sys
norm = lambda s: re.sub(r"[-_.]+", "-", s).lower()
have = {norm(x) for x in sys.argv[3:]} | {norm(x) for x in open(sys.argv[2]).read().split()}
for it in json.load(open(sys.argv[1]))["install"]:
    n, v = norm(it["metadata"]["name"]), it["metadata"]["version"]
    if n not in have and not re.match(r"^(nvidia-|cuda-|torch|triton)", n):
        print(f"{n}=={v}")
PY
rm -rf .device-wheels && mkdir -p .device-wheels .device-snap
echo "downloading $(wc -l < "$work/need.txt") wheels: $(tr '\n' ' ' < "$work/need.txt")"
python3 -m pip download -q --no-deps "${plat[@]}" -d .device-wheels -r "$work/need.txt"
git archive HEAD | gzip > .device-snap/src.tgz
du -sh .device-wheels .device-snap/src.tgz
