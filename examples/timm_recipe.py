"""timm's ImageNet training recipe fed by gpufeed: the augmentation written as a torchvision v2
Compose, Mixup/CutMix on each finished batch, a timm model. It needs timm (pip install timm);
without it, the script says so and runs the same recipe with torchvision's model, MixUp/CutMix and
AdamW.

    python examples/timm_recipe.py /data/imagenet/train --steps 1000
    python examples/timm_recipe.py --synth 64 --steps 2 --device cpu --model resnet18 \\
        --image-size 64 --batch-size 8

The recipe is timm's train.py ImageNet one (the ResNet Strikes Back family), as far as gpufeed
runs it:

    timm                                   here
    RandomResizedCrop(scale 0.08-1),       v2.RandomResizedCrop, v2.RandomHorizontalFlip (bilinear)
      hflip 0.5
    RandAugment rand-m9-mstd0.5            v2.TrivialAugmentWide (timm's "ta_wide"), per sample on
                                           the device
    RandomErasing(0.25, mode "pixel")      v2.RandomErasing(0.25, value=0): constant fill (timm's
                                           "const")
    Mixup(0.1) + CutMix(1.0),              timm.data.Mixup as batch_transform (else v2.MixUp /
      smoothing 0.1                        v2.CutMix)
    SoftTargetCrossEntropy, LAMB, cosine   the same (without timm: the same loss, AdamW, cosine)

``--synth N`` trains on N generated ImageNet-like JPEGs in a temporary folder (CPU runs, tests).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time

import torch
import torch.nn.functional as F
from torchvision.transforms import v2

from gpufeed import IMAGENET_MEAN, IMAGENET_STD, ImageLoader, create_synthetic_dataset
from gpufeed.sources import create_source

try:
    import timm
    import timm.data
    import timm.loss
    import timm.optim
except ImportError:  # the same recipe with torchvision's model, MixUp/CutMix and loss
    timm = None


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """--help: the module docstring as written, every option's default after its help."""


def create_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="examples/timm_recipe.py", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("data", nargs="?", help="ImageFolder-layout training folder (or --synth)")
    p.add_argument("--synth", type=int, default=0, metavar="N",
                   help="train on N generated JPEGs in a temporary folder instead (0: use DATA)")
    p.add_argument("--model", default="resnet50", help="timm model name (torchvision's, without timm)")
    p.add_argument("--steps", type=int, default=100, help="training steps (optimizer updates)")
    p.add_argument("--batch-size", type=int, default=256, help="images per step")
    p.add_argument("--image-size", type=int, default=224, help="RandomResizedCrop size, in pixels")
    p.add_argument("--lr", type=float, default=5e-3, help="peak learning rate of LAMB (AdamW without timm)")
    p.add_argument("--weight-decay", type=float, default=0.02, help="weight decay")
    p.add_argument("--device", default="auto", help="auto (the GPU, else the CPU), cpu, cuda or cuda:N")
    p.add_argument("--workers", type=int, metavar="N", help="loader worker processes (none: the usable cores)")
    p.add_argument("--seed", type=int, default=0, help="the model's initialisation, Mixup's draws, the loader's order")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = create_parser()
    args = p.parse_args(argv)
    if (args.data is None) == (args.synth == 0):
        p.error(f"give a data folder or --synth N, one of them (got data={args.data!r}, --synth {args.synth})")
    return args


def recipe(size: int) -> v2.Compose:
    """The per-sample augmentation, as a training script gives it to a Dataset; gpufeed reads it."""
    return v2.Compose([v2.RandomResizedCrop(size, scale=(0.08, 1.0)), v2.RandomHorizontalFlip(),
                       v2.TrivialAugmentWide(), v2.ToImage(), v2.ToDtype(torch.float32, scale=True),
                       v2.Normalize(IMAGENET_MEAN, IMAGENET_STD), v2.RandomErasing(p=0.25, value=0)])


