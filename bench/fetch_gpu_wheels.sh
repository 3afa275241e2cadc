#!/usr/bin/env bash
# Fetch (here, where PyPI is reachable) the wheels bench/gpu_acceptance.sh installs on a GPU
# machine that has no network: what its image lacks, for its Python 3.12 on x86-64. The image
# has torch, transformers, safetensors, sentencepiece, tokenizers, numpy, matplotlib, pyyaml,
# tqdm, psutil; it lacks megatron-core, DeepSpeed, pydantic, webdataset and their small
# dependencies. Not fetched, because no acceptance check imports them: wandb (the checks run
# with logging.wandb=disabled), zstandard and pyarrow (data-tools reads only .jsonl there),
# math-verify (del-eval's generation path is not run), Transformer Engine (optional: the
# acceptance script reports it and uses megatron-core's local layers).
#
#   bash bench/fetch_gpu_wheels.sh        # writes .whl/ (git-ignored), prints the total
#
# DeepSpeed publishes only a source archive on PyPI (`pip download --only-binary=:all:
# deepspeed==0.19.8` finds no wheel), so its wheel is built here without compiled ops
# (DS_BUILD_OPS=0): pure Python, any platform. It needs torch importable by the interpreter
# that builds it (.venv's, else python3). DeepSpeed then picks its accelerator at run time
# (DS_ACCELERATOR, else CUDA when torch sees a GPU) and JIT-builds the ops it uses there.
set -euo pipefail
cd "$(dirname "$0")/.."
python=python3
if [ -x .venv/bin/python ]; then python=.venv/bin/python; fi
mkdir -p .whl
rm -f .whl/*.whl
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64 --platform any)
binary=(
  "megatron-core==0.16.1"
  "pydantic==2.14.4" "pydantic-core==2.50.5" "annotated-types==0.8.0" "typing-inspection==0.4.5"
  # DeepSpeed's run-time requirements that the image lacks (its METADATA Requires-Dist)
  "hjson==3.1.0" "py-cpuinfo==9.0.0" "ninja==1.13.2" "msgpack==1.1.2" "einops==0.8.1"
  "webdataset==1.0.2" "braceexpand==0.1.7"
)
for spec in "${binary[@]}"; do
  "$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${platforms[@]}" -d .whl "$spec"
done
DS_BUILD_OPS=0 "$python" -m pip wheel -q --no-deps --no-build-isolation -w .whl \
  "deepspeed==0.19.8"
ls -l .whl
wheels=(.whl/*.whl)
total=$(du -cb "${wheels[@]}" | tail -n 1 | cut -f 1)
echo "total: $(( total / 1024 )) KiB in ${#wheels[@]} wheels (limit 60 MiB)"
if [ "$total" -gt $(( 60 * 1024 * 1024 )) ]; then
  echo "fetch_gpu_wheels.sh: the wheels exceed 60 MiB" >&2
  exit 1
fi
