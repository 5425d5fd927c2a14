#!/usr/bin/env bash
# Everything the GPU machine checks and times, in one call: logs and JSON under $OUT, a short table last.
#   bash benchmarks/gpu_machine.sh                      the GPU tests, decode backends, the sweep, gpufeed bench
#   STEPS="tests bench" bash benchmarks/gpu_machine.sh  a subset, in this order: tests ddp decode sweep bench cpu
#       memory formats recipe compile paced stages progressive runahead order ops ab
#   BASELINE=DIR STEPS=ab bash benchmarks/gpu_machine.sh
#       gpufeed bench of another checkout (DIR/src, e.g. `git archive REV | tar -x -C DIR`) and of this one,
#       alternating, ROUNDS times for AB_MODELS (none resnet50 resnet18; none: loader only): a change measured
#       in one run. AB_RECIPE (e.g. trivialaugment-mix) times that recipe (--recipe) rather than the plain one;
#       AB_COMPILE=1 the models through torch.compile (--compile). A run past AB_TIMEOUT seconds (300) is
#       stopped and missing from the table's runs.
#   STEPS=ddp bash benchmarks/gpu_machine.sh
#       every GPU of the machine under torchrun (DDP), for MODELS, with each DDP_WORKERS per rank.
#   STEPS=cpu: gpufeed with device="cpu" against the usual DataLoader, loader only, all cores.
#   STEPS=memory: GPU memory per epoch, loader only, GPU and CPU decode (benchmarks/gpu_memory.py), and the
#       nvJPEG decoder's own memory per call (--probe).
#   STEPS=formats: loader only from an ImageFolder tree, tar shards and Parquet of the same images (benchmarks/formats.py),
#       then the workers reading them alone (--read-only).
#   STEPS=recipe: each of RECIPES (trivialaugment-mix) both ways, loader only and with ResNet-50.
#   STEPS=compile: each of MODELS through torch.compile, its own rate and gpufeed's share of it.
#   STEPS=paced: what the loader's GPU work costs a training beside it (benchmarks/paced.py, PACED_ARGS).
#   STEPS=stages: what each stage of the GPU path costs a training beside it (benchmarks/stage_cost.py, for each
#       ";"-separated argument list of STAGES; default ResNet-18 at 5,000 images/s).
#   STEPS=progressive: an epoch at 160, 192 and 224 from one loader through set_image_size (benchmarks/progressive.py).
#   STEPS=runahead: where an end-to-end step's time goes, for each of RUNAHEAD (";"-separated argument lists of
#       benchmarks/runahead.py; default ResNet-18, then ResNet-50 with the trivialaugment-mix recipe).
#   STEPS=order: whether the engine decoders write before their stream's queued work (benchmarks/engine_order.py).
#   STEPS=ops: each per-sample op's cost per batch, with the auto-augment family's Triton kernels and without
#       (GPUFEED_OPS_KERNELS=0), alternating (benchmarks/sample_ops.py).
# Narrowing variables: TESTS (pytest paths), EPOCHS, LOADER_EPOCHS (loader-only bench), LOADER_PIPES,
# MODEL_PIPES, MODELS, SWEEP_ARGS, ROUNDS, DDP_WORKERS, DDP_PIPES, DDP_N (images, 20000), MEMORY_EPOCHS,
# MEMORY_DECODES; ONE_GPU="taskset -c 0-15" (say) runs
# the single-GPU steps on part of a larger machine (with CUDA_VISIBLE_DEVICES=0).
# Packages that machine lacks (simplejpeg, nvImageCodec, nvJPEG) are installed from .whl/ when it is there.
set -uo pipefail
OUT=${OUT:-/tmp/gpufeed-out}; mkdir -p "$OUT"
J=/tmp/gpufeed-json; mkdir -p $J  # every --json; packed into $OUT/json.tgz at the end (few files come back)
SITE=""
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  SITE=/tmp/site:
fi
export PYTHONPATH=$SITE$PWD/src:$PWD PYTHONUNBUFFERED=1
# the optional cropped-decode extension, where the machine has gcc and libjpeg's headers (else whole-image decode)
python3 setup.py -q build_ext --inplace > "$OUT/build_ext.txt" 2>&1 || echo "cropped-decode extension not built (see info.txt)"
{ nvidia-smi --query-gpu=name,driver_version,memory.total,utilization.gpu --format=csv; python3 -m gpufeed info; cat "$OUT/build_ext.txt"; } > "$OUT/info.txt" 2>&1
rm -f "$OUT/build_ext.txt"
grep -i "decode\|gpu 0\|auto-augment" "$OUT/info.txt"
STEPS=" ${STEPS:-tests decode sweep bench} "
step() { [[ "$STEPS" == *" $1 "* ]]; }
DATA=/tmp/synth10k
python3 -m gpufeed synth $DATA --n 10000 --seed 0 > /dev/null
if step tests; then
  timeout 300 python3 -m pytest -q -p no:cacheprovider ${TESTS:-tests} > "$OUT/pytest.txt" 2>&1
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest.txt" | tail -8
fi
if step ddp; then
  G=$(nvidia-smi -L | wc -l)
  python3 -m gpufeed synth /tmp/synth-ddp --n ${DDP_N:-20000} --seed 0 > /dev/null
  for m in ${MODELS:-resnet50 resnet18}; do
    for w in ${DDP_WORKERS:-$(( $(nproc) / G ))}; do
      timeout ${DDP_TIMEOUT:-150} python3 -m torch.distributed.run --nproc_per_node=$G -m gpufeed bench --data /tmp/synth-ddp \
        --device cuda --workers $w --batch-size 256 --epochs ${EPOCHS:-4} --model $m \
        --pipelines ${DDP_PIPES:-gpufeed-gpu} --json "$J/ddp-$m-w$w.json" >> "$OUT/ddp.txt" 2>&1
    done
  done
