#!/usr/bin/env bash
# Everything the GPU machine checks and times, in one call. Usage (from the repo root, on that machine):
#   bash benchmarks/gpu_machine.sh        (writes logs and JSON under $OUT, prints a short table last)
#   STEPS="tests sweep checks" bash benchmarks/gpu_machine.sh   (a subset; default: tests decode sweep checks bench;
#   TESTS, DECODE_ARGS, SWEEP_ARGS, CHECK_ROUNDS, EPOCHS, LOADER_PIPES, MODEL_PIPES, MODELS narrow each step;
#   "profile" adds benchmarks/profile_gpu_stage.py, the step-by-step profile of nvImageCodec's decode)
# Expects carried wheels in .whl/ (simplejpeg, nvImageCodec, nvJPEG; see ../shared/tools/device-wheels.sh).
set -uo pipefail
OUT=${OUT:-/tmp/gpufeed-out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD/src:$PWD
else
  export PYTHONPATH=$PWD/src:$PWD
fi
export PYTHONUNBUFFERED=1
# the optional cropped-decode extension, where that machine has gcc and libjpeg headers (else: whole-image decode)
python3 setup.py -q build_ext --inplace > "$OUT/build_ext.txt" 2>&1 || echo "cropped-decode extension not built (see build_ext.txt)"
{ nvidia-smi --query-gpu=name,driver_version,memory.total,utilization.gpu --format=csv; python3 -m gpufeed info; cat "$OUT/build_ext.txt"; } > "$OUT/info.txt" 2>&1
rm -f "$OUT/build_ext.txt"
grep -i "decode\|nvimg\|gpu 0" "$OUT/info.txt"
STEPS=" ${STEPS:-tests decode sweep checks bench} "
step() { [[ "$STEPS" == *" $1 "* ]]; }
if step tests; then
  timeout 300 python3 -m pytest -q -p no:cacheprovider ${TESTS:-tests} > "$OUT/pytest.txt" 2>&1
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest.txt" | tail -8
fi
DATA=/tmp/synth10k
python3 -m gpufeed synth $DATA --n 10000 --seed 0 > /dev/null
step decode && python3 benchmarks/decode_only.py $DATA ${DECODE_ARGS:-} > "$OUT/decode.txt" 2>&1
step profile && python3 benchmarks/profile_gpu_stage.py $DATA 2>&1 | grep -v -i "nvjpeg2k\|nvtiff" > "$OUT/profile.txt"
step sweep && timeout 300 python3 benchmarks/sweep_gpu_path.py $DATA ${SWEEP_ARGS:-} > "$OUT/sweep.txt" 2>&1
if step checks; then
  timeout 60 python3 benchmarks/check_cost.py $DATA --n 1000 > "$OUT/checks.txt" 2>&1
  timeout 200 python3 benchmarks/check_cost.py $DATA --loader --rounds ${CHECK_ROUNDS:-5} >> "$OUT/checks.txt" 2>&1
fi
W=$(nproc)
B="python3 -m gpufeed bench --data $DATA --device cuda --workers $W --batch-size 256 --epochs ${EPOCHS:-3}"
if step bench; then
$B --model none --pipelines ${LOADER_PIPES:-baseline,gpufeed-cpu,gpufeed-gpu,gpufeed-gpu-only} --json "$OUT/loader.json" > "$OUT/bench.txt" 2>&1
for m in ${MODELS:-resnet50 resnet18}; do
  $B --model $m --pipelines ${MODEL_PIPES:-baseline,baseline+prefetch,gpufeed-cpu,gpufeed-gpu} --json "$OUT/$m.json" >> "$OUT/bench.txt" 2>&1
done
fi
step sweep && grep -E "^\||Model name|per core|usable|Error" "$OUT/sweep.txt"
step checks && grep -E "^\||FAILED|Error" "$OUT/checks.txt"
step profile && grep -E "^\| (as_image|decode\(256\) into|[0-9] decoder)|^GIL|^decode into" "$OUT/profile.txt"
step decode && grep -A40 "^[0-9]* files, batch" "$OUT/decode.txt"
step bench && grep -E "^\||^gpufeed bench|FAILED|Error" "$OUT/bench.txt" | cut -c1-230
