#!/usr/bin/env bash
# GPU checks on a machine that has CUDA but no package index: runs the `gpu`-marked tests, the
# host-overhead bench at W=8 and 64 on the fake process group (both engines), AdamW8bit's step
# against fused AdamW, one-rank step phases (tools/step_phases.py) and a short CUDA training
# run of each engine, against the machine's own torch (no venv, no installs).
# Usage: OUT=/some/dir bash tools/gpu_checks.sh
set -uo pipefail
OUT=${OUT:-build/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
src=""
for p in ragged-placement shard-planner dbuffer fsdp-engine optimizers; do src="$src:packages/$p/src"; done
export PYTHONPATH="${src#:}:examples:tools"
nvidia-smi -L
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
timeout 240 python3 -m pytest -m gpu -q -p no:cacheprovider tests packages 2>&1 | tail -4
echo "gpu tests: exit status ${PIPESTATUS[0]}"
echo "== host overhead per step, fake process group, W=8 and 64 (ours vs FSDP2, the README table)"
timeout 420 python3 packages/fsdp-engine/benchmarks/bench_overhead.py --device cuda \
  --out "$OUT/overhead.json" 2>&1 | grep -E "^\||cases in"
echo "== AdamW8bit (compiled: Triton) against AdamW(fused=True), one process"
timeout 240 python3 packages/optimizers/benchmarks/bench_optimizers.py --adam-only --device cuda \
  --out "$OUT/optimizers.json" 2>&1 | grep -E "^\||adamw8bit_"
echo "== step phases, dense (ONE rank: ours gathers nothing there; not the engine's speed)"
timeout 120 python3 tools/step_phases.py --device cuda 2>&1 | grep -A2 "median"
echo "== step phases, MoE 16 experts"
timeout 120 python3 tools/step_phases.py --device cuda --experts 16 2>&1 | grep -A2 "median"
for cfg in "dense:--moe 0" "moe:--moe 64"; do
  name=${cfg%%:*}; flags=${cfg#*:}
  for engine in ours fsdp2; do
    timeout 90 python3 examples/train.py --nproc 1 --device cuda --engine "$engine" $flags \
      --mixed-precision bf16 --dim 512 --layers 8 --heads 8 --global-batch 16 --seq-len 256 \
      --steps 30 --eval-every 1000 --sample-chars 0 --out "$OUT/$name-$engine" 2>&1 \
      | tr "\r" "\n" | grep "ms/step"
  done
done
echo "== predicted against measured step, one rank (tools/validate_step.py)"
timeout 90 python3 tools/validate_step.py --device cuda --worlds 1 --out "$OUT/validate_step.json" \
  2>&1 | grep -E "^\|"
