# A stand-in for NVIDIA's PyTorch image (docker/Dockerfile's base), made without an image
# registry by tests/docker/engine.sh: a Debian root filesystem (debootstrap, `docker import`),
# a Python environment on PATH as `python` with torch in it, an image-wide pip constraint
# file pinning what the image ships (NGC sets PIP_CONSTRAINT so), and, as Ubuntu 24.04 (the
# OS of NGC 25.x images) ships it, a user `ubuntu` with uid 1000 unless UID_1000_USER is empty.
# No network: torch and its dependencies come from the build context (wheels/).
ARG ROOTFS
FROM ${ROOTFS}
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV PATH=/usr/local/venv/bin:$PATH \
    PIP_CONSTRAINT=/etc/pip/constraint.txt
RUN --mount=type=bind,source=wheels,target=/wheels \
    python3 -m venv /usr/local/venv \
    && PIP_CONSTRAINT='' python -m pip install --no-cache-dir --no-compile --no-index --find-links /wheels /wheels/torch-*.whl \
    && mkdir -p /etc/pip && python -m pip list --format=freeze >/etc/pip/constraint.txt
ARG UID_1000_USER=ubuntu
RUN if [ -n "$UID_1000_USER" ]; then useradd --create-home --uid 1000 --shell /bin/bash "$UID_1000_USER"; fi
WORKDIR /workspace
