#!/bin/bash
# Simulate a multi-node job on one machine: NODES torchrun agents with node ranks 0..NODES-1
# and a c10d rendezvous on 127.0.0.1, each with NPROC ranks (and so its own engine, started by
# its local rank 0), as srun would start them on NODES machines.
#
#   launch/local-multinode.sh NODES NPROC configs/<recipe>.yaml [key=value ...]
#
# Exits with the first non-zero status of the agents (all are stopped then).
set -euo pipefail
NODES=${1:?usage: launch/local-multinode.sh NODES NPROC CONFIG [key=value ...]}
NPROC=${2:?usage: launch/local-multinode.sh NODES NPROC CONFIG [key=value ...]}
CONFIG=${3:?usage: launch/local-multinode.sh NODES NPROC CONFIG [key=value ...]}
shift 3
PORT=${RLTRAIN_RDZV_PORT:-$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true' EXIT
for ((node = 0; node < NODES; node++)); do
    torchrun --nnodes="$NODES" --node-rank="$node" --nproc-per-node="$NPROC" \
        --rdzv-backend=c10d --rdzv-endpoint="127.0.0.1:$PORT" --rdzv-id="local-$PORT" \
        --max-restarts="${RLTRAIN_MAX_RESTARTS:-0}" \
        -m rltrain --config "$CONFIG" "$@" &
    pids+=($!)
done
status=0
for pid in "${pids[@]}"; do
    if ! wait -n; then
        status=1
        break
    fi
done
if [ "$status" -ne 0 ]; then
    echo "local-multinode: an agent failed; stopping the others" >&2
    exit 1
fi
trap - EXIT
