#!/usr/bin/env bash
# Single-GPU SFT throughput and peak memory of 7B-shaped models with their real vocabularies
# (random weights, no download), once per loss path, side by side, then batched decode:
#   bash bench/gpu_sft.sh                      # LLaVA-1.5-7B (vocab 32,064) and XComposer2-VL-7B (92,544)
#   STEPS=8 MODE=lora bash bench/gpu_sft.sh
#   FAMILIES=llava LOSS_PATHS=chunked,materialized bash bench/gpu_sft.sh
# Per family one process (bench/gpu_sft.py) builds the model once, prints the shapes it runs
# with (output head included), and runs the training loop on 8k packed rows (bf16 autocast,
# gradient checkpointing, full fine-tune or LoRA) for every training.loss_impl in turn: tokens/s,
# step time and MFU (6·N·tokens/s over the GPU's dense bf16 peak) averaged over the measured
# steps after warm-up, and the peak allocated GPU memory of those steps
# (torch.cuda.max_memory_allocated). The fused path runs when liger-kernel is installed
# (`pip install -e '.[liger]'`). Needs: a CUDA GPU with >= 80 GB (full) or >= 40 GB (lora), and
# `pip install -e .` with a CUDA build of torch. The one-table check that fits in minutes is
# bench/gpu_check.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false WANDB_MODE=disabled
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
WORK=${WORK:-/tmp/mmtune_gpu_bench}
STEPS=${STEPS:-8}
WARMUP=${WARMUP:-2}
MODE=${MODE:-full}
FAMILIES=${FAMILIES:-llava internlm_xcomposer2}
LOSS_PATHS=${LOSS_PATHS:-materialized,chunked,fused}  # fused is skipped, with the reason, without Liger
mkdir -p "$WORK"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader

for FAMILY in $FAMILIES; do
  PEFT=full
  if [ "$MODE" = "lora" ]; then
    PEFT=lora
    [ "$FAMILY" = "llava" ] && PEFT=lora_mmdu_llava  # r 128 / alpha 256, as the public MMDU LLaVA script
  fi
  rm -rf "$WORK/$FAMILY"
  python bench/gpu_sft.py --family "$FAMILY" --losses "$LOSS_PATHS" --attention sdpa --steps "$STEPS" \
    --warmup "$WARMUP" --peft "$PEFT" --work "$WORK/$FAMILY"
done 2>&1 | tee "$WORK/gpu_sft.log" | grep -E "^(RESULT|[a-z0-9_]+_full_vocab:|loss:|Traceback|[A-Za-z]*Error)"

# Decode throughput of the batched KV generator at B = 1, 8, 32 (same GPU, 7B-shaped LLaVA, vocab 32,064).
python bench/gpu_generation.py 2>&1 | tee "$WORK/gpu_generation.log"
