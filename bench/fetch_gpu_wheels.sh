#!/usr/bin/env bash
# Fetch (here, where PyPI is reachable) the wheels bench/gpu_acceptance.sh installs on a GPU
# machine that has no network: what its image may lack, for each Python the project supports
# (3.11-3.13) on x86-64, since the image's Python is not known here. The image has torch,
# transformers, safetensors, sentencepiece, tokenizers, numpy, matplotlib, pyyaml, tqdm and
# psutil (IMAGE below); it may lack megatron-core, DeepSpeed, pydantic, webdataset, their
# small dependencies, or have a typing-extensions or packaging older than they need. Not
# fetched, because no acceptance check imports them: wandb (the checks run with
# logging.wandb=disabled), zstandard and pyarrow (data-tools reads only .jsonl there),
# math-verify (del-eval's generation path is not run), Transformer Engine (optional: the
# acceptance script records it and uses megatron-core's local layers).
#
#   bash bench/fetch_gpu_wheels.sh        # writes .whl/ (git-ignored), prints the total
#
# The end checks that every wheel's own requirements are met, for each Python, by a wheel
# here or by the image: what pip on the GPU machine resolves offline (bench/gpu_acceptance.py,
# check install). DeepSpeed publishes only a source archive on PyPI, so its wheel is built
# here without compiled ops (DS_BUILD_OPS=0): pure Python, any platform. It needs torch
# importable by the interpreter that builds it (.venv's, else python3). DeepSpeed then picks
# its accelerator at run time and JIT-builds the ops it uses there.
set -euo pipefail
cd "$(dirname "$0")/.."
python=python3
if [ -x .venv/bin/python ]; then python=.venv/bin/python; fi
mkdir -p .whl
rm -f .whl/*.whl
pythons=(3.11 3.12 3.13)
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64 --platform any)
binary=(
  "megatron-core==0.16.1" "packaging==26.4"
  "pydantic==2.14.4" "pydantic-core==2.50.5" "annotated-types==0.8.0" "typing-inspection==0.4.5"
  "typing-extensions==4.16.0"
  # DeepSpeed's run-time requirements that the image lacks (its METADATA Requires-Dist)
  "hjson==3.1.0" "py-cpuinfo==9.0.0" "ninja==1.13.2" "msgpack==1.2.4" "einops==0.8.2"
  "webdataset==1.0.2" "braceexpand==0.1.7"
)
for version in "${pythons[@]}"; do
  for spec in "${binary[@]}"; do
    "$python" -m pip download -q --no-deps --only-binary=:all: --python-version "$version" \
      --implementation cp "${platforms[@]}" -d .whl "$spec"
  done
done
DS_BUILD_OPS=0 "$python" -m pip wheel -q --no-deps --no-build-isolation -w .whl \
  "deepspeed==0.19.8"
"$python" - "${pythons[@]}" <<'EOF'
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

IMAGE = {"torch", "transformers", "safetensors", "sentencepiece", "tokenizers", "numpy",
         "matplotlib", "pyyaml", "tqdm", "psutil"}
wheels = [(p, *parse_wheel_filename(p.name)) for p in sorted(Path(".whl").glob("*.whl"))]
carried = {name for _, name, *_ in wheels}
problems = []
for python in sys.argv[1:]:
    nodot = int(python.replace(".", ""))
    marker_env = {"python_version": python, "python_full_version": f"{python}.0",
                  "sys_platform": "linux", "platform_system": "Linux", "os_name": "posix",
                  "platform_machine": "x86_64", "implementation_name": "cpython",
                  "platform_python_implementation": "CPython", "extra": ""}
    for name in sorted(carried):
        fits = [path for path, n, _, _, tags in wheels if n == name and any(
            t.interpreter in ("py3", f"cp{nodot}") or (t.abi == "abi3" and
                                                       int(t.interpreter[2:]) <= nodot)
            for t in tags)]
        if not fits:
            problems.append(f"{name}: no wheel for Python {python}")
            continue
        with zipfile.ZipFile(fits[0]) as wheel:
            meta = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
            requires = Parser().parsestr(wheel.read(meta).decode()).get_all("Requires-Dist", [])
        for requirement in map(Requirement, requires):
            needed = requirement.marker is None or requirement.marker.evaluate(marker_env)
            known = canonicalize_name(requirement.name) in carried | IMAGE
            if needed and not known:
                problems.append(f"{name} needs {requirement} (Python {python}): not carried")
print("\n".join(problems) or f"every wheel's requirements met for Python {sys.argv[1:]}")
sys.exit(1 if problems else 0)
EOF
ls -l .whl
wheels=(.whl/*.whl)
total=$(du -cb "${wheels[@]}" | tail -n 1 | cut -f 1)
echo "total: $(( total / 1024 )) KiB in ${#wheels[@]} wheels (limit 60 MiB)"
if [ "$total" -gt $(( 60 * 1024 * 1024 )) ]; then
  echo "fetch_gpu_wheels.sh: the wheels exceed 60 MiB" >&2
  exit 1
fi
