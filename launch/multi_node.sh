#!/usr/bin/env bash
# Several nodes without a scheduler: run this on every node, same overrides everywhere.
#   node 0:  NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 launch/multi_node.sh experiment=qwen3_8b data.path=... topology.num_target_ranks=4
#   node 1:  NNODES=2 NODE_RANK=1 MASTER_ADDR=node0 launch/multi_node.sh experiment=qwen3_8b data.path=... topology.num_target_ranks=4
# torchrun's c10d rendezvous runs on MASTER_ADDR:MASTER_PORT (node 0); every node starts NPROC ranks
# (default: its GPU count). Ranks of one node are consecutive, so the topology spreads target ranks
# evenly over the nodes and pairs every drafter with a target of its own node (shm ring there with
# transport.kind=auto); only the drafters' gradient all-reduce crosses nodes.
set -euo pipefail
: "${NNODES:?set NNODES (number of nodes)}"
: "${NODE_RANK:?set NODE_RANK (0 on the rendezvous node)}"
: "${MASTER_ADDR:?set MASTER_ADDR (host name or address of node 0)}"
MASTER_PORT="${MASTER_PORT:-29500}"
source "$(dirname "$0")/env.sh"
NPROC="${NPROC:-$(nvidia-smi -L 2>/dev/null | wc -l)}"
[ "$NPROC" -ge 1 ] || NPROC=2
# TORCHRUN may name another launcher command, e.g. "python -m torch.distributed.run".
read -r -a LAUNCHER <<< "${TORCHRUN:-torchrun}"
run_agent "${LAUNCHER[@]}" --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$NPROC" \
    --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "${RDZV_ID:-dflash_mp}" \
    -m dflash_mp.main "$@"
