"""Pillow, asked only for the formats gpufeed reads.

Pillow picks a plugin by the bytes, whatever the file is called, and some plugins hand the bytes to other
programs: an EPS file goes to Ghostscript (``gs``), so an EPS named ``photo.jpg`` in a data set would run
Ghostscript as the training user. gpufeed opens every image with an explicit list of formats: the bytes are
data, and only these decoders see them (docs/security.md).
"""

from __future__ import annotations

import io
import re

from PIL import Image, UnidentifiedImageError

from .base import DecodeError

# torchvision's IMG_EXTENSIONS: .jpg/.jpeg, .png, .ppm/.pgm, .bmp, .tif/.tiff, .webp (by content, not name)
FORMATS = ("JPEG", "PNG", "PPM", "BMP", "TIFF", "WEBP")
_ADDRESS = re.compile(r"<_io\.BytesIO object at 0x[0-9a-fA-F]+>|<[^<>]* at 0x[0-9a-fA-F]+>")


def open_image(data: bytes, path: str) -> Image.Image:
    """``data`` as a lazily decoded Pillow image, if it is one of ``FORMATS``; else ``DecodeError`` naming
    ``path``. Use it as a context manager."""
    try:
        return Image.open(io.BytesIO(data), formats=FORMATS)
    except UnidentifiedImageError:
        raise DecodeError(path, f"not an image of a format gpufeed reads ({', '.join(FORMATS)})") from None
    except Exception as e:  # Pillow raises many types for bad input
        raise DecodeError(path, reason(e)) from None


def reason(e: Exception) -> str:
    """A Pillow error as one line, without the object addresses its messages hold."""
    return f"{type(e).__name__}: {_ADDRESS.sub('the data', str(e))}"
