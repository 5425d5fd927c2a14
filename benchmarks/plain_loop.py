"""A plain training loop over ImageLoader, in this process alone: the yardstick of the a/b harness (``ab.py``)
and of the bench's own check (``ab.py --bench``).

    python benchmarks/plain_loop.py DATA [--model none|resnet50|resnet18|...] [--compile]
        [--recipe standard|trivialaugment-mix] [--validation] [--epochs 4] [--batch-size 256] [--workers N]
        [--json OUT]

With a model, its own rate on one GPU-resident batch (the ceiling) is measured first, in this process; then
``epochs`` epochs of ``for images, labels in loader: step(images, labels)``, the device synchronised at each
epoch's end and nothing else running. images/s is the median of the epochs after the first; every epoch's
rate is printed and written, so a rate still rising shows. On CUDA, ``memory_added``: the drop in free device
memory from before the loader was made to the least at any epoch's end (``dali_loop.py`` measures DALI so). The loader is made as ``gpufeed bench`` makes its
``gpufeed`` pipeline (decode "auto", cpu_share "auto", float32, channels_last with a model). ``--validation``:
a ``train=False`` loader (Resize + CenterCrop, every image, the short last batch too), each epoch a whole
validation pass, loader only.

It uses ImageLoader's public arguments alone and none of ``gpufeed.bench``, so that it runs the same against
any tree of gpufeed put first on PYTHONPATH: its training step and ceiling are those of ``gpufeed.bench.train``,
written out here.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import statistics
import sys
import time

import torch

import gpufeed
from gpufeed import ImageLoader
from gpufeed.cores import IdleCores

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def make_step(name: str, device: torch.device, compile: bool):
    """One SGD step under bf16 autocast, channels_last (as ``gpufeed.bench.train.make_train_step``)."""
    import torchvision

    model = torchvision.models.get_model(name, num_classes=1000).to(device).to(memory_format=torch.channels_last)
    if compile:
        model = torch.compile(model, dynamic=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step(images: torch.Tensor, labels: torch.Tensor) -> None:
        images = images.to(device, non_blocking=True).contiguous(memory_format=torch.channels_last)
        labels = labels.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_fn(model(images), labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return step


def ceiling(step, batch_size: int, device: torch.device, seconds: float = 5.0) -> float:
    """The model's images/s on one random batch already on the GPU (as ``gpufeed.bench.train.ceiling_rate``)."""
    images = torch.randn(batch_size, 3, 224, 224, device=device).contiguous(memory_format=torch.channels_last)
    labels = torch.randint(0, 1000, (batch_size,), device=device)
    for _ in range(10):
        step(images, labels)
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(10):
        step(images, labels)
    torch.cuda.synchronize(device)
    steps = max(30, math.ceil(seconds / ((time.perf_counter() - t0) / 10)))
    t0 = time.perf_counter()
    for _ in range(steps):
        step(images, labels)
    torch.cuda.synchronize(device)
    return steps * batch_size / (time.perf_counter() - t0)


def plain_epoch(loader, step, device: torch.device, on_batch=None) -> float:
    """One epoch of ``for images, labels in loader: step(images, labels)``: its images/s, the device
    synchronised at its end. ``on_batch(n)`` after each batch of n images (a reading of ``steady.py``'s)."""
    n, t0 = 0, time.perf_counter()
    for images, labels in loader:
        if step is not None:
            step(images, labels)
        n += images.shape[0]
        if on_batch is not None:
            on_batch(images.shape[0])
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return n / (time.perf_counter() - t0)


