#!/usr/bin/env bash
# A real two-node SLURM cluster on this one machine, for the launch tests (and CI):
# munge, slurmctld, and two slurmd daemons (`slurmd -N n1`, `-N n2`) on their own ports.
#
#   bash tests/slurm/cluster.sh install   # apt packages (Debian's Slurm 22.05), as root
#   bash tests/slurm/cluster.sh start     # write slurm.conf, start the daemons, wait for idle
#   bash tests/slurm/cluster.sh stop      # stop every daemon this script started
#
# Nodes n1 and n2 have NodeAddr=127.0.0.1 (their names do not resolve as host names, as on
# many clusters; the launch script resolves the address through scontrol). Each has one CPU,
# so a 2-node job runs one task per node.
set -euo pipefail

STATE=${SLURM_TEST_STATE:-/var/lib/del-megatron-slurm}
CONF_DIR=/etc/slurm
HOST=$(hostname -s)

install() {
  if ! command -v slurmctld >/dev/null || ! command -v sbatch >/dev/null; then
    local packages=(slurmd slurmctld slurm-client munge)
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q "${packages[@]}" >/dev/null ||
      { apt-get update -q >/dev/null && apt-get install -y -q "${packages[@]}" >/dev/null; }
  fi
}

write_conf() {
  mkdir -p "$CONF_DIR" "$STATE/ctld" "$STATE/d/n1" "$STATE/d/n2" "$STATE/log"
  cat >"$CONF_DIR/slurm.conf" <<CONF
ClusterName=del-test
SlurmctldHost=$HOST
SlurmUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
StateSaveLocation=$STATE/ctld
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdSpoolDir=$STATE/d/%n
SlurmdLogFile=$STATE/log/d-%n.log
SlurmdPidFile=$STATE/slurmd-%n.pid
SlurmctldPort=16817
MpiDefault=none
JobRequeue=1
KillWait=30
MinJobAge=600
SchedulerParameters=sched_interval=2
NodeName=n1 NodeHostname=$HOST NodeAddr=127.0.0.1 Port=17001 CPUs=1 RealMemory=4000
NodeName=n2 NodeHostname=$HOST NodeAddr=127.0.0.1 Port=17002 CPUs=1 RealMemory=4000
PartitionName=debug Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP
CONF
}

nodes_idle() {
  [ "$(sinfo -h -N -t idle -o '%N' 2>/dev/null | sort -u | tr '\n' ' ')" = "n1 n2 " ]
}

start() {
  install
  if nodes_idle; then
    echo "slurm: already up (n1, n2 idle)"
    return 0
  fi
  write_conf
  if [ ! -s /etc/munge/munge.key ]; then mungekey -c; fi
  chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
  mkdir -p /run/munge && chown munge:munge /run/munge
  if ! pgrep -x munged >/dev/null; then
    su -s /bin/sh munge -c /usr/sbin/munged
    touch "$STATE/munged-started-here"
  fi
  slurmctld
  slurmd -N n1
  slurmd -N n2
  for _ in $(seq 60); do
    if nodes_idle; then
      echo "slurm: 2 nodes idle (n1, n2)"
      return 0
    fi
    sleep 1
  done
  echo "slurm: nodes did not come up; see $STATE/log" >&2
  sinfo -N >&2 || true
  return 1
}

# Stops what start() started, nothing else: the daemons by their pid files, munged only if
# start() launched it.
stop() {
  for pidfile in "$STATE"/slurmd-*.pid "$STATE"/slurmctld.pid; do
    if [ -f "$pidfile" ]; then kill "$(cat "$pidfile")" 2>/dev/null || true; fi
  done
  if [ -f "$STATE/munged-started-here" ]; then
    kill "$(cat /run/munge/munged.pid 2>/dev/null)" 2>/dev/null || true
    rm -f "$STATE/munged-started-here"
  fi
}

case "${1:-}" in
  install) install ;;
  start) start ;;
  stop) stop ;;
  *) echo "usage: $0 install|start|stop" >&2; exit 2 ;;
esac
