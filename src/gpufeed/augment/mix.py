"""MixUp and CutMix on delivered batches, drawn from the loader's seed.

torchvision's ``v2.MixUp``, ``v2.CutMix`` and ``v2.RandomChoice`` of them are read for their settings and run
as they compute, after the per-sample ops, rather than called by the training loop with PyTorch's global
random state: a resumed epoch mixes its batches as the first run did (on as many ranks: on another number
the batches are made up differently). On CUDA this runs in the loader's thread on its side stream, so the
training thread, which the interpreter lock makes the loader's threads share, does none of the work. Any
other batch transform is called as given.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch.nn.functional import one_hot

from .ops import kernels
from .params import SampleRandom

__all__ = ["BatchMix", "Mix", "read_batch_transform"]

KINDS = ("MixUp", "CutMix")


class Mix(NamedTuple):
    """One batch's draw: ``kind`` ("MixUp" or "CutMix"); ``lam``, the weight of each sample's own label (and,
    for MixUp, of its own image; for CutMix, the share of its image outside the box); ``box`` (x1, y1, x2, y2)
    pasted from the previous sample of the batch (CutMix; None for MixUp)."""

    kind: str
    lam: float
    box: tuple[int, int, int, int] | None = None


@dataclass(frozen=True)
class BatchMix:
    """``choices``: (kind, alpha) pairs, one taken per batch with probabilities ``p``; ``num_classes``: the
    width of the one-hot labels. Called as ``(images, labels, seed, epoch, key, fresh=False) -> (images,
    labels)``: images (B, C, H, W) any float dtype and memory format, any device, returned mixed in their
    layout (the batch given, or with ``fresh`` maybe a new one: ``apply``); labels (B,) int64 on the same
    device, returned (B, num_classes) float32. ``key`` names the batch within the epoch (its first sample's
    source index), so its draw is the same in any run of that epoch."""

    choices: tuple[tuple[str, float], ...]
    p: tuple[float, ...]
    num_classes: int
    salt: int = 0x7A1B_00B1

    def draw(self, rnd: SampleRandom, height: int, width: int) -> Mix:
        """One batch's draw, in torchvision's order: which transform (RandomChoice), lam ~ Beta(alpha,
        alpha), then for CutMix the box's centre, uniform over the image."""
        k, u, acc = len(self.p) - 1, rnd.uniform(), 0.0
        for i, share in enumerate(self.p):
            acc += share
            if u < acc:
                k = i
                break
        kind, alpha = self.choices[k]
        # each Gamma draw at least the smallest normal float, as torch's Dirichlet clamps them: a tiny alpha
        # can give 0.0 for both
        a, b = max(rnd.gamma(alpha), sys.float_info.min), max(rnd.gamma(alpha), sys.float_info.min)
        lam = a / (a + b)
        if kind == "MixUp":
            return Mix(kind, lam)
        cx, cy = rnd.randint(0, width - 1), rnd.randint(0, height - 1)
        r = 0.5 * math.sqrt(1.0 - lam)
        half_w, half_h = int(r * width), int(r * height)
        x1, y1 = max(cx - half_w, 0), max(cy - half_h, 0)
        x2, y2 = min(cx + half_w, width), min(cy + half_h, height)
        return Mix(kind, float(1.0 - (x2 - x1) * (y2 - y1) / (width * height)), (x1, y1, x2, y2))

    def apply(self, images: torch.Tensor, labels: torch.Tensor, mix: Mix, *,
              fresh: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """``mix`` on the batch, giving what torchvision's transform computes with those parameters: each
        sample paired with the one before it (the first with the last). The images returned keep the batch's
        memory format (a CUDA ``roll`` of the whole batch would return it contiguous): the batch given, mixed
        in place, or, with ``fresh`` (a batch just made for this call, which nothing else holds), for MixUp
        a new batch where its Triton kernel runs (``kernels.mixup``: one pass, not four; the batch given is
        then let go). A batch from the loader's fixed GPU outputs is mixed in place, so the loader's GPU
        memory stays within its budget (``placement.gpu_memory``)."""
        lam = mix.lam
        if mix.kind == "MixUp":
            images = _mixup(images, lam, fresh)
        else:
            x1, y1, x2, y2 = mix.box
            images[..., y1:y2, x1:x2] = images[..., y1:y2, x1:x2].roll(1, 0)
        label = one_hot(labels, num_classes=self.num_classes).float()
        return images, label.roll(1, 0).mul_(1.0 - lam).add_(label.mul(lam))

    def __call__(self, images: torch.Tensor, labels: torch.Tensor, seed: int, epoch: int, key: int, *,
                 fresh: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        mix = self.draw(SampleRandom(seed ^ self.salt, epoch, key), images.shape[-2], images.shape[-1])
        return self.apply(images, labels, mix, fresh=fresh)


def _mixup(images: torch.Tensor, lam: float, fresh: bool) -> torch.Tensor:
    """MixUp's images: through the Triton kernel where it runs and ``fresh`` allows a new batch, else mixed
    in place."""
    if fresh and kernels.usable(images) and kernels.mixes(images):
        try:
            return kernels.mixup(images, lam)
        except kernels.KernelsFailed:  # said once, and the kernels are off: the PyTorch passes
            pass
    rolled = torch.cat((images[-1:], images[:-1])).mul_(1.0 - lam)  # the same sum as torchvision's
    return images.mul_(lam).add_(rolled)  # rolled * (1 - lam) + images * lam


def read_batch_transform(transform: Any) -> BatchMix | None:
    """The ``BatchMix`` a torchvision v2 ``MixUp``, ``CutMix`` or ``RandomChoice`` of them (with the default
    labels getter and one ``num_classes``) is; None for anything else, which the loader calls as given.
    ValueError for one without ``num_classes`` (the loader's labels are class indices)."""
    try:
        from torchvision.transforms import v2
    except ImportError:  # then it cannot be one of them
        return None
    try:
        from torchvision.transforms.v2._utils import _find_labels_default_heuristic as default_getter
    except ImportError:  # another torchvision: its getter cannot be recognised, so none is taken over
        return None
    if type(transform) is v2.RandomChoice:  # a subclass may choose another way: called as given
        parts, p = list(transform.transforms), tuple(float(x) for x in transform.p)
    else:
        parts, p = [transform], (1.0,)
    if not parts or any(type(t) not in (v2.MixUp, v2.CutMix) for t in parts):
        return None
    if any(getattr(t, "_labels_getter", None) is not default_getter for t in parts):
        return None  # labels found another way: called as given
    for t in parts:
        if t.num_classes is None:
            raise ValueError(f"batch_transform {t!r} has num_classes=None: the loader's labels are class "
                             "indices, so give it num_classes")
    if len({t.num_classes for t in parts}) > 1:
        return None  # torchvision would give labels of different widths from batch to batch: called as given
    return BatchMix(tuple((type(t).__name__, float(t.alpha)) for t in parts), p, int(parts[0].num_classes))
