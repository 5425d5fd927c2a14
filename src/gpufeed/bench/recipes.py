"""Training recipes ``gpufeed bench --recipe`` times both ways: the usual DataLoader running the torchvision
transforms per image in its workers, and gpufeed given the same ``Compose`` (``ImageLoader(transform=)``).

A recipe is a built-in name or a Python file defining ``transform`` (a torchvision ``Compose``) and, if it
wants one, ``batch_transform`` (e.g. ``v2.MixUp``), called on each batch on the device in both pipelines.
"""

from __future__ import annotations

import runpy
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torchvision.transforms import v2

from ..augment.normalize import IMAGENET_MEAN, IMAGENET_STD

BUILT_IN = ("standard", "trivialaugment", "trivialaugment-mix", "resize-randomcrop")


@dataclass(frozen=True)
class BenchRecipe:
    name: str
    transform: Any
    batch_transform: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None


def load_recipe(spec: str, image_size: int = 224, num_classes: int = 1000) -> BenchRecipe:
    """``spec``: a name from ``BUILT_IN`` or the path of a .py file (ValueError otherwise, naming it)."""
    if spec.endswith(".py"):
        try:
            names = runpy.run_path(spec)
        except FileNotFoundError:
            raise FileNotFoundError(f"--recipe {spec!r}: no such file") from None
        if "transform" not in names:
            raise ValueError(f"--recipe {spec!r} defines no `transform` (a torchvision Compose)")
        return BenchRecipe(spec, names["transform"], names.get("batch_transform"))
    if spec not in BUILT_IN:
        raise ValueError(f"--recipe must be one of {BUILT_IN} or a .py file, got {spec!r}")
    head = [v2.RandomResizedCrop(image_size, antialias=True), v2.RandomHorizontalFlip()]
    tail = [v2.ToImage(), v2.ToDtype(torch.float32, scale=True), v2.Normalize(IMAGENET_MEAN, IMAGENET_STD)]
    if spec == "standard":
        return BenchRecipe(spec, v2.Compose(head + tail))
    if spec == "resize-randomcrop":  # the older ImageNet recipe: the crop taken from the resized image as it is
        return BenchRecipe(spec, v2.Compose([v2.Resize(round(image_size * 256 / 224)), v2.RandomCrop(image_size),
                                             v2.RandomHorizontalFlip()] + tail))
    # torchvision's reference recipe for TrivialAugment (random erasing 0.1; MixUp 0.2 / CutMix 1.0)
    transform = v2.Compose(head + [v2.TrivialAugmentWide()] + tail + [v2.RandomErasing(p=0.1)])
    mix = None
    if spec == "trivialaugment-mix":
        mix = v2.RandomChoice([v2.MixUp(alpha=0.2, num_classes=num_classes),
                               v2.CutMix(alpha=1.0, num_classes=num_classes)])
    return BenchRecipe(spec, transform, mix)
