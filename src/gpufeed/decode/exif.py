"""EXIF orientation: read it from the header, apply it to decoded pixels.

Policy (the same on every path): ignored by default, as torchvision and Pillow
do unless asked; ``exif_orientation=True`` applies it before cropping, so the
crop box is drawn in the displayed orientation. A missing or malformed EXIF
block reads as orientation 1 (none), never as an error.
"""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

from .pillow import FORMATS

ORIENTATION_TAG = 0x0112


def read_orientation(data: bytes) -> int:
    """The EXIF orientation (1-8) of an encoded image; 1 when absent or unreadable."""
    try:
        with Image.open(io.BytesIO(data), formats=FORMATS) as im:
            value = int(im.getexif().get(ORIENTATION_TAG, 1))
    except Exception:  # malformed EXIF or header, or no image: the documented fallback is "no rotation"
        return 1
    return value if 1 <= value <= 8 else 1


def swaps_axes(orientation: int) -> bool:
    return orientation in (5, 6, 7, 8)


def apply_orientation(pixels: np.ndarray, orientation: int) -> np.ndarray:
    """(h, w, 3) -> displayed orientation, as Pillow's ``ImageOps.exif_transpose`` does."""
    ops = {
        2: lambda a: a[:, ::-1],  # FLIP_LEFT_RIGHT
        3: lambda a: a[::-1, ::-1],  # ROTATE_180
        4: lambda a: a[::-1],  # FLIP_TOP_BOTTOM
        5: lambda a: a.transpose(1, 0, 2),  # TRANSPOSE
        6: lambda a: np.rot90(a, -1),  # ROTATE_270 (90 degrees clockwise)
        7: lambda a: a.transpose(1, 0, 2)[::-1, ::-1],  # TRANSVERSE
        8: lambda a: np.rot90(a, 1),  # ROTATE_90
    }
    op = ops.get(orientation)
    return pixels if op is None else np.ascontiguousarray(op(pixels))
