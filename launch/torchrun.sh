#!/usr/bin/env bash
# Continued pretraining on one node: torchrun with one process per GPU (or N CPU processes).
#
#   bash launch/torchrun.sh [--nproc-per-node N] [--dry-run] [--resume R] CONFIG [overrides]
#
# N defaults to the GPUs nvidia-smi lists (1 without a GPU). The run resumes from the newest
# checkpoint in its output_dir if that run had the same config (--resume same), so after a
# stop the same command continues; a run of another config there (other data, loss, steps)
# is refused in one line. --resume auto continues it with the changes docs/checkpoints.md
# allows (each said in one line); --resume DIR from that checkpoint.
# SIGTERM or SIGUSR1 to this script (`docker stop` sends SIGTERM to it as the container's
# first process), or a Ctrl-C, goes straight to every rank: they agree, save a checkpoint
# and exit, and this script exits 75 ("stopped, run me again"); a second Ctrl-C ends every
# rank at once; one before torchrun started the ranks stops it. The ranks are signalled
# directly because
# torchrun dies on SIGUSR1 unless told otherwise, and kills its ranks 30 s after a SIGTERM,
# which can cut a checkpoint short (DEL_SHUTDOWN_TIMEOUT raises that, default 900 s, where
# the installed torchrun allows it).
# Before starting the ranks, the script runs del-train's start-up checks once for N ranks
# (`del-train --check`): a mistake in the config, data or checkpoint is one line and status
# 2, before torchrun starts. A rank that stops later on a mistake leaves its line in a
# per-run temporary directory (DEL_USER_ERROR_DIR); the script ends with that line and
# status 2, where torchrun would report status 1. --dry-run runs `del-train --dry-run` for N
# ranks (config, memory plan, layout, every check), then prints the command.
# Environment: DEL_PYTHON (interpreter; default .venv/bin/python if present, else python3).
set -euo pipefail

nproc=""
dry_run=0
resume=same
while [ $# -gt 0 ]; do
  case $1 in
    --nproc-per-node | --nproc_per_node) nproc=$2; shift 2 ;;
    --nproc-per-node=* | --nproc_per_node=*) nproc=${1#*=}; shift ;;
    --dry-run) dry_run=1; shift ;;
    --resume) resume=${2:?--resume needs a value}; shift 2 ;;
    --resume=*) resume=${1#*=}; shift ;;
    -h | --help) sed -n '2,25p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "torchrun.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) break ;;
  esac
done
if [ $# -lt 1 ]; then
  echo "usage: bash launch/torchrun.sh [--nproc-per-node N] [--dry-run] [--resume R] CONFIG [overrides ...]" >&2
  exit 2
fi
config=$1
shift
if [ ! -f "$config" ]; then
  echo "torchrun.sh: config file not found: $config" >&2
  exit 2
fi
if [ -z "$nproc" ]; then
  nproc=$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU' || true)
  if [ "$nproc" -gt 0 ]; then
    echo "torchrun.sh: $nproc process(es), one per GPU found (--nproc-per-node N to choose)" >&2
  else
    nproc=1
    echo "torchrun.sh: no GPU found: 1 process (--nproc-per-node N to choose)" >&2
  fi
fi
case $nproc in
  '' | *[!0-9]* | 0) echo "torchrun.sh: --nproc-per-node must be a positive integer, got '$nproc'" >&2; exit 2 ;;
esac

if [ -n "${DEL_PYTHON:-}" ]; then
  python=$DEL_PYTHON
elif [ -x .venv/bin/python ]; then
  python=.venv/bin/python
else
  python=python3
fi

STOPPED=75 # del-train's exit status for "stopped on request, checkpoint saved"
launcher=("$python" -m torch.distributed.run --standalone "--nproc-per-node=$nproc")
if "$python" -m torch.distributed.run --help 2>/dev/null | grep -q -- '--shutdown[-_]timeout'; then
  launcher+=("--shutdown-timeout=${DEL_SHUTDOWN_TIMEOUT:-900}")
