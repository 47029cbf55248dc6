#!/usr/bin/env bash
# Started by launch/slurm/sft.sbatch once per node (srun): turns slurm's variables into
# accelerate's multi-node rendezvous arguments and starts the node's GPU workers.
# Arguments are passed to the recipe unchanged (e.g. experiment=table5_mmdu45k_8k).
set -euo pipefail

: "${SLURM_NNODES:?run this through srun inside a slurm job (SLURM_NNODES is unset)}"
: "${SLURM_NODEID:?run this through srun inside a slurm job (SLURM_NODEID is unset)}"
: "${MASTER_ADDR:?MASTER_ADDR is unset: sft.sbatch sets it from scontrol show hostnames}"
: "${MASTER_PORT:?MASTER_PORT is unset}"

GPUS_PER_NODE="${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}"
NUM_PROCESSES=$((SLURM_NNODES * GPUS_PER_NODE))
# Extra accelerate options, split on spaces (e.g. "--deepspeed_config_file launch/deepspeed/zero2.json").
read -r -a EXTRA <<< "${ACCELERATE_EXTRA_ARGS:-}"

# The command line given to accelerate wins over the values in the config file, so the
# same accelerate config serves any node count.
exec accelerate launch \
    --config_file "${ACCELERATE_CONFIG:-launch/accelerate/multi_node_zero3.yaml}" \
    --num_machines "$SLURM_NNODES" \
    --machine_rank "$SLURM_NODEID" \
    --num_processes "$NUM_PROCESSES" \
    --main_process_ip "$MASTER_ADDR" \
    --main_process_port "$MASTER_PORT" \
    "${EXTRA[@]}" \
    "${RECIPE:-recipes/sft.py}" "$@"
