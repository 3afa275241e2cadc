#!/usr/bin/env bash
# A real Docker engine on this machine and the images of the container test
# (tests/docker/test_container.py); CI (.ci/run) starts `prepare` in the background before
# the main job, so its downloads overlap that work, and the test's own `prepare` waits for it.
#
#   bash tests/docker/engine.sh start     # Debian's docker.io, docker-compose and debootstrap
#                                         # installed, dockerd started, where missing (root)
#   bash tests/docker/engine.sh prepare   # start, then the images, each kept on this machine:
#     del-megatron-test/rootfs:bookworm-KEY   debootstrap (minbase, Python, a C++ compiler as
#                                             NGC images have), docker import: no registry
#     del-megatron-test/standin:uid1000       tests/docker/standin.Dockerfile on it, a stand-in
#     del-megatron-test/standin:no-uid1000    for NGC's PyTorch image with / without uid 1000
#     del-megatron-test/image:uid1000         docker/Dockerfile on each, with this machine's CA
#     del-megatron-test/image:no-uid1000      bundle and a pip config as BuildKit secrets
#     and DeepSpeed's CPU communication op compiled into $STATE for the test's user: the
#     first del-train of a container compiles it otherwise (minutes on two cores)
#   bash tests/docker/engine.sh env       # what the test reads: docker=, state=, user=, ...
#   bash tests/docker/engine.sh stop      # stop dockerd if `start` started it
#
# $DEL_DOCKER_STATE keeps dockerd's log, the build logs, the secrets given to the build, the
# compiled op and `timings` (seconds per phase of the last prepare); default
# /var/lib/del-megatron-docker for root, else ~/.cache/del-megatron-docker.
set -euo pipefail
cd "$(dirname "$0")/../.."

if [ "$(id -u)" = 0 ]; then
  STATE=${DEL_DOCKER_STATE:-/var/lib/del-megatron-docker}
  TEST_USER=4242:4242 # a caller who is not root, and has no name in the image
else
  STATE=${DEL_DOCKER_STATE:-${XDG_CACHE_HOME:-$HOME/.cache}/del-megatron-docker}
  TEST_USER=$(id -u):$(id -g)
fi
EXTENSIONS=$STATE/torch-extensions-${TEST_USER%%:*}
REPO=del-megatron-test
SUITE=bookworm
INCLUDE=python3-venv,python3-dev,g++,ca-certificates,procps
ROOTFS=$REPO/rootfs:$SUITE-$(echo "$SUITE $INCLUDE" | sha256sum | cut -c1-12)
export DOCKER_BUILDKIT=1

say() { echo "docker: $*" >&2; }

# A client that builds with BuildKit (docker/Dockerfile needs RUN --mount): one with the buildx
# plugin, or one older than 23 (its own BuildKit with DOCKER_BUILDKIT=1), as Debian's docker.io
# ships beside its dockerd; a newer client without buildx has only the legacy builder.
client() {
  local candidate major
  for candidate in docker /usr/bin/docker; do
    command -v "$candidate" >/dev/null || continue
    if "$candidate" buildx version >/dev/null 2>&1; then echo "$candidate" && return 0; fi
    major=$("$candidate" --version 2>/dev/null | sed -n 's/^Docker version \([0-9]*\)\..*/\1/p')
    if [ -n "$major" ] && [ "$major" -lt 23 ]; then echo "$candidate" && return 0; fi
  done
  return 1
}

