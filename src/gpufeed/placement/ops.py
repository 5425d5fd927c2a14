"""Where each op of a torchvision recipe runs: on the device (gpufeed's own version, per sample on the batch,
after the crop and the flip) or in the CPU workers (torchvision's own op, per sample on the uint8 image).

The rule, stated once: an op runs on the device where gpufeed has a device version of it (``device_version``:
the names below; a container whose ops all have one) and its place lets it run there (``on_device``). The
device runs its per-sample ops after the crop and the flip, each from a stream of its own, so a pixel op
standing before the crop, or before a flip it does not commute with, or a second one of a kind, runs in the
workers, as does every op without a device version. ``augment.recipe._worker_span`` widens the workers' stretch
around those to keep the recipe's order.
"""

from __future__ import annotations

from typing import Any, Sequence

# uint8 tensors as a PIL image is: anywhere before the cast to float, as torchvision's own recipes place them
UINT8_OPS = ("ToImage", "PILToTensor", "ToPureTensor")
SIZING = ("RandomResizedCrop", "RandomCrop", "Resize", "CenterCrop")
# pixel ops that give the same pixels either side of a horizontal flip (pointwise, or a symmetric kernel)
FLIP_COMMUTING = ("RandomVerticalFlip", "ColorJitter", "RandomGrayscale", "GaussianBlur", "RandomAdjustSharpness")
CONTAINERS = ("RandomApply", "RandomChoice", "RandomOrder")
PIXEL_OPS = FLIP_COMMUTING + ("TrivialAugmentWide", "RandAugment", "AutoAugment", "AugMix", "RandomPerspective",
                              *CONTAINERS)
SUPPORTED = ("RandomResizedCrop", "RandomCrop", "Resize", "CenterCrop", "RandomHorizontalFlip", *PIXEL_OPS, "ToImage",
             "PILToTensor", "ToPureTensor", "ToTensor", "ToDtype", "ConvertImageDtype", "Normalize", "RandomErasing")
PERSPECTIVE_INTERPOLATIONS = ("nearest", "bilinear")  # what torchvision's tensor kernel (and the device's) takes


def inner_ops(op: Any) -> list[Any]:
    """A container's ops, each ``Compose`` among them read as its own ops."""
    out = []
    for inner in list(op.transforms):
        out.extend(inner_ops(inner) if type(inner).__name__ == "Compose" else [inner])
    return out


def interpolation_name(op: Any, default: str) -> str:
    """The op's ``interpolation`` as a lower-case name ("bilinear"), of an ``InterpolationMode`` or a string."""
    mode = getattr(op, "interpolation", default)
    return str(getattr(mode, "value", mode)).lower()


def device_version(op: Any) -> bool:
    """Whether gpufeed has a device version of ``op``: its class is one of ``SUPPORTED``, with a device
    interpolation for RandomPerspective, and a container's ops are all pixel ops that have one."""
    name = type(op).__name__
    if name not in SUPPORTED:
        return False
    if name == "RandomPerspective":
        return interpolation_name(op, "bilinear") in PERSPECTIVE_INTERPOLATIONS
    if name in CONTAINERS:
        return all(type(inner).__name__ in PIXEL_OPS and device_version(inner) for inner in inner_ops(op))
    return True


def flip_commuting(op: Any) -> bool:
    """Whether ``op`` gives the same pixels either side of a horizontal flip (a container: all its ops do)."""
    name = type(op).__name__
    if name in CONTAINERS:
        return all(flip_commuting(inner) for inner in inner_ops(op))
    return name in FLIP_COMMUTING


def on_device(ops: Sequence[Any]) -> list[bool]:
    """For each of ``ops`` (a recipe, its ``Compose``s read through), whether it runs on the device; the others
    run in the CPU workers."""
    names = [type(op).__name__ for op in ops]
    out = []
    for i, (op, name) in enumerate(zip(ops, names, strict=True)):
        later = names[i + 1:]
        out.append(device_version(op) and not (name in PIXEL_OPS and (
            any(n in SIZING for n in later)  # the device runs after the crop
            or ("RandomHorizontalFlip" in later and not flip_commuting(op))  # and after the flip
            or (name in names[:i] and name not in CONTAINERS))))  # one stream per kind; containers own theirs
    return out
