#!/usr/bin/env bash
# One prepared GPU check, under 8 minutes on one H200, that prints ONE table:
#   bash bench/gpu_check.sh                   # OUT=/some/dir also writes gpu_check.md (and the log) there
#   GPU_CHECK_DRY=1 bash bench/gpu_check.sh   # the same code paths, tiny model, on CPU (a minute or two)
# Rows: a LLaVA-1.5-7B-shaped model with its real 32,064-entry vocabulary (random weights, no
# download; bench/seven_b.py) trained by the SFT loop, full fine-tune, bf16, 8k packed rows,
# gradient checkpointing: every loss path with SDPA (tokens/s, peak allocated memory), then the
# `auto` loss with flash-attention where it is installed (bench/gpu_sft.py, one process, the
# model built once); then batched decode tokens/s at B = 1, 8, 32 with 1024 cached tokens per
# row (bench/gpu_generation.py); then one FSDP2 rank (training.backend.engine=fsdp2, bf16) through the
# same loop (bench/engines.py --gpu-row). Settings that cannot run (no Liger, no flash-attn) get a row
# saying so.
# Robust by construction: each part runs under its own timeout (TRAIN_TIMEOUT, DECODE_TIMEOUT, FSDP2_TIMEOUT
# seconds; defaults 280 + 140 + 60, so the whole stays within 8 minutes even when all run out),
# writes its rows as it finishes them, and a part that times out or fails adds one row saying
# so; the table is printed either way. Budget assumed on the H200: ~90 s to build and warm up
# each part's model, then 1 warm-up + 3 measured steps per training setting (a few seconds
# each) and 32 decode steps per batch size.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false WANDB_MODE=disabled
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
DRY=${GPU_CHECK_DRY:-0}
TRAIN_TIMEOUT=${TRAIN_TIMEOUT:-280}
DECODE_TIMEOUT=${DECODE_TIMEOUT:-140}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/mmtune_gpu_check.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
ROWS="$WORK/rows.md"
LOG="$WORK/gpu_check.log"
: >"$ROWS"
STARTED=$SECONDS

if [ "$DRY" = "1" ]; then
  # eager stands in for flash-attention: the attention switch between settings runs too.
  TRAIN=(python bench/gpu_sft.py --dry --attention sdpa,eager --steps 2 --warmup 1)
  DECODE=(python bench/gpu_generation.py --tiny --device cpu --dialogues 0 --steps 4 --context 64)
  FSDP2=(python bench/engines.py --model llava_tiny --steps 3 --gpu-row)
else
  TRAIN=(python bench/gpu_sft.py --family llava --max-length 8192 --steps 3 --warmup 1)
  DECODE=(python bench/gpu_generation.py --dialogues 0 --steps 32 --context 1024 --batch-sizes 1,8,32)
  FSDP2=(python bench/engines.py --model llava_100m --steps 4 --gpu-row)
fi
FSDP2_TIMEOUT=${FSDP2_TIMEOUT:-60}

run_part() {  # run_part NAME SECONDS COMMAND...: the command's rows, or one row saying why there are none
  local name=$1 limit=$2 rc=0 started=$SECONDS
  shift 2
  echo "== $name: $* (timeout ${limit} s)" >>"$LOG"
  if [ "$name" = "FSDP2" ]; then  # bench/engines.py takes the rows file after --gpu-row
    timeout --kill-after=20 "$limit" "$@" "$ROWS" >>"$LOG" 2>&1 || rc=$?
  else
    timeout --kill-after=20 "$limit" "$@" --rows "$ROWS" >>"$LOG" 2>&1 || rc=$?
  fi
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    echo "| $name | timed out after ${limit} s | - | - | the rows above are what it finished |" >>"$ROWS"
  elif [ "$rc" -ne 0 ]; then
    local why
    why=$(grep -E "^[A-Za-z.]*(Error|Exception)" "$LOG" | tail -n 1 | cut -c1-200 | tr '|' '/' || true)
    echo "| $name | failed (exit $rc) | - | - | ${why:-see the log} |" >>"$ROWS"
  fi
  echo "$name $((SECONDS - started)) s" >>"$WORK/times"
}

ENVIRONMENT=$(python - <<'PY'
import importlib.util

import torch
import transformers

gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
extras = ", ".join(f"{name} {'installed' if importlib.util.find_spec(module) else 'not installed'}"
                   for name, module in (("liger-kernel", "liger_kernel"), ("flash-attn", "flash_attn")))
print(f"{gpu}; torch {torch.__version__} (CUDA {torch.version.cuda}); transformers {transformers.__version__}; {extras}")
PY
)
echo "$ENVIRONMENT" >>"$LOG"

run_part "SFT" "$TRAIN_TIMEOUT" "${TRAIN[@]}"
run_part "decode" "$DECODE_TIMEOUT" "${DECODE[@]}"
run_part "FSDP2" "$FSDP2_TIMEOUT" "${FSDP2[@]}"

{
  echo "## GPU check, $(date -u '+%Y-%m-%d %H:%M UTC')$([ "$DRY" = "1" ] && echo ' (GPU_CHECK_DRY=1: tiny model on CPU)')"
  echo
  echo "$ENVIRONMENT"
  echo
  grep -E "^[a-z0-9_]+_full_vocab:" "$LOG" | sort -u | sed 's/^/    /' || true
  echo
  echo "| part | setting | tokens/s | peak GiB | note |"
  echo "|---|---|---:|---:|---|"
  cat "$ROWS"
  echo
  echo "Seconds per part: $(tr '\n' ';' <"$WORK/times" | sed 's/;$//; s/;/, /g'); total $((SECONDS - STARTED)) s."
} >"$WORK/gpu_check.md"

cat "$WORK/gpu_check.md"
if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT"
  cp "$WORK/gpu_check.md" "$LOG" "$OUT/"
fi
