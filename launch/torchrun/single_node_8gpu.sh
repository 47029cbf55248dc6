#!/usr/bin/env bash
# One node, 8 GPUs, one process per GPU started by torchrun (the engines that need no
# accelerate config: fsdp2, ddp). Infrastructure only: the run is the experiment named on
# the command line.
#
#   launch/torchrun/single_node_8gpu.sh recipes/sft.py experiment=mmdu45k_qwen2_5_vl_7b_32k
#
# Environment (optional): MASTER_PORT (default 29500), MMTUNE_DATA_ROOT, MMTUNE_CKPT_ROOT,
# MMTUNE_OUTPUT_ROOT, WANDB_*: read by the configs.
set -euo pipefail
if [[ $# -lt 1 ]]; then
    echo "usage: launch/torchrun/single_node_8gpu.sh RECIPE experiment=<name> [overrides...]" >&2
    exit 2
fi
exec torchrun --standalone --nproc_per_node 8 --master_port "${MASTER_PORT:-29500}" "$@"
