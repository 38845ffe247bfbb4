#!/usr/bin/env bash
# One rank of an emulated MPI node (scripts/gpu-check.sh nodes): MPICH's fork launcher with named hosts starts
# every rank on this machine, and MPI sees the hosts as nodes; this gives each node its own NCCL_HOSTID (NCCL
# then treats the nodes as separate hosts and connects them through its network transport, not P2P or shared
# memory) and each rank its own GPU: the PMI_RANK-th of CUDA_VISIBLE_DEVICES (default: of 0, 1, 2, ...).
#
#   mpiexec -launcher fork -hosts nodeA:1,nodeB:1 -n 2 scripts/node-rank.sh COMMAND [ARGS...]
set -eu
if [ -z "${PMI_RANK:-}" ] || [ -z "${PMI_HOSTNAME:-}" ]; then
  echo "node-rank.sh: run it under MPICH's mpiexec with named hosts (PMI_RANK and PMI_HOSTNAME are unset)" >&2
  exit 2
fi
export NCCL_HOSTID="mpigpu-$PMI_HOSTNAME"
if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
  IFS=, read -r -a gpus <<<"$CUDA_VISIBLE_DEVICES"
  if [ "$PMI_RANK" -ge "${#gpus[@]}" ]; then
    echo "node-rank.sh: rank $PMI_RANK, but CUDA_VISIBLE_DEVICES lists ${#gpus[@]} GPU(s)" >&2
    exit 2
  fi
  export CUDA_VISIBLE_DEVICES="${gpus[$PMI_RANK]}"
else
  export CUDA_VISIBLE_DEVICES="$PMI_RANK"
fi
exec "$@"
