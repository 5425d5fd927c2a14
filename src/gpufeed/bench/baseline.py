"""The usual baseline, as users write it (torchvision's ImageNet example), but for one thing: its images are
opened with Pillow's plugins for gpufeed's formats alone, as gpufeed opens them, so that the bench never hands
the user's files to an external program (``decode.pillow``)."""

from __future__ import annotations

import torch
import torchvision.transforms as T
from torch.utils.data import DataLoader, DistributedSampler
from torchvision.datasets import ImageFolder

from ..augment.normalize import IMAGENET_MEAN, IMAGENET_STD
from ..decode.pillow import FORMATS
from ..sampling import process_group


def load_rgb(path: str):
    """torchvision's ``pil_loader``, with the format list."""
    from PIL import Image

    with open(path, "rb") as f, Image.open(f, formats=FORMATS) as img:
        return img.convert("RGB")


def create_baseline_loader(root: str, *, batch_size: int, num_workers: int, image_size: int = 224,
                           transform=None) -> DataLoader:
    """ImageFolder + ``transform`` (default RandomResizedCrop + flip + ToTensor + Normalize) in a
    DataLoader(pin_memory=True); under an initialised process group with a DistributedSampler, as DDP scripts
    do (call ``sampler.set_epoch``)."""
    transform = transform or T.Compose([
        T.RandomResizedCrop(image_size),
        T.RandomHorizontalFlip(),
        T.ToTensor(),
        T.Normalize(IMAGENET_MEAN, IMAGENET_STD),
    ])
    dataset = ImageFolder(root, transform, loader=load_rgb)
    sampler = DistributedSampler(dataset, drop_last=True) if process_group() is not None else None
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=sampler is None,
        sampler=sampler,
        num_workers=num_workers,
        pin_memory=torch.cuda.is_available(),
        drop_last=True,
    )
