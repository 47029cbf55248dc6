#!/usr/bin/env bash
# Single-GPU SFT throughput of a LLaVA-1.5-7B-shaped model (random weights, no download):
#   bash bench/gpu_sft.sh                 # full fine-tune, bf16 weights, 8k packed rows
#   STEPS=20 MODE=lora bash bench/gpu_sft.sh
# Prints tokens/s and MFU (6·N·tokens/s over the GPU's dense bf16 peak) averaged over the
# steps after warm-up. Needs: a CUDA GPU with >= 80 GB (full) or >= 40 GB (lora), and
# `pip install -e .` with a CUDA build of torch.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false WANDB_MODE=disabled
OUT=${OUT:-/tmp/mmtune_gpu_bench}
STEPS=${STEPS:-12}
WARMUP=${WARMUP:-3}
MODE=${MODE:-full}
rm -rf "$OUT/run"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader

PEFT="peft=none"
[ "$MODE" = "lora" ] && PEFT="peft=lora_mmdu_llava"

# Vicuna-7B v1.5 text model + CLIP ViT-L/14-336 (576 tokens per image) + 2-layer MLP projector,
# trained at an 8k window with linear RoPE interpolation (x2), as the MMDU 8k runs.
python recipes/sft.py experiment=demo "$PEFT" \
  training.output_dir="$OUT/run" synthetic.out_dir="$OUT/data" \
  synthetic.n_train=$((6 * STEPS + 12)) synthetic.n_test=1 synthetic.image_size=336 \
  model.torch_dtype=bfloat16 model.attn_implementation=sdpa \
  model.architecture.text_config.hidden_size=4096 model.architecture.text_config.intermediate_size=11008 \
  model.architecture.text_config.num_hidden_layers=32 model.architecture.text_config.num_attention_heads=32 \
  model.architecture.text_config.num_key_value_heads=32 model.architecture.text_config.max_position_embeddings=4096 \
  model.architecture.vision_config.hidden_size=1024 model.architecture.vision_config.intermediate_size=4096 \
  model.architecture.vision_config.num_hidden_layers=24 model.architecture.vision_config.num_attention_heads=16 \
  model.architecture.vision_config.image_size=336 model.architecture.vision_config.patch_size=14 \
  ++model.architecture.vision_config.projection_dim=768 \
  context=8k collator.batching=packing collator.batch_size=1 collator.max_length=8192 collator.max_images_per_batch=null \
  training.mixed_precision=bf16 training.gradient_checkpointing=true training.vision.train=false \
  training.lr=1e-5 training.max_steps="$STEPS" training.warmup_ratio=0 \
  training.eval_before=false training.eval_after=false training.save_final=false \
  logging.progress_bar=true

python - "$OUT/run/metrics.jsonl" "$WARMUP" <<'PY'
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1])][int(sys.argv[2]):]
tps = statistics.mean(r["perf/tokens_per_s"] for r in rows)
mfu = [r["perf/mfu"] for r in rows if r.get("perf/mfu") is not None]
print(f"steps measured: {len(rows)}; tokens/s: {tps:.0f}; step time: "
      f"{statistics.mean(r['perf/step_time_s'] for r in rows):.2f} s; "
      + (f"MFU: {100 * statistics.mean(mfu):.1f}%" if mfu else "MFU: n/a (GPU not in the peak table)"))
PY
