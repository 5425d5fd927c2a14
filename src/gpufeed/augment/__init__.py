"""Augment: pixels to training tensors (parameters, CPU crop/resize, device normalise)."""

from .params import AugmentSpec, CropBox, SampleRandom, random_resized_crop

__all__ = ["AugmentSpec", "CropBox", "SampleRandom", "random_resized_crop"]
