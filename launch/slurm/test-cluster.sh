#!/bin/bash
# A one-node Slurm cluster on this machine, for tests/test_launch.py (Debian/Ubuntu, as root).
#
#   launch/slurm/test-cluster.sh            install slurm-wlm and munge if missing, start the cluster
#   launch/slurm/test-cluster.sh --stop     stop the daemons this script started
#   launch/slurm/test-cluster.sh --force    take over a machine that has a Slurm configuration
#
# It refuses where Slurm is already configured or running (a real cluster's node) unless
# --force: it writes /etc/slurm/slurm.conf and gres.conf, marked as its own, and a later call
# only replaces files with that mark. It stops only the daemons it started (their pid files are
# in /run/rltrain-test-cluster). Its node is the machine as `slurmd -C` sees it, with Slurm
# pinning each task to its CPUs (task/affinity) and memory as a consumable resource, and
# declares GPUS fake GPUs (default 4; a GRES of character devices) so that --gpus-per-node
# allocations, CUDA_VISIBLE_DEVICES and ranks-per-node from GPUs are exercised on a CPU machine.
set -euo pipefail
MARK="# written by rltrain launch/slurm/test-cluster.sh"
STATE=/run/rltrain-test-cluster
CONF=/etc/slurm/slurm.conf
GRES=/etc/slurm/gres.conf
GPUS=${GPUS:-4}
FORCE=0
case "${1:-}" in
    --stop)
        for d in slurmd slurmctld munged; do
            pid=$(cat "$STATE/$d.pid" 2>/dev/null || true)
            if [ -n "$pid" ] && kill "$pid" 2>/dev/null; then
                echo "test-cluster: stopped $d ($pid)"
            fi
            rm -f "$STATE/$d.pid"
        done
        exit 0
        ;;
    --force) FORCE=1 ;;
    "") ;;
    *) echo "usage: $0 [--stop|--force]" >&2; exit 2 ;;
esac

ours() { [ -s "$STATE/$1.pid" ] && [ "$(cat "$STATE/$1.pid")" = "$(pgrep -x -o "$1" || true)" ]; }
if [ "$FORCE" != 1 ]; then
    for f in "$CONF" "$GRES"; do
        if [ -e "$f" ] && ! grep -qF "$MARK" "$f"; then
            echo "test-cluster: $f exists and is not this script's: this looks like a real Slurm node." >&2
            echo "test-cluster: run the Slurm tests against it as it is, or pass --force to replace it." >&2
            exit 1
        fi
    done
    for d in slurmctld slurmd; do
        if pgrep -x "$d" >/dev/null && ! ours "$d"; then
            echo "test-cluster: a $d this script did not start is running; stop it or pass --force." >&2
            exit 1
        fi
    done
fi

if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null
fi
mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm /run/munge /var/lib/munge \
    /var/log/munge "$STATE"

HOST=$(hostname -s)
# The node as slurmd sees the hardware (sockets, cores, threads, memory), less 1 GiB of memory
# for the system, plus the fake GPUs.
NODE=$(slurmd -C | head -n 1 | sed -E "s/^NodeName=[^ ]+/NodeName=$HOST/")
MEM=$(echo "$NODE" | sed -E 's/.*RealMemory=([0-9]+).*/\1/')
NODE=$(echo "$NODE" | sed -E "s/RealMemory=[0-9]+/RealMemory=$((MEM - 1024))/")
for ((i = 0; i < GPUS; i++)); do
    # Character devices (those of /dev/null) stand for GPUs: Slurm only needs files to hand out.
    [ -e "/dev/rltrain-fake-gpu$i" ] || mknod "/dev/rltrain-fake-gpu$i" c 1 3
done
cat > "$CONF" <<CONF
$MARK
ClusterName=rltrain-test
SlurmctldHost=$HOST
AuthType=auth/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
ProctrackType=proctrack/linuxproc
TaskPlugin=task/affinity
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
GresTypes=gpu
ReturnToService=2
MpiDefault=none
KillWait=30
MinJobAge=600
JobRequeue=1
# A requeued job waits this long before it may start again (120 s by default).
AuthInfo=cred_expire=30
$NODE Gres=gpu:$GPUS State=UNKNOWN
PartitionName=debug Nodes=$HOST Default=YES MaxTime=INFINITE State=UP
CONF
{
    echo "$MARK"
    echo "NodeName=$HOST Name=gpu File=/dev/rltrain-fake-gpu[0-$((GPUS - 1))]"
} > "$GRES"

[ -s /etc/munge/munge.key ] || { mkdir -p /etc/munge; dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key status=none; }
chown -R munge:munge /etc/munge /run/munge /var/lib/munge /var/log/munge 2>/dev/null || true
chmod 400 /etc/munge/munge.key
for d in slurmd slurmctld; do
    if ours "$d"; then kill "$(cat "$STATE/$d.pid")"; fi
done
[ "$FORCE" = 1 ] && { pkill -x slurmd || true; pkill -x slurmctld || true; }
sleep 1
if ! pgrep -x munged >/dev/null; then  # a munged already running is used, and left running
    if id munge >/dev/null 2>&1; then runuser -u munge -- munged; else munged --force; fi
    pgrep -x -n munged > "$STATE/munged.pid"
fi
slurmctld
slurmd
for _ in $(seq 60); do
    if sinfo -h -o %T 2>/dev/null | grep -q idle; then
        sinfo -o "%P %N %T %c %m %G"
        exit 0
    fi
    sleep 1
done
echo "test-cluster: the node did not become idle; logs in /var/log/slurm" >&2
tail -20 /var/log/slurm/slurmctld.log /var/log/slurm/slurmd.log >&2 || true
exit 1
