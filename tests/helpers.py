"""Helpers the test modules share."""

from __future__ import annotations

import math

import numpy as np


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    """PSNR in dB of two arrays of 0-255 values (any dtype, the same shape); identical arrays give about 168 dB
    (the error floored at 1e-12) rather than infinity, so medians and prints stay finite."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.shape != b.shape:
        raise ValueError(f"psnr compares arrays of one shape, got {a.shape} and {b.shape}")
    mse = np.mean((a - b) ** 2)
    return 10 * math.log10(255**2 / max(mse, 1e-12))

