#!/usr/bin/env bash
# Single-GPU SFT throughput and peak memory of a LLaVA-1.5-7B-shaped model (random weights, no
# download), once per loss path, side by side:
#   bash bench/gpu_sft.sh                         # full fine-tune, bf16 weights, 8k packed rows
#   STEPS=20 MODE=lora bash bench/gpu_sft.sh
#   LOSS_PATHS="chunked materialized" bash bench/gpu_sft.sh
# Prints, per training.loss_impl, tokens/s and MFU (6·N·tokens/s over the GPU's dense bf16
# peak) averaged over the steps after warm-up, and the peak allocated GPU memory of the
# training steps (torch.cuda.max_memory_allocated). The fused path runs when liger-kernel is
# installed (`pip install -e '.[liger]'`). Needs: a CUDA GPU with >= 80 GB (full) or >= 40 GB
# (lora), and `pip install -e .` with a CUDA build of torch.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false WANDB_MODE=disabled
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
OUT=${OUT:-/tmp/mmtune_gpu_bench}
STEPS=${STEPS:-12}
WARMUP=${WARMUP:-3}
MODE=${MODE:-full}
if [ -z "${LOSS_PATHS:-}" ]; then
  LOSS_PATHS="materialized chunked"
  python -c "import liger_kernel" 2>/dev/null && LOSS_PATHS="$LOSS_PATHS fused"
fi
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader

PEFT="peft=none"
[ "$MODE" = "lora" ] && PEFT="peft=lora_mmdu_llava"

# Vicuna-7B v1.5 text model + CLIP ViT-L/14-336 (576 tokens per image) + 2-layer MLP projector,
# trained at an 8k window with linear RoPE interpolation (x2), as the MMDU 8k runs.
OVERRIDES=(experiment=demo "$PEFT"
  synthetic.out_dir="$OUT/data"
  synthetic.n_train=$((6 * STEPS + 12)) synthetic.n_test=1 synthetic.image_size=336
  model.torch_dtype=bfloat16 model.attn_implementation=sdpa
  model.architecture.text_config.hidden_size=4096 model.architecture.text_config.intermediate_size=11008
  model.architecture.text_config.num_hidden_layers=32 model.architecture.text_config.num_attention_heads=32
  model.architecture.text_config.num_key_value_heads=32 model.architecture.text_config.max_position_embeddings=4096
  model.architecture.vision_config.hidden_size=1024 model.architecture.vision_config.intermediate_size=4096
  model.architecture.vision_config.num_hidden_layers=24 model.architecture.vision_config.num_attention_heads=16
  model.architecture.vision_config.image_size=336 model.architecture.vision_config.patch_size=14
  ++model.architecture.vision_config.projection_dim=768
  context=8k collator.batching=packing collator.batch_size=1 collator.max_length=8192 collator.max_images_per_batch=null
  training.mixed_precision=bf16 training.gradient_checkpointing=true training.vision.train=false
  training.lr=1e-5 training.max_steps="$STEPS" training.warmup_ratio=0
  training.eval_before=false training.eval_after=false training.save_final=false
  logging.progress_bar=false)

for LOSS in $LOSS_PATHS; do
  rm -rf "$OUT/run_$LOSS"
  PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" python - "$LOSS" "$WARMUP" "${OVERRIDES[@]}" \
    training.output_dir="$OUT/run_$LOSS" training.loss_impl="$LOSS" <<'PY'
import json, statistics, sys

import torch

from mmtune.training.config import to_sft_config
from mmtune.training.demo import compose_sft_config
from mmtune.training.loop import SFTRecipe

loss, warmup, overrides = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
recipe = SFTRecipe(to_sft_config(compose_sft_config(overrides)))
recipe.setup()
torch.cuda.reset_peak_memory_stats()
recipe.train()
peak = torch.cuda.max_memory_allocated() / 2**30
recipe.cleanup()
rows = [json.loads(line) for line in open(recipe.output_dir / "metrics.jsonl")][warmup:]
tps = statistics.mean(r["perf/tokens_per_s"] for r in rows)
mfu = [r["perf/mfu"] for r in rows if r.get("perf/mfu") is not None]
print(f"RESULT loss_impl={loss:<12} steps measured: {len(rows)}; tokens/s: {tps:.0f}; step time: "
      f"{statistics.mean(r['perf/step_time_s'] for r in rows):.2f} s; peak memory: {peak:.1f} GiB; "
      + (f"MFU: {100 * statistics.mean(mfu):.1f}%" if mfu else "MFU: n/a (GPU not in the peak table)"), flush=True)
PY
done 2>&1 | tee "$OUT/gpu_sft.log" | grep -E "^(RESULT|loss:|Traceback|[A-Za-z]*Error)"

# Decode throughput of the batched KV generator at B = 1, 8, 32 (same GPU, 7B-shaped LLaVA).
PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" python bench/gpu_generation.py 2>&1 | tee "$OUT/gpu_generation.log"
