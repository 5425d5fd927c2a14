#!/usr/bin/env bash
# Everything the GPU machine checks and times, in one call. Usage (from the repo root, on that machine):
#   bash benchmarks/gpu_machine.sh        (writes logs and JSON under $OUT, prints a short table last)
# Expects carried wheels in .whl/ (simplejpeg; see ../shared/tools/device-wheels.sh).
set -uo pipefail
OUT=${OUT:-/tmp/gpufeed-out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD/src
else
  export PYTHONPATH=$PWD/src
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total,utilization.gpu --format=csv | tee "$OUT/nvidia-smi.txt"
python3 -m gpufeed info 2>&1 | tee "$OUT/info.txt"
python3 -m pytest -q -p no:cacheprovider tests 2>&1 | tee "$OUT/pytest.txt" | tail -5
DATA=/tmp/synth10k
python3 -m gpufeed synth $DATA --n 10000 --seed 0 | tee -a "$OUT/log.txt"
W=$(nproc)
python3 -m gpufeed bench --data $DATA --model none --device cuda --workers $W --batch-size 256 --epochs 3 \
  --pipelines baseline,baseline+prefetch,gpufeed --json "$OUT/loader.json" > "$OUT/loader.txt" 2>&1
for m in ${MODELS:-resnet50 resnet18}; do
  python3 -m gpufeed bench --data $DATA --model $m --device cuda --workers $W --batch-size 256 --epochs 3 \
    --pipelines baseline,baseline+prefetch,gpufeed --json "$OUT/$m.json" > "$OUT/$m.txt" 2>&1
done
for f in loader ${MODELS:-resnet50 resnet18}; do echo; tail -6 "$OUT/$f.txt"; done
