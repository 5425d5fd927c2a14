#!/usr/bin/env bash
# Everything the GPU machine checks and times, in one call: logs and JSON under $OUT, a short table last.
#   STEPS="tests ab" bash benchmarks/gpu_machine.sh    the steps named, in this order:
#     tests     the tests marked gpu (their exit status is this script's)
#     monitors  each of gpufeed bench's monitors timed against a plain epoch (benchmarks/monitor_cost.py)
#     readme    the README's main command as written
#     ab        this tree against each of AB_REFS (folders holding a tree's src/, e.g. `git archive REV | tar -x -C
#               DIR`), and with AB_BENCH=1 gpufeed bench against its plain loop, fresh processes, alternating,
#               ROUNDS rounds of AB_ROWS (benchmarks/ab.py)
#     shards    pre-resized shards against the original JPEGs (benchmarks/shards.py)
#     decode    each decode backend alone (decode_only.py)     memory    GPU memory per epoch (gpu_memory.py)
#     formats   folder, tar shards and Parquet (formats.py)    paced     the loader's GPU work against a training
#     progressive  an epoch at each size (progressive.py)      ddp       every GPU under torchrun, gpufeed bench
#     steady    every epoch's rate fresh, after other loaders, after validation passes, under a CPU hog
#               (steady.py, loader only and MODELS)
# Narrowing variables: TESTS (pytest arguments), TESTS_TIMEOUT, XDIST, EPOCHS, ROUNDS, MODELS, AB_ROWS (ab.py --rows,
# e.g. none,resnet18,validation), AB_TIMEOUT,
# AB_BUDGET (no a/b round begun that would end past it), AB_LIMIT (seconds before the a/b step is killed; both
# default to what is left of CALL_S, 590, the seconds of the whole call),
# CEILING_S (seconds each a/b run times the model alone), INFO=0 (no `gpufeed info`, which tries every decoder).
# Packages that machine lacks (simplejpeg, nvImageCodec, nvJPEG) are installed from .whl/ when it is there: make it
# with `../shared/tools/device-wheels.sh simplejpeg` (its default leaves simplejpeg out) and carry [".whl"].
set -uo pipefail
OUT=${OUT:-/tmp/gpufeed-out}; mkdir -p "$OUT"
J=/tmp/gpufeed-json; mkdir -p $J  # every --json; packed into $OUT/json.tgz at the end (few files come back)
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
# the optional cropped-decode extension, where the machine has gcc and libjpeg's headers (else whole-image decode)
python3 setup.py -q build_ext --inplace > "$OUT/build_ext.txt" 2>&1 || echo "cropped-decode extension not built (see info.txt)"
{ nvidia-smi --query-gpu=name,driver_version,memory.total,utilization.gpu,clocks.sm --format=csv; nproc
  [ "${INFO:-1}" = 1 ] && python3 -m gpufeed info; cat "$OUT/build_ext.txt"; } > "$OUT/info.txt" 2>&1
