#!/usr/bin/env bash
# Download (here, where PyPI is reachable) the wheels bench/gpu_checks.sh installs on the
# GPU machine: what its image lacks, for its Python 3.12, x86-64.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64 --platform any)
for spec in "megatron-core==0.16.1" "pydantic==2.14.4" "pydantic-core==2.50.5" \
            "annotated-types==0.8.0" "typing-inspection==0.4.5" "deepspeed==0.19.8" \
            "hjson==3.1.0" "py-cpuinfo==9.0.0" "ninja==1.13.2" "webdataset==1.0.2" \
            "braceexpand==0.1.7" "wandb==0.31.0"; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${platforms[@]}" -d .whl "$spec"
done
ls -la .whl
