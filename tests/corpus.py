"""A generated corpus of odd and broken images (Pillow, simplejpeg, numpy, byte patching).

``DECODABLE``: kind -> bytes that must decode to the same RGB as Pillow's ``convert("RGB")``.
``UNDECODABLE``: kind -> bytes that must be refused with an error naming the file.
Content is a smooth gradient with a distinct mean colour per kind, so a delivered
crop can be traced back to its file.
"""

from __future__ import annotations

import io
import struct
import tarfile
import zlib

import numpy as np
import simplejpeg
from PIL import Image


def _pixels(w: int, h: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    base = rng.integers(40, 216, 3)
    yy, xx = np.mgrid[0:h, 0:w]
    grad = ((xx / max(w - 1, 1) - 0.5) * 30 + (yy / max(h - 1, 1) - 0.5) * 20)[..., None]
    return np.clip(base + grad, 0, 255).astype(np.uint8)


def _save(img: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


def jpeg(w=96, h=72, seed=0, **kw) -> bytes:
    return _save(Image.fromarray(_pixels(w, h, seed)), "JPEG", quality=92, **kw)


def _ycck() -> bytes:
    data = bytearray(_save(Image.fromarray(_pixels(64, 48, 5)).convert("CMYK"), "JPEG", quality=95))
    i = data.find(b"Adobe")
    data[i + 11] = 2  # APP14 transform 2: the four components are YCCK
    return bytes(data)


def _exif(orientation: int) -> bytes:
    img = Image.fromarray(_pixels(80, 40, 11))
    exif = Image.Exif()
    exif[0x0112] = orientation
    return _save(img, "JPEG", quality=95, exif=exif.tobytes())


def _malformed_exif() -> bytes:
    data = jpeg(64, 48, 12)
    junk = b"Exif\x00\x00MM\x00\x2a\x00\x00\x00\x08\xff\xff\xff\xff garbage"
    app1 = b"\xff\xe1" + struct.pack(">H", len(junk) + 2) + junk
    return data[:2] + app1 + data[2:]


DECODABLE = {
    "baseline_420": lambda: jpeg(seed=1),
    "cmyk": lambda: _save(Image.fromarray(_pixels(64, 48, 2)).convert("CMYK"), "JPEG", quality=95),
    "ycck": _ycck,
    "grayscale": lambda: _save(Image.fromarray(_pixels(64, 48, 3)).convert("L"), "JPEG", quality=95),
    "progressive": lambda: jpeg(seed=4, progressive=True),
    **{f"subsampling_{s}": (lambda s=s: simplejpeg.encode_jpeg(_pixels(64, 48, 20 + int(s)), 92, "RGB", s))
       for s in ("444", "422", "440", "411")},
    "restart_markers": lambda: jpeg(seed=6, restart_marker_rows=1),
    "tiny_1x1": lambda: jpeg(1, 1, 7),
    "tiny_7x3": lambda: jpeg(7, 3, 8),
    "odd_45x29": lambda: jpeg(45, 29, 9),
    "png_rgb_named_jpg": lambda: _save(Image.fromarray(_pixels(50, 40, 13)), "PNG"),
    "png_palette_named_jpg": lambda: _save(Image.fromarray(_pixels(50, 40, 14)).convert("P"), "PNG"),
    "png_rgba_named_jpg": lambda: _save(Image.fromarray(_pixels(50, 40, 15)).convert("RGBA"), "PNG"),
    "webp_named_jpg": lambda: _save(Image.fromarray(_pixels(50, 40, 16)), "WEBP", lossless=True),
    "bmp_named_jpg": lambda: _save(Image.fromarray(_pixels(50, 40, 17)), "BMP"),
    "exif_rotated": lambda: _exif(6),
    "malformed_exif": _malformed_exif,
}


def _sof_offset(data: bytes) -> int:
    i = 2
    while i < len(data):
        marker, length = data[i + 1], struct.unpack(">H", data[i + 2 : i + 4])[0]
        if marker in (0xC0, 0xC1, 0xC2):
            return i
        i += 2 + length
    raise ValueError("no SOF marker")


def _patched_sof(precision=None, size=None) -> bytes:
    data = bytearray(jpeg(64, 48, 30))
    i = _sof_offset(data)
    if precision is not None:
        data[i + 4] = precision
    if size is not None:
        data[i + 5 : i + 9] = struct.pack(">HH", *size)
    return bytes(data)


def _scan_start(data: bytes) -> int:
    return data.find(b"\xff\xda")


def _corrupt_marker() -> bytes:
    data = bytearray(jpeg(96, 72, 31))
    mid = (_scan_start(data) + len(data)) // 2
    data[mid : mid + 2] = b"\xff\xc4"  # a DHT marker inside entropy-coded data
    return bytes(data)


def _png_bomb(w=65000, h=65000) -> bytes:
    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    chunk = lambda t, d: struct.pack(">I", len(d)) + t + d + struct.pack(">I", zlib.crc32(t + d) & 0xFFFFFFFF)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\x00" * 16)) + chunk(b"IEND", b"")


# Formats Pillow has plugins for, which gpufeed does not read: refused by content, whatever the name (EPS
# would go to Ghostscript)
EPS = (b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 8 8\nnewpath 0 0 moveto 8 8 lineto stroke\nshowpage\n"
       b"%%EOF\n")

UNDECODABLE = {
    "zero_bytes": lambda: b"",
    "eps_named_jpg": lambda: EPS,
    "gif_named_jpg": lambda: _save(Image.fromarray(_pixels(50, 40, 18)), "GIF"),
    "junk": lambda: bytes(np.random.default_rng(0).integers(0, 256, 3000, dtype=np.uint8)),
    "truncated_header": lambda: jpeg(96, 72, 32)[:60],
    "truncated_scan": lambda: (lambda d: d[: (_scan_start(d) + len(d)) // 2])(jpeg(96, 72, 33)),
    "corrupt_marker": _corrupt_marker,
    "precision_12_bit": lambda: _patched_sof(precision=12),
    "jpeg_header_bomb": lambda: _patched_sof(size=(65000, 65000)),
    "png_header_bomb": _png_bomb,
}


def reference_rgb(data: bytes, exif_orientation: bool = False) -> np.ndarray:
    """Pillow's decode, the reference for every path."""
    from PIL import ImageOps

    with Image.open(io.BytesIO(data)) as im:
        im.load()
        if exif_orientation:
            im = ImageOps.exif_transpose(im)
        return np.asarray(im.convert("RGB"))


def tar_with_links(path) -> None:
    """A tar shard at ``path``: one JPEG (``a.jpg``, label 3) and four members named like images that are no
    regular file: a symbolic link, a hard link, a character device and a FIFO."""
    with tarfile.open(path, "w") as tf:
        for name, data in (("a.jpg", jpeg(32, 24, seed=1)), ("a.cls", b"3")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
        for name, kind in (("sym.jpg", tarfile.SYMTYPE), ("hard.jpg", tarfile.LNKTYPE), ("dev.jpg", tarfile.CHRTYPE),
                           ("fifo.jpg", tarfile.FIFOTYPE)):
            info = tarfile.TarInfo(name)
            info.type, info.linkname = kind, "a.jpg"
            tf.addfile(info)
