#!/usr/bin/env bash
# Container entrypoint of docker/Dockerfile: a working environment for any user id, then the
# command. Works under plain `docker run`, with torchrun as the command, in
# docker/compose.yaml, and under SLURM through pyxis/enroot (`srun --container-image`, which
# runs the command as given and this script only with --container-entrypoint).
#
#   (no command)            del-train --help
#   --config FILE ...       del-train --config FILE ...  (a command starting with an option)
#   anything else           run as given: del-train, del-convert, data-tools, torchrun, bash
#
# Environment it settles, without overriding what the caller set:
#   HOME   writable: `docker run --user UID` and enroot start with a HOME that the user cannot
#          write (or none); caches of transformers, torch, Triton and wandb live under it, so
#          it becomes /tmp/del-home-UID.
#   USER   set when the user id has no name in the image (getpass.getuser(), which torch's
#          compile caches call, fails otherwise).
set -euo pipefail

uid=$(id -u)
if [ -z "${HOME:-}" ] || [ ! -d "$HOME" ] || [ ! -w "$HOME" ]; then
  HOME=/tmp/del-home-$uid
  mkdir -p "$HOME"
  export HOME
fi
if [ -z "${USER:-}" ]; then
  # `id -un` of a uid without a name prints the number and fails: not a name
  USER=$(id -un 2>/dev/null) || USER=user$uid
  export USER
fi

if [ $# -eq 0 ]; then
  set -- del-train --help
elif [ "${1#-}" != "$1" ]; then
  set -- del-train "$@"
fi
exec "$@"
