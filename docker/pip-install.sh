#!/usr/bin/env bash
# pip for docker/Dockerfile's two install steps, run as root during the build:
#
#   pip-install.sh dependencies   the dependencies pyproject.toml lists, nothing of the project
#   pip-install.sh project        the project (its dependencies are there by then)
#
# The base image's torch, Transformer Engine, NCCL and CUDA packages are kept: pinned exactly,
# as installed, for these installs only (the image's own PIP_CONSTRAINT file pins everything
# it ships, also packages such as packaging that our dependencies need newer, and is empty in
# some releases; NVIDIA's prerelease torch versions do not satisfy every range, and pip would
# otherwise replace them with a PyPI build).
#
# A build behind a TLS-intercepting proxy or with a private index passes BuildKit secrets,
# which exist only while these commands run and are never part of the image:
#   --secret id=ca_bundle,src=FILE   extra CA certificates (PEM), trusted besides the system's
#   --secret id=pip_conf,src=FILE    a pip configuration file: index-url, extra-index-url
#                                    (credentials may be in them), trusted-host, ...
# A proxy itself: Docker's predefined build arguments (--build-arg HTTPS_PROXY=...), which
# pip reads and docker history does not keep.
set -euo pipefail

constraints=/opt/base-constraints.txt
secrets=/run/secrets
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT

if [ -s "$secrets/ca_bundle" ]; then
  system=/etc/ssl/certs/ca-certificates.crt # Ubuntu's and Debian's bundle, NGC's too
  { if [ -f "$system" ]; then cat "$system"; fi; cat "$secrets/ca_bundle"; } >"$scratch/ca.pem"
  export PIP_CERT=$scratch/ca.pem SSL_CERT_FILE=$scratch/ca.pem REQUESTS_CA_BUNDLE=$scratch/ca.pem
fi
if [ -s "$secrets/pip_conf" ]; then
  export PIP_CONFIG_FILE=$secrets/pip_conf
fi
# the build's own pip cache (a BuildKit cache mount, kept by the builder, not in the image)
unset PIP_NO_CACHE_DIR
export PIP_CACHE_DIR=/root/.cache/pip PIP_CONSTRAINT=$constraints

case ${1:-} in
  dependencies)
    python -m pip list --format=freeze |
      grep -iE '^(torch|torchvision|triton|transformer[-_]engine[^=]*|flash[-_]attn|apex|numpy|nvidia-[^=]*)==' \
        >"$constraints" || true
    python - "$scratch/requirements.txt" <<'PY'
import sys
import tomllib

with open("pyproject.toml", "rb") as f:
    project = tomllib.load(f)["project"]
with open(sys.argv[1], "w") as out:
    out.write("\n".join(project["dependencies"]) + "\n")
PY
    python -m pip install --requirement "$scratch/requirements.txt"
    ;;
  project)
    python -m pip install .
    python -c "import del_megatron, megatron.core, deepspeed, torch; print('torch', torch.__version__)"
    ;;
  *)
    echo "usage: pip-install.sh dependencies|project" >&2
    exit 2
    ;;
esac
