"""NVIDIA DALI's pipeline in the same plain training loop as ``plain_loop.py``, for a side-by-side in one call.

    python benchmarks/dali_loop.py DATA [--model none|resnet18|resnet50|...] [--compile] [--epochs 5]
        [--batch-size 256] [--threads 16] [--hw-decoder-load 1.0] [--json OUT]

The pipeline is DALI's mixed one as its ImageNet examples build it: ``fn.readers.file`` over DATA's class
folders (shuffled), ``fn.decoders.image_random_crop`` on the device (the engines take ``hw_decoder_load`` of
the images, the rest go to its CPU threads; it decodes only the crop's region), ``fn.resize`` to 224 with
antialiasing, ``fn.crop_mirror_normalize`` with a coin flip, ImageNet's mean and std, float32, NCHW.
``DALIGenericIterator`` hands each batch over as torch tensors, made channels_last with a model as the
gpufeed loader's are. The training step, the ceiling (the model's own rate on one GPU-resident batch, in this
process) and the figures (images/s of each epoch, the median of those after the first, its share of the
ceiling) are ``plain_loop.py``'s. ``memory_added``: the drop in free device memory from before the pipeline
was built to the least at any epoch's end (what the loader takes, its libraries' own allocations included).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from plain_loop import IMAGENET_MEAN, IMAGENET_STD, ceiling, make_step


def build(data: str, batch_size: int, threads: int, device_id: int, hw_load: float, seed: int = 0):
    from nvidia.dali import fn, pipeline_def, types

    @pipeline_def(batch_size=batch_size, num_threads=threads, device_id=device_id, seed=seed,
                  prefetch_queue_depth=2)
    def train():
        jpegs, labels = fn.readers.file(file_root=data, random_shuffle=True, name="reader")
        images = fn.decoders.image_random_crop(jpegs, device="mixed", output_type=types.RGB,
                                               hw_decoder_load=hw_load, random_area=[0.08, 1.0],
                                               random_aspect_ratio=[3 / 4, 4 / 3], num_attempts=10)
        images = fn.resize(images, resize_x=224, resize_y=224, antialias=True)
        images = fn.crop_mirror_normalize(images, dtype=types.FLOAT, output_layout="CHW",
                                          mean=[255 * m for m in IMAGENET_MEAN], std=[255 * s for s in IMAGENET_STD],
                                          mirror=fn.random.coin_flip(probability=0.5))
        return images, labels.gpu()

    pipe = train()
    pipe.build()
    return pipe


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("data")
    p.add_argument("--model", default="none")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--hw-decoder-load", type=float, default=1.0)
    p.add_argument("--ceiling-seconds", type=float, default=5.0)
    p.add_argument("--json")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("dali_loop.py needs a CUDA device (DALI's mixed pipeline decodes on it)")
    try:
        from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy
    except ImportError:
        raise SystemExit("dali_loop.py needs NVIDIA DALI: pip install nvidia-dali-cuda130 (or the build for your "
                         "CUDA); on the GPU machine, carry it with ../shared/tools/dali-carry.sh") from None
    device = torch.device("cuda", torch.cuda.current_device())
    result = {"pipeline": f"DALI mixed, hw_decoder_load {args.hw_decoder_load}", "model": args.model,
              "compile": args.compile, "epochs": [], "ceiling": None}
    step = None
    if args.model != "none":
        step = make_step(args.model, device, args.compile)
        result["ceiling"] = ceiling(step, args.batch_size, device, args.ceiling_seconds)
    torch.cuda.synchronize(device)
    free0 = torch.cuda.mem_get_info(device)[0]
    pipe = build(args.data, args.batch_size, args.threads, device.index, args.hw_decoder_load)
    loader = DALIGenericIterator([pipe], ["images", "labels"], reader_name="reader",
                                 last_batch_policy=LastBatchPolicy.DROP, auto_reset=True)
    least_free = free0
    for _ in range(args.epochs):
        n, t0 = 0, time.perf_counter()
        for out in loader:
            images, labels = out[0]["images"], out[0]["labels"].squeeze(-1).long()
            if step is not None:
                step(images.contiguous(memory_format=torch.channels_last), labels)
            n += images.shape[0]
        torch.cuda.synchronize(device)
        result["epochs"].append(n / (time.perf_counter() - t0))
        least_free = min(least_free, torch.cuda.mem_get_info(device)[0])
    result["images_per_s"] = statistics.median(result["epochs"][1:])
    result["of_ceiling"] = result["images_per_s"] / result["ceiling"] if result["ceiling"] else None
    result["memory_added"] = free0 - least_free
    print(f"DALI {args.model}{' compiled' if args.compile else ''}: "
          + ", ".join(f"{r:,.0f}" for r in result["epochs"]) + " images/s by epoch; "
          + (f"{100 * result['of_ceiling']:.1f}% of its own rate {result['ceiling']:,.0f}" if result["ceiling"]
             else "loader only") + f"; device memory added {result['memory_added'] / 1e9:.2f} GB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