fi
train=(-m del_megatron.cli.train --config "$config" --resume "$resume")
command=("${launcher[@]}" "${train[@]}" "$@")
# the checks as rank 0 of N: the variables torchrun would set (and none SLURM's would)
as_rank0=(env RANK=0 LOCAL_RANK=0 "WORLD_SIZE=$nproc")

if [ "$dry_run" = 1 ]; then
  "${as_rank0[@]}" "$python" "${train[@]}" --dry-run "$@" # its status: 2 for a mistake
  printf '# command: '
  printf '%q ' "${command[@]}"
  echo
  exit 0
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} PYTHONUNBUFFERED=1
echo "torchrun.sh: checking the run for $nproc rank(s)" >&2
"${as_rank0[@]}" "$python" "${train[@]}" --check "$@" # a mistake: its one line, status 2
user_errors=$(mktemp -d "${TMPDIR:-/tmp}/del-train-errors.XXXXXX")
trap 'rm -rf "$user_errors"' EXIT
export DEL_USER_ERROR_DIR=$user_errors
echo "torchrun.sh: starting $nproc rank(s)" >&2
# torchrun and the ranks in a session of their own, so that a Ctrl-C in the terminal reaches
# this script alone, which passes it on once (torchrun would turn it into a SIGTERM and a
# traceback of its own, and the ranks would take the forwarded copy for a second Ctrl-C)
session=()
if command -v setsid >/dev/null; then session=(setsid); fi
launcher_pid=""
stop_signal=""
interrupted=0
# shellcheck disable=SC2329 # called by the traps below
forward() {
  interrupted=1
  # $!: a trap can run between the launch and `launcher_pid=$!` (torchrun is started then)
  local pid=${launcher_pid:-${!:-}}
  if [ -z "$pid" ]; then # torchrun not started: nothing to save
    echo "torchrun.sh: SIG$1 before the ranks started: nothing trained, stopping" >&2
    exit 75
  fi
  if [ "$1" = INT ] && [ "$stop_signal" = INT ]; then
    echo "torchrun.sh: SIGINT again: every rank exits at once (the last checkpoint is kept)" >&2
  else
    echo "torchrun.sh: SIG$1: every rank saves a checkpoint and stops" >&2
  fi
  stop_signal=$1
  if ! pkill "-$1" -P "$pid"; then # the ranks are torchrun's children: none yet
    # torchrun still starting: nothing trained; a TERM stops it and any rank it starts
    # (else the signal is lost and the ranks it starts next train on)
    echo "torchrun.sh: no rank started yet: stopping torchrun" >&2
    kill -TERM "$pid" 2>/dev/null || true
  fi
}
# the traps before the launch: a signal that comes while the ranks start (a Ctrl-C as soon
# as a rank says it is ready) is passed on, not taken by this script's default action (exit)
trap 'forward USR1' USR1
trap 'forward TERM' TERM
trap 'forward TERM' HUP # the terminal closed: a stop, as TERM
if [ ${#session[@]} -gt 0 ]; then trap 'forward INT' INT; fi # else the ranks get it too
"${session[@]}" "${command[@]}" &
launcher_pid=$!
while :; do
  interrupted=0
  status=0
  wait "$launcher_pid" || status=$?
  [ "$interrupted" = 1 ] || break # else wait was cut short by a signal: wait again
done
if [ "$status" != 0 ]; then
  for line in "$user_errors"/rank-*; do
    if [ -f "$line" ]; then
      cat "$line" >&2 # torchrun's report above is about this: the mistake is the last line
      exit 2
    fi
  done
fi
if [ -n "$stop_signal" ] && [ "$status" != 0 ]; then
  echo "torchrun.sh: stopped on request; run the same command again to continue" >&2
  exit "$STOPPED"
fi
exit "$status"