install() {
  [ "$(id -u)" = 0 ] || return 0 # packages and dockerd are root's; a user's engine is used as it is
  local packages=()
  command -v dockerd >/dev/null && client >/dev/null || packages+=(docker.io)
  command -v docker-compose >/dev/null || packages+=(docker-compose)
  command -v debootstrap >/dev/null || packages+=(debootstrap)
  if [ ${#packages[@]} -gt 0 ]; then
    export DEBIAN_FRONTEND=noninteractive
    mkdir -p "$STATE"
    apt-get install -y -q "${packages[@]}" >>"$STATE/apt.log" 2>&1 ||
      { apt-get update -q >>"$STATE/apt.log" 2>&1 && apt-get install -y -q "${packages[@]}" >>"$STATE/apt.log" 2>&1; } ||
      { tail -n 20 "$STATE/apt.log" >&2; return 1; }
  fi
}

start() {
  install
  local docker
  docker=$(client)
  if "$docker" info >/dev/null 2>&1; then
    say "engine answers"
    return 0
  fi
  mkdir -p "$STATE"
  # without prepare's lock (fd 9): a dockerd holding it would keep every later prepare (the
  # test's, after CI's in the background) waiting on it for as long as the engine runs; in
  # its own session: a prepare stopped with its process group (the test's timeout) leaves
  # the engine to `stop`
  setsid dockerd --pidfile "$STATE/dockerd.pid" >>"$STATE/dockerd.log" 2>&1 9>&- &
  touch "$STATE/dockerd-started-here"
  for _ in $(seq 120); do
    if "$docker" info >/dev/null 2>&1; then
      say "dockerd started (log: $STATE/dockerd.log)"
      return 0
    fi
    sleep 0.5
  done
  say "dockerd did not answer within 60 s; see $STATE/dockerd.log"
  return 1
}

stop() {
  if [ -f "$STATE/dockerd-started-here" ] && [ -f "$STATE/dockerd.pid" ]; then
    kill "$(cat "$STATE/dockerd.pid")" 2>/dev/null || true
  fi
  rm -f "$STATE/dockerd-started-here"
}

# seconds since $1 into $STATE/timings as "$2 SECONDS"
timed() {
  local name=$1 began=$SECONDS
  shift
  "$@"
  echo "$name $((SECONDS - began))" >>"$STATE/timings.new"
}

rootfs() {
  if "$docker" image inspect "$ROOTFS" >/dev/null 2>&1; then return 0; fi
  local dir=$STATE/rootfs
  rm -rf "$dir"
  say "debootstrap $SUITE (minbase + $INCLUDE) into $dir"
  debootstrap --variant=minbase "--include=$INCLUDE" "$SUITE" "$dir" >"$STATE/debootstrap.log" 2>&1 ||
    { tail -n 20 "$STATE/debootstrap.log" >&2; return 1; }
  rm -rf "$dir"/var/cache/apt/archives/*.deb "$dir"/var/lib/apt/lists/*
  tar -C "$dir" -c . | "$docker" import - "$ROOTFS" >/dev/null
  rm -rf "$dir"
}

# torch and its dependencies for the stand-in, from this machine's pip (its configured
# find-links directory holds the CPU build): launch/setup_env.sh's pin
wheels() {
  local pin
  pin=$(grep -o 'torch==[0-9][0-9.]*' launch/setup_env.sh | head -n 1)
  mkdir -p "$STATE/standin"
  if [ "$(cat "$STATE/standin/pin" 2>/dev/null)" != "$pin" ]; then
    rm -rf "$STATE/standin/wheels"
    python3 -m pip download --quiet --dest "$STATE/standin/wheels" "$pin" 2>&1 |
      grep -v 'is ignored: it is neither a file nor a directory' >&2 || true
    ls "$STATE"/standin/wheels/torch-* >/dev/null
    echo "$pin" >"$STATE/standin/pin"
  fi
}

build() {
  local tag=$1 log=$STATE/build-${1//[:\/]/-}.log
  shift
  if ! "$docker" build --progress=plain -t "$tag" "$@" >"$log" 2>&1; then
    tail -n 40 "$log" >&2
    say "building $tag failed; the whole log: $log"
    return 1
  fi
}

# The secrets of the build: this machine's CA bundle (the one pip is configured with: here a
# TLS-intercepting proxy's CA is in it) and a pip config naming an extra index that does not
# exist, with a token the test looks for in the image (pip only warns about such an index).
secrets() {
  local ca=${PIP_CERT:-$(python3 -m pip config get global.cert 2>/dev/null || true)}
  secret_args=()
  if [ -n "$ca" ] && [ -s "$ca" ]; then
    cp "$ca" "$STATE/ca_bundle.pem"
    secret_args+=(--secret "id=ca_bundle,src=$STATE/ca_bundle.pem")
  else
    rm -f "$STATE/ca_bundle.pem"
  fi
  if [ ! -s "$STATE/pip.conf" ]; then
    local token
    token=$(od -An -N12 -tx1 /dev/urandom | tr -d ' \n')
    printf '[global]\nextra-index-url = file:///nonexistent/del-secret-%s/simple\n' "$token" \
      >"$STATE/pip.conf"
  fi
  secret_args+=(--secret "id=pip_conf,src=$STATE/pip.conf")
}

# DeepSpeed's CPU accelerator compiles its shared-memory all-reduce (a torch extension) at the
# first init_distributed of each container, unless TORCH_EXTENSIONS_DIR holds it already
warm_ops() {
  mkdir -p "$EXTENSIONS"
  if [ "$(id -u)" = 0 ]; then chown "$TEST_USER" "$EXTENSIONS"; fi
  # a build killed midway leaves torch's lock file, on which every later load waits forever;
  # nothing else uses this directory while prepare holds its lock
  rm -f "$EXTENSIONS"/*/lock
  "$docker" run --rm --user "$TEST_USER" -v "$EXTENSIONS:/del-cache" \
    -e TORCH_EXTENSIONS_DIR=/del-cache -e DS_ACCELERATOR=cpu "$REPO/image:uid1000" \
    python -c "from deepspeed.accelerator import get_accelerator as a
a().create_op_builder('ShareMemCommBuilder').load()" >"$STATE/ops.log" 2>&1 ||
    { tail -n 20 "$STATE/ops.log" >&2; return 1; }
}

prepare() {
  mkdir -p "$STATE"
  exec 9>"$STATE/prepare.lock"
  # one prepare at a time: CI's in the background, then the test's
  if ! flock -n 9; then
    say "waiting for the prepare already running (lock: $STATE/prepare.lock; its phases so far: $(tr '\n' ' ' 2>/dev/null <"$STATE/timings.new"))"
    flock 9
  fi
  : >"$STATE/timings.new"
  timed engine start
  docker=$(client)
  timed rootfs rootfs
  timed wheels wheels
  local kind user
  for kind in uid1000 no-uid1000; do
    user=ubuntu
    [ "$kind" = uid1000 ] || user=
    timed "standin-$kind" build "$REPO/standin:$kind" -f tests/docker/standin.Dockerfile \
      --build-arg "ROOTFS=$ROOTFS" --build-arg "UID_1000_USER=$user" "$STATE/standin"
  done
  secrets
  for kind in uid1000 no-uid1000; do
    timed "image-$kind" build "$REPO/image:$kind" -f docker/Dockerfile "${secret_args[@]}" \
      --build-arg "BASE_IMAGE=$REPO/standin:$kind" .
  done
  timed ops warm_ops
  mv "$STATE/timings.new" "$STATE/timings"
  say "images ready: $REPO/image:uid1000, $REPO/image:no-uid1000 (seconds: $(tr '\n' ' ' <"$STATE/timings"))"
}

case "${1:-}" in
  install) install ;;
  start) start ;;
  prepare) prepare ;;
  env) printf 'docker=%s\nstate=%s\nuser=%s\nextensions=%s\nrepo=%s\n' \
    "$(client || echo docker)" "$STATE" "$TEST_USER" "$EXTENSIONS" "$REPO" ;;
  stop) stop ;;
  *) echo "usage: $0 install|start|prepare|env|stop" >&2; exit 2 ;;
esac
