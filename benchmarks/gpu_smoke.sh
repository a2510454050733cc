#!/usr/bin/env bash
# GPU smoke run for one GPU or one node: train 20 steps on NCCL, run the side-by-side bench, then compare the
# measured median step with what `simplefsdp inspect` predicts for the same model, batch and world size.
# Usage (from the repository root): benchmarks/gpu_smoke.sh
# Settings (environment): PYTHON (python), NPROC (all visible GPUs), MODEL (cpu-small), LAYERS (the model's own),
# BATCH_SIZE (4), SEQ_LEN (512), ONLY (bench's contenders: all), OUT (runs/gpu_smoke).
# Example for a node: MODEL=llama3-8b BATCH_SIZE=1 SEQ_LEN=8192 benchmarks/gpu_smoke.sh
# On one 80 GB GPU: MODEL=llama3-8b LAYERS=2 BATCH_SIZE=1 SEQ_LEN=8192 ONLY=fsdp2-eager,simplefsdp (bench holds
# every contender's model and AdamW state at once)
# Without a CUDA build of torch or without a visible GPU it says so and exits 0.
set -euo pipefail
PYTHON=${PYTHON:-python}
gpus=$("$PYTHON" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")
if [ "$gpus" = 0 ]; then
    build=$("$PYTHON" -c "import torch; print(torch.__version__, 'for CUDA', torch.version.cuda or '(none: CPU-only)')")
    echo "gpu_smoke: skipped, no GPU visible to torch $build"
    exit 0
fi
NPROC=${NPROC:-$gpus} MODEL=${MODEL:-cpu-small} BATCH_SIZE=${BATCH_SIZE:-4} SEQ_LEN=${SEQ_LEN:-512}
OUT=${OUT:-runs/gpu_smoke}
mkdir -p "$OUT"
workload=(--model "$MODEL" ${LAYERS:+--layers "$LAYERS"} --batch-size "$BATCH_SIZE" --seq-len "$SEQ_LEN"
          --param-dtype bfloat16 --reduce-dtype float32)

echo "== train: $NPROC rank(s), 20 steps on NCCL"
"$PYTHON" -m simplefsdp train "${workload[@]}" --nproc "$NPROC" --steps 20 | tee "$OUT/train.log"
echo "== bench"
"$PYTHON" -m simplefsdp bench "${workload[@]}" --nproc "$NPROC" ${ONLY:+--only "$ONLY"} --json "$OUT/bench.json" \
    --plot "$OUT/bench.png" | tee "$OUT/bench.log"
hardware=$("$PYTHON" -c "import torch; from simplefsdp.ir.hardware import gpu_profile
print(getattr(gpu_profile(torch.cuda.get_device_name()), 'name', 'h100'))")
echo "== inspect: the prediction on the $hardware profile"
"$PYTHON" -m simplefsdp inspect "${workload[@]}" --world-size "$NPROC" --hardware "$hardware" --out "$OUT/inspect" \
    > "$OUT/inspect.log"
"$PYTHON" - "$OUT" <<'EOF'
import json, re, sys
from pathlib import Path

out = Path(sys.argv[1])
median = float(re.search(r"median step ([0-9.]+) s", (out / "train.log").read_text()).group(1))
final = json.loads((out / "inspect" / "summary.json").read_text())["stages"][-1]
print(f"gpu_smoke: measured median step {median * 1e3:.1f} ms (forward, backward, optimizer); predicted "
      f"{final['step_seconds'] * 1e3:.1f} ms (forward and backward), "
      f"measured/predicted {median / final['step_seconds']:.2f}; "
      f"predicted peak {final['peak_bytes'] / 2**30:.2f} GiB per rank (bench.json has the measured peak)")
EOF
