#!/usr/bin/env bash
# GPU / NCCL smoke check of the training engine (not run in CI).
#
#   scripts/gpu_nccl_check.sh [preset=125m] [steps=12]
#
# Runs the standalone launcher (torchrun, NCCL) over the GPUs of this machine for a few layouts
# (dp zero0 fp32/bf16, dp zero3 bf16, tp, dp x tp when >= 4 GPUs) and prints tokens/s, MFU, peak memory
# and comm_fraction per layout (medians after the first 2 steps). With one GPU it runs the 1-rank layouts
# (plain, FSDP2 zero3 on one rank, activation checkpointing) so the CUDA path is still exercised.
set -euo pipefail
cd "$(dirname "$0")/.."
PRESET="${1:-125m}"
STEPS="${2:-12}"
NGPU="$(python -c 'import torch; print(torch.cuda.device_count())')"
if [[ "$NGPU" -lt 1 ]]; then echo "no CUDA GPU visible: nothing to check" >&2; exit 1; fi
OUT="$(mktemp -d /tmp/meshrun-gpu-XXXX)"
echo "GPUs: $NGPU  preset: $PRESET  steps: $STEPS  out: $OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true

run() {  # name nproc layout-json precision ac
  local name="$1" n="$2" layout="$3" prec="$4" ac="${5:-none}"
  local gbs=$(( 8 * n ))
  cat > "$OUT/$name.yaml" <<YAML
name: gpu-$name
model: {name: gpt, preset: "$PRESET", seq_len: 1024}
layout: $layout
batch: {global_batch_size: $gbs, micro_batch_size: 4}
precision: $prec
activation_checkpointing: $ac
optimizer: {warmup_steps: 2}
train: {steps: $STEPS}
resources: {device: gpu}
YAML
  echo "== $name ($n ranks): $layout $prec ac=$ac"
  if ! torchrun --standalone --nproc-per-node "$n" -m workers --spec "$OUT/$name.yaml" \
      --metrics-out "$OUT/$name.jsonl" --log-level WARNING > "$OUT/$name.log" 2>&1; then
    echo "   FAILED (see $OUT/$name.log)"; tail -20 "$OUT/$name.log"; return 0
  fi
}

run single_fp32 1 "{}" fp32
run single_bf16 1 "{}" bf16
run zero3_1rank_bf16_ac 1 "{zero_stage: 3}" bf16 selective
if [[ "$NGPU" -ge 2 ]]; then
  run dp${NGPU}_zero0_bf16 "$NGPU" "{dp: $NGPU}" bf16
  run dp${NGPU}_zero0_bf16_comp "$NGPU" "{dp: $NGPU, grad_compression: bf16}" bf16
  run dp${NGPU}_zero3_bf16 "$NGPU" "{dp: $NGPU, zero_stage: 3}" bf16
  run tp2_sp_bf16 2 "{tp: 2, sequence_parallel: true}" bf16
  run pp2_bf16 2 "{pp: 2}" bf16
fi
if [[ "$NGPU" -ge 4 ]]; then
  run dp$((NGPU / 2))_tp2_zero3_bf16 "$NGPU" "{dp: $((NGPU / 2)), tp: 2, zero_stage: 3, sequence_parallel: true}" bf16
fi

python - "$OUT" <<'PY'
import json, statistics, sys
from pathlib import Path
out = Path(sys.argv[1])
print(f"{'layout':<28} {'steps':>5} {'loss':>8} {'tok/s':>10} {'MFU':>6} {'peak GiB':>9} {'comm':>5}")
for f in sorted(out.glob("*.jsonl")):
    rows = [json.loads(l) for l in f.read_text().splitlines()]
    if not rows:
        continue
    t = rows[2:] or rows
    med = lambda k: statistics.median(r[k] for r in t)
    print(f"{f.stem:<28} {len(rows):>5} {rows[-1]['loss']:>8.3f} {med('tokens_per_s'):>10.0f} {med('mfu'):>6.1%} "
          f"{max(r['peak_memory_bytes'] for r in rows) / 2**30:>9.2f} {med('comm_fraction'):>5.2f}")
PY
