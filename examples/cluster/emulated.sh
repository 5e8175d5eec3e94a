#!/bin/bash
# Rehearse a two-node job on this machine before queueing it (Linux, root): ferrorun makes two
# emulated nodes (a network namespace, address and host name each; links through a bridge, shaped
# to 1 Gbit/s), starts one agent per node inside it, and trains examples/train_mlp.py with FSDP
# on 2 nodes x 2 ranks: the same-host engine inside each node, TCP over the shaped links between
# them, checkpoints every 25 steps. Nothing is left behind when it ends (or is killed).
#
#   sudo examples/cluster/emulated.sh                       # 2 nodes x 2 ranks, 1gbit links
#   NODES=4 NPROC=1 RATE=100mbit sudo -E examples/cluster/emulated.sh --epochs 5
#   sudo examples/cluster/emulated.sh --cut-link 1@10 ...   # ferrorun options go before "--"
#
# PYTHON names the interpreter that has the ferro packages (default: python3 on PATH). Arguments
# after "--" go to train_mlp.py; those before it to ferrorun.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/../.." && pwd)
PYTHON=${PYTHON:-python3}
ferrorun_args=()
while [ "$#" -gt 0 ] && [ "$1" != "--" ]; do ferrorun_args+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
CKPT=${CKPT:-$(mktemp -d /tmp/ferro-emulated-XXXXXX)}
exec "$PYTHON" -m ferro_backend.launch --emulate-nodes "${NODES:-2}" --nproc "${NPROC:-2}" \
    --link-rate "${RATE:-1gbit}" "${ferrorun_args[@]}" "$REPO/examples/train_mlp.py" \
    --checkpoint-dir "$CKPT" --checkpoint-every 25 --no-progress "$@"
