"""What every decoder shares: the error type, format sniffing, the pixel cap."""

from __future__ import annotations

DEFAULT_MAX_PIXELS = 100_000_000  # 100 MP: far above real photos, far below a header bomb


class DecodeError(ValueError):
    """An image that could not be decoded; ``path`` names the file."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"cannot decode {path!r}: {reason}")
        self.path = path
        self.reason = reason


def is_jpeg(data: bytes | memoryview) -> bool:
    """True when ``data`` starts with a JPEG SOI marker (by content, not by file name)."""
    return bytes(data[:3]) == b"\xff\xd8\xff"


def check_pixels(width: int, height: int, max_pixels: int, path: str) -> None:
    """Reject a header whose size is empty or over ``max_pixels`` before anything is allocated."""
    if width < 1 or height < 1:
        raise DecodeError(path, f"header gives an empty size {width}x{height}")
    if width * height > max_pixels:
        raise DecodeError(path, f"{width}x{height} is {width * height} pixels, over max_pixels={max_pixels}")