def recipe(name: str, image_size: int = 224):
    """(transform, batch_transform) of a recipe of ``gpufeed bench --recipe`` (None, None: the loader's own)."""
    if name == "standard":
        return None, None
    from torchvision.transforms import v2

    if name != "trivialaugment-mix":
        raise ValueError(f"--recipe must be standard or trivialaugment-mix, got {name!r}")
    transform = v2.Compose([v2.RandomResizedCrop(image_size, antialias=True), v2.RandomHorizontalFlip(),
                            v2.TrivialAugmentWide(), v2.ToImage(), v2.ToDtype(torch.float32, scale=True),
                            v2.Normalize(IMAGENET_MEAN, IMAGENET_STD), v2.RandomErasing(p=0.1)])
    mix = v2.RandomChoice([v2.MixUp(alpha=0.2, num_classes=1000), v2.CutMix(alpha=1.0, num_classes=1000)])
    return transform, mix


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("data")
    p.add_argument("--model", default="none")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--recipe", default="standard")
    p.add_argument("--validation", action="store_true", help="time whole train=False passes (loader only)")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--workers", type=int, default=None)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--ceiling-seconds", type=float, default=5.0, help="how long the model alone is timed")
    p.add_argument("--json")
    args = p.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if args.validation and (args.model != "none" or args.recipe != "standard"):
        raise SystemExit("--validation times the loader alone, with its own Resize + CenterCrop")
    result = {"tree": gpufeed.__file__, "model": args.model, "compile": args.compile, "recipe": args.recipe,
              "validation": args.validation, "epochs": [], "ceiling": None}
    step = None
    if args.model != "none":
        if device.type != "cuda":
            raise SystemExit("--model needs a CUDA device")
        step = make_step(args.model, device, args.compile)
        result["ceiling"] = ceiling(step, args.batch_size, device, args.ceiling_seconds)
    transform, mix = recipe(args.recipe)
    kwargs = {"transform": transform, "batch_transform": mix} if transform is not None else {}
    if device.type == "cuda":  # what the loader takes of the device: the drop in free memory (dali_loop.py's too)
        torch.cuda.synchronize(device)
        free0 = least_free = torch.cuda.mem_get_info(device)[0]
    if args.validation:  # the recipe is the standard one (checked above): the loader's own Resize + CenterCrop
        kwargs = {"train": False, "drop_last": False}
    try:
        loader = ImageLoader(args.data, batch_size=args.batch_size, num_workers=args.workers, device=device,
                             channels_last=step is not None, **kwargs)
    except TypeError as e:  # a tree without transform= (recipes)
        result["unsupported"] = f"this tree's ImageLoader: {e}"
        print(result["unsupported"], file=sys.stderr)
        _write(result, args.json)
        return 0
    result["idle_cores"], result["cpu_shares"] = [], []  # per epoch: the machine's idle cores, the share at its end
    cores = IdleCores()  # what the share's rule reads, read here on its own
    with loader:
        for epoch in range(args.epochs):
            loader.set_epoch(epoch)
            cores.poll()  # the window starts here (the gap since the last epoch's end is a few ms)
            result["epochs"].append(plain_epoch(loader, step, device))
            idle = cores.poll()
            result["idle_cores"].append(None if idle is None else round(idle, 2))
            result["cpu_shares"].append(loader.stats.get("cpu_share"))
            if device.type == "cuda":
                least_free = min(least_free, torch.cuda.mem_get_info(device)[0])
        stats = loader.stats
    if device.type == "cuda":
        result["memory_added"] = free0 - least_free
    result["images_per_s"] = statistics.median(result["epochs"][1:])
    result["of_ceiling"] = result["images_per_s"] / result["ceiling"] if result["ceiling"] else None
    result["cpu_share"] = stats.get("cpu_share")
    # the tree's cropped CPU decode, built or not (a tree without it decodes whole images on the CPU)
    result["cropped_decode"] = importlib.util.find_spec("gpufeed.decode._turbo_crop") is not None
    result["decode_backend"] = stats.get("decode_backend")
    result["decoded_by"] = stats.get("decoded_by")  # validation too: the GPU decoders' part and the CPU's
    print(f"{'validation' if args.validation else args.model}{' compiled' if args.compile else ''}, "
          f"recipe {args.recipe}: "
          + ", ".join(f"{r:,.0f}" for r in result["epochs"]) + " images/s by epoch; "
          + (f"{100 * result['of_ceiling']:.1f}% of its own rate {result['ceiling']:,.0f}"
             if result["ceiling"] else "loader only") + f"; {result['decode_backend']}, CPU share {result['cpu_share']}"
          + (f"; device memory added {result['memory_added'] / 1e9:.2f} GB" if "memory_added" in result else "")
          + "; idle cores by epoch " + ", ".join("-" if c is None else f"{c:.1f}" for c in result["idle_cores"])
          + "; CPU share by epoch " + ", ".join("-" if c is None else f"{c:.2f}" for c in result["cpu_shares"]))
    _write(result, args.json)
    return 0


def _write(result: dict, path: str | None) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    sys.exit(main())
