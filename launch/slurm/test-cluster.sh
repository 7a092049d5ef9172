#!/bin/bash
# A one-node Slurm cluster on this machine, for tests/test_launch.py (Debian/Ubuntu, as root):
# installs slurm-wlm and munge from the distribution, writes a minimal slurm.conf for this host
# (all its CPUs, no GPUs, no accounting), starts munged, slurmctld and slurmd, waits until the
# node is idle. Idempotent: a second call restarts the daemons.
#
#   sudo launch/slurm/test-cluster.sh && python -m pytest -q -m slurm tests/test_launch.py
set -euo pipefail
if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null
fi
HOST=$(hostname -s)
CPUS=$(nproc)
MEM=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 1024 ))
CONF=/etc/slurm/slurm.conf
mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm /run/munge /var/lib/munge /var/log/munge
cat > "$CONF" <<CONF
ClusterName=rltrain-test
SlurmctldHost=$HOST
AuthType=auth/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
MpiDefault=none
KillWait=30
MinJobAge=600
NodeName=$HOST CPUs=$CPUS RealMemory=$MEM State=UNKNOWN
PartitionName=debug Nodes=$HOST Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
CONF
[ -s /etc/munge/munge.key ] || { mkdir -p /etc/munge; dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key status=none; }
chown -R munge:munge /etc/munge /run/munge /var/lib/munge /var/log/munge 2>/dev/null || true
chmod 400 /etc/munge/munge.key
pkill -x slurmd 2>/dev/null || true
pkill -x slurmctld 2>/dev/null || true
pkill -x munged 2>/dev/null || true
sleep 1
if id munge >/dev/null 2>&1; then runuser -u munge -- munged; else munged --force; fi
slurmctld
slurmd
for _ in $(seq 60); do
    if sinfo -h -o %T 2>/dev/null | grep -q idle; then
        sinfo
        exit 0
    fi
    sleep 1
done
echo "test-cluster: the node did not become idle; logs in /var/log/slurm" >&2
tail -20 /var/log/slurm/slurmctld.log /var/log/slurm/slurmd.log >&2 || true
exit 1