fi
step decode && { python3 benchmarks/decode_only.py $DATA; python3 benchmarks/overlap.py; } > "$OUT/decode.txt" 2>&1
step sweep && timeout 300 python3 benchmarks/sweep.py $DATA ${SWEEP_ARGS:-} > "$OUT/sweep.txt" 2>&1
W=$(${ONE_GPU:-} nproc)
B="${ONE_GPU:-} python3 -m gpufeed bench --data $DATA --device cuda --workers $W --batch-size 256"
if step bench; then
  $B --epochs ${LOADER_EPOCHS:-${EPOCHS:-3}} --model none --json "$J/loader.json" \
    --pipelines ${LOADER_PIPES:-baseline,gpufeed-cpu,gpufeed-gpu,gpufeed-gpu-only} > "$OUT/bench.txt" 2>&1
  for m in ${MODELS:-resnet50 resnet18}; do
    $B --epochs ${EPOCHS:-3} --model $m --pipelines ${MODEL_PIPES:-baseline,gpufeed-cpu,gpufeed-gpu} \
      --json "$J/$m.json" >> "$OUT/bench.txt" 2>&1
  done
fi
if step cpu; then
  ${ONE_GPU:-} python3 -m gpufeed bench --data $DATA --device cpu --workers $W --batch-size 256 --epochs 3 \
    --pipelines baseline,gpufeed --json "$J/cpu.json" > "$OUT/cpu.txt" 2>&1
  ${ONE_GPU:-} python3 benchmarks/cpu_device.py $DATA --workers $W >> "$OUT/cpu.txt" 2>&1
fi
if step memory; then
  for d in ${MEMORY_DECODES:-probe auto cpu}; do
    a="--epochs ${MEMORY_EPOCHS:-20} --decode $d"; [ $d = probe ] && a=--probe
    timeout 200 ${ONE_GPU:-} python3 benchmarks/gpu_memory.py $DATA $a >> "$OUT/memory.txt" 2>&1
  done
fi
if step formats; then
  timeout 400 ${ONE_GPU:-} python3 benchmarks/formats.py $DATA --workers $W > "$OUT/formats.txt" 2>&1
  timeout 200 python3 benchmarks/formats.py $DATA --workers $W --read-only >> "$OUT/formats.txt" 2>&1
fi
if step recipe; then
  for r in ${RECIPES:-trivialaugment-mix}; do
    for m in none resnet50; do
      timeout 300 $B --epochs ${EPOCHS:-3} --model $m --recipe $r --pipelines ${RECIPE_PIPES:-baseline,gpufeed-gpu} \
        --json "$J/recipe-$r-$m.json" >> "$OUT/recipe.txt" 2>&1
    done
  done
fi
if step compile; then
  for m in ${MODELS:-resnet50 resnet18}; do
    timeout 400 $B --epochs ${EPOCHS:-3} --model $m --compile --pipelines ${COMPILE_PIPES:-gpufeed-gpu} \
      --json "$J/compile-$m.json" >> "$OUT/compile.txt" 2>&1
  done
fi
if step paced; then
  timeout 400 ${ONE_GPU:-} python3 benchmarks/paced.py $DATA --workers $W ${PACED_ARGS:-} > "$OUT/paced.txt" 2>&1
fi
if step stages; then
  IFS=';' read -ra RUNS <<< "${STAGES:---model resnet18}"
  for a in "${RUNS[@]}"; do
    timeout 300 ${ONE_GPU:-} python3 benchmarks/stage_cost.py $DATA $a >> "$OUT/stages.txt" 2>&1
  done
fi
step progressive && timeout 300 ${ONE_GPU:-} python3 benchmarks/progressive.py $DATA --device cuda > "$OUT/progressive.txt" 2>&1
if step runahead; then
  IFS=';' read -ra RUNS <<< "${RUNAHEAD:---model resnet18;--model resnet50 --recipe trivialaugment-mix}"
  for a in "${RUNS[@]}"; do
    timeout 300 ${ONE_GPU:-} python3 benchmarks/runahead.py $DATA --workers $W $a >> "$OUT/runahead.txt" 2>&1
  done
fi
step order && timeout 120 ${ONE_GPU:-} python3 benchmarks/engine_order.py > "$OUT/order.txt" 2>&1
if step ops; then
  for k in 0 1 0 1; do
    GPUFEED_OPS_KERNELS=$k timeout 120 ${ONE_GPU:-} python3 benchmarks/sample_ops.py --tv-images 8 >> "$OUT/ops.txt" 2>&1
  done
