"""Dry run of a training or evaluation run, or of a whole sweep (same as `mmtune plan`).

    python recipes/plan.py experiment=table5_mmdu45k_8k --accelerate-config launch/accelerate/single_node_8gpu_zero3.yaml
    python recipes/plan.py --sweep launch/sweeps/table5.yaml --gpu h100

Resolves the Hydra config without loading weights and prints model and parameter counts,
data sources and counts, mixture, context, LoRA or full, ZeRO stage, optimizer steps,
estimated tokens, GPU-hours and memory per GPU. The work happens in mmtune.training.plan.
"""

import sys

from mmtune.training.plan import main

if __name__ == "__main__":
    sys.exit(main())