rm -f "$OUT/build_ext.txt"
grep -i "decode\|gpu 0" "$OUT/info.txt"
STEPS=" ${STEPS:-tests readme ab} "
step() { [[ "$STEPS" == *" $1 "* ]]; }
status=0
DATA=/tmp/synth10k
# kept on a warm machine: generated again only when no earlier call finished it
[ -f $DATA.done ] || { python3 -m gpufeed synth $DATA --n 10000 --seed 0 > /dev/null && touch $DATA.done; }
mkdir -p ~/.cache/gpufeed && ln -sfn $DATA ~/.cache/gpufeed/synth-10000-seed0  # the README command's default data
E=${EPOCHS:-4}
if step tests; then
  # XDIST=N: N pytest processes share the GPU (pytest-xdist from .whl/); what fails there runs again alone
  par=""; [ -n "${XDIST:-}" ] && python3 -c "import xdist" 2>/dev/null && par="-n $XDIST"
  timeout ${TESTS_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider $par ${TESTS:--m gpu tests} > "$OUT/pytest.txt" 2>&1
  status=$?
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest.txt" | tail -8
  failed=$(grep -oE "^(FAILED|ERROR) [^ ]+" "$OUT/pytest.txt" | cut -d" " -f2 | sort -u)
  if [ -n "$par" ] && [ $status -ne 0 ] && [ -n "$failed" ]; then
    echo "again, one process: $failed"
    timeout ${TESTS_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider $failed > "$OUT/pytest-again.txt" 2>&1
    status=$?
    grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest-again.txt" | tail -8
  fi
fi
step monitors && timeout 300 python3 benchmarks/monitor_cost.py $DATA --models ${MODELS:-none,resnet18} \
  --rounds ${ROUNDS:-3} > "$OUT/monitors.txt" 2>&1
step readme && (cd /tmp && timeout 300 python3 -m gpufeed bench --json $J/readme.json --chart "$OUT/readme.png") \
  > "$OUT/readme.txt" 2>&1
if step ab; then
  refs=""; for r in ${AB_REFS:-}; do [ -d "$r/src" ] || { echo "ab: $r holds no src/"; exit 2; }; refs="$refs --ref $r"; done
  left=$(( ${CALL_S:-590} - SECONDS - 15 ))  # what the call has left once the steps before it ran
  timeout ${AB_LIMIT:-$left} python3 benchmarks/ab.py $DATA $refs ${AB_BENCH:+--bench} --budget ${AB_BUDGET:-$left} \
    --rows ${AB_ROWS:-none,resnet50,resnet18} --rounds ${ROUNDS:-3} --epochs $E --timeout ${AB_TIMEOUT:-200} \
    --ceiling-seconds ${CEILING_S:-5} --log "$OUT/ab-runs.txt" --json $J/ab-${AB_ROWS:-all}.json > "$OUT/ab.txt" 2>&1
fi
step shards && timeout 300 python3 benchmarks/shards.py $DATA ${SHARDS_ARGS:-} > "$OUT/shards.txt" 2>&1
step decode && timeout 200 python3 benchmarks/decode_only.py $DATA > "$OUT/decode.txt" 2>&1
if step memory; then
  for d in probe auto cpu; do
    a="--epochs 20 --decode $d"; [ $d = probe ] && a=--probe
    timeout 200 python3 benchmarks/gpu_memory.py $DATA $a >> "$OUT/memory.txt" 2>&1
  done
fi
step formats && timeout 400 python3 benchmarks/formats.py $DATA --workers $(nproc) > "$OUT/formats.txt" 2>&1
step paced && timeout 400 python3 benchmarks/paced.py $DATA --workers $(nproc) > "$OUT/paced.txt" 2>&1
if step steady; then
  for m in none ${MODELS:-resnet18}; do
    timeout 300 python3 benchmarks/steady.py $DATA --model $m --epochs 6 --json $J/steady-$m.json \
      >> "$OUT/steady.txt" 2>&1
  done
fi
step progressive && timeout 300 python3 benchmarks/progressive.py $DATA --device cuda > "$OUT/progressive.txt" 2>&1
if step ddp; then
  G=$(nvidia-smi -L | wc -l)
  python3 -m gpufeed synth /tmp/synth-ddp --n 20000 --seed 0 > /dev/null
  for m in ${MODELS:-resnet50 resnet18}; do
    timeout 300 python3 -m torch.distributed.run --nproc_per_node=$G -m gpufeed bench --data /tmp/synth-ddp \
      --device cuda --batch-size 256 --epochs $E --model $m --pipelines gpufeed --json "$J/ddp-$m.json" \
      >> "$OUT/ddp.txt" 2>&1
  done
fi
for s in monitors readme ab shards decode memory formats paced progressive steady ddp; do
  step $s && [ -f "$OUT/$s.txt" ] && { echo "== $s"; grep -E "^\||^gpufeed bench|^- |FAILED|Error|round " "$OUT/$s.txt" | cut -c1-260; }
done
tar -czf "$OUT/json.tgz" -C $J . 2>/dev/null
exit $status