def mixing(num_classes: int):
    """Mixup/CutMix on a finished batch on the device, f(images, labels) -> (images, soft labels)."""
    if timm is not None:
        return timm.data.Mixup(mixup_alpha=0.1, cutmix_alpha=1.0, switch_prob=0.5, label_smoothing=0.1,
                               num_classes=num_classes)
    return v2.RandomChoice([v2.MixUp(alpha=0.1, num_classes=num_classes),
                            v2.CutMix(alpha=1.0, num_classes=num_classes)])


def create_model(name: str, num_classes: int) -> tuple[torch.nn.Module, str]:
    if timm is not None:
        return timm.create_model(name, num_classes=num_classes), f"timm {timm.__version__} {name}"
    import torchvision

    return (torchvision.models.get_model(name, num_classes=num_classes),
            f"torchvision {torchvision.__version__} {name} (timm is not installed)")


def soft_cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """timm's SoftTargetCrossEntropy, for runs without timm: the batch mean of -sum(target * log_softmax)."""
    return torch.sum(-target * F.log_softmax(logits, dim=-1), dim=-1).mean()


def create_optimizer(model: torch.nn.Module, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    if timm is not None:  # no weight decay on biases and norms, as timm's train.py
        return timm.optim.create_optimizer_v2(model, "lamb", lr=lr, weight_decay=weight_decay)
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)


def main(argv=None) -> int:
    args = parse_args(argv)
    if timm is None:
        print("timm is not installed: running torchvision's model, MixUp/CutMix and AdamW instead; for timm's "
              "recipe: pip install timm", file=sys.stderr)
    torch.manual_seed(args.seed)  # the model's initialisation, and timm's Mixup, draw from the global random state
    with contextlib.ExitStack() as stack:
        root = args.data
        if args.synth:
            root = create_synthetic_dataset(stack.enter_context(tempfile.TemporaryDirectory()), n=args.synth,
                                            num_classes=4, seed=args.seed, workers=1)
        source = create_source(root)
        num_classes = len(source.classes) or 1000
        loader = stack.enter_context(ImageLoader(source, transform=recipe(args.image_size), batch_size=args.batch_size,
                                                 batch_transform=mixing(num_classes), device=args.device,
                                                 num_workers=args.workers, seed=args.seed, channels_last=True))
        if len(loader) == 0:
            raise SystemExit(f"{len(source)} images make no whole batch of {args.batch_size}: lower --batch-size")
        model, which = create_model(args.model, num_classes)
        model = model.to(loader.device, memory_format=torch.channels_last)
        optimizer = create_optimizer(model, args.lr, args.weight_decay)
        criterion = timm.loss.SoftTargetCrossEntropy() if timm is not None else soft_cross_entropy
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)
        cast = torch.autocast("cuda", torch.bfloat16) if loader.device.type == "cuda" else contextlib.nullcontext()
        print(f"model: {which}; {len(loader.source)} images, {num_classes} classes, device {loader.device}, "
              f"decode {loader.decode_backend}; python3 examples/timm_recipe.py "
              f"{' '.join(sys.argv[1:] if argv is None else argv)}")
        step = t0 = 0
        while step < args.steps:
            for images, target in loader:  # images (B, 3, S, S) normalised, target (B, classes) soft labels
                with cast:
                    loss = criterion(model(images), target)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                schedule.step()
                step += 1
                print(f"step {step}: loss {loss.item():.4f}, lr {schedule.get_last_lr()[0]:.2e}")
                if step == 1:  # the rate leaves out the first step (start-up, first kernels)
                    t0 = time.perf_counter()
                if step == args.steps:
                    break
        rate = (step - 1) * args.batch_size / (time.perf_counter() - t0) if step > 1 else float("nan")
        print(f"{step} steps; {rate:,.0f} images/s after the first")
    return 0


if __name__ == "__main__":
    sys.exit(main())