fi
if step ab; then
  [ -d "${BASELINE:-}/src" ] || { echo "ab: BASELINE=DIR with DIR/src is needed"; exit 2; }
  (cd "$BASELINE" && python3 setup.py -q build_ext --inplace > /dev/null 2>&1)
  rm -rf /tmp/ab && mkdir -p /tmp/ab  # an earlier ab run's JSON would join this one's summary
  for r in $(seq 1 ${ROUNDS:-3}); do
    for m in ${AB_MODELS:-none resnet50 resnet18}; do
      for tree in baseline current; do
        src=$PWD/src; [ $tree = baseline ] && src=$BASELINE/src
        PYTHONPATH=$SITE$src timeout ${AB_TIMEOUT:-300} $B --epochs ${EPOCHS:-3} --model $m --pipelines gpufeed-gpu \
          ${AB_RECIPE:+--recipe $AB_RECIPE} ${AB_COMPILE:+--compile} --json /tmp/ab/$m-$tree-$r.json \
          >> "$OUT/ab.txt" 2>&1
      done
    done
  done
  rm -rf "$J/ab" && cp -r /tmp/ab "$J/ab"  # each run's epochs and CPU share come back in json.tgz
  python3 - /tmp/ab >> "$OUT/ab.txt" <<'PY'
import glob, json, statistics, sys
rows = {}
for f in sorted(glob.glob(sys.argv[1] + "/*.json")):
    model, tree, _ = f.rsplit("/", 1)[1][:-5].rsplit("-", 2)
    r = [x for x in json.load(open(f))["rows"] if x["pipeline"].startswith("gpufeed-gpu")][0]
    share = (r.get("loader_stats") or {}).get("cpu_share")  # as the run ended
    rows.setdefault((model, tree), []).append((r["images_per_s"], r["of_ceiling"], share))
print("| model | tree | images/s per run | median | of own rate per run | CPU share |\n|---|---|---|---|---|---|")
for (model, tree), v in sorted(rows.items()):
    rates = [x for x, _, _ in v]
    ceil = "-" if v[0][1] is None else ", ".join(f"{100 * c:.1f}%" for _, c, _ in v)
    print(f"| {model} | {tree} | {', '.join(f'{x:,.0f}' for x in rates)} | {statistics.median(rates):,.0f} | {ceil} "
          f"| {', '.join(str(s) for _, _, s in v)} |")
PY
fi
step sweep && grep -E "^\||CPU cores" "$OUT/sweep.txt"
step decode && grep -E "^\||files in memory|overlap" "$OUT/decode.txt"
step bench && grep -E "^\||^gpufeed bench|FAILED|Error" "$OUT/bench.txt" | cut -c1-230
step bench && python3 - "$J"/loader.json "$J"/resnet*.json <<'PY'
import json, sys
for f in sys.argv[1:]:  # GPU memory added since before the loader was made, peak of each epoch (NVML), MB
    for r in json.load(open(f))["rows"]:
        e = r.get("epochs") or []
        if e and e[0]["gpu_mem_peak_bytes"] is not None:
            start = r["gpu_mem_before_loader_bytes"]
            print(f.rsplit("/", 1)[1], r["pipeline"][:24], "GPU MB added per epoch:",
                  " ".join(f"{(x['gpu_mem_peak_bytes'] - start) / 2**20:.0f}" for x in e))
PY
step cpu && grep -E "^\||^gpufeed bench|CPUs, torch|FAILED|Error" "$OUT/cpu.txt" | cut -c1-200
step memory && grep -E "^\||nvJPEG|decode=|growth|Error" "$OUT/memory.txt"
step stages && grep -E "^\||alone:|^  |launches|Error" "$OUT/stages.txt" | cut -c1-160
step progressive && grep -E "^\||PIDs|Error" "$OUT/progressive.txt"
step runahead && grep -E "^\||own rate|alone:|epoch [0-9]+:|longest|Error" "$OUT/runahead.txt" | cut -c1-400
step order && grep -E "^\||Error" "$OUT/order.txt"
step ops && grep -E "^\| (op|Trivial|RandAug|AutoAug|AugMix|all)|on CUDA|Error" "$OUT/ops.txt"
step ab && grep -E "^\| (model|none|resnet|---)" "$OUT/ab.txt"
step ddp && grep -E "^\||^gpufeed bench|FAILED|Error" "$OUT/ddp.txt" | cut -c1-230
step formats && grep -E "^\||Error" "$OUT/formats.txt" | cut -c1-200
step recipe && grep -E "^\||^gpufeed bench|FAILED|Error" "$OUT/recipe.txt" | cut -c1-230
step compile && grep -E "^\||^gpufeed bench|FAILED|Error" "$OUT/compile.txt" | cut -c1-230
step paced && grep -E "^\||alone:|^  |Error" "$OUT/paced.txt" | cut -c1-200
tar -czf "$OUT/json.tgz" -C $J . 2>/dev/null
exit 0
