"""Validation's ``Resize(resize_size)`` + ``CenterCrop(image_size)`` for a batch of decoded images, in Pillow's
arithmetic, computing only the crop's pixels.

torchvision's ``Resize`` on a PIL image is Pillow's antialiased bilinear resize (``Image.resize(size,
BILINEAR)``): per axis a triangle filter whose support grows with the downscale factor, coefficients in
float64 normalised per output pixel and rounded to 22-bit integers, one axis's pass and its result rounded
to uint8, then the other's (Pillow's ``libImaging/Resample.c``: ``precompute_coeffs``,
``normalize_coeffs_8bpc``, ``ImagingResampleInner``). A pixel of the centre crop depends only on its
position in the resized image, so the crop's S x S pixels, mapped back through the resize, are computed and
no other: the same integers as resizing the whole image and cropping it.

Which pass comes first is the installed Pillow's rule (``vertical_first``), learnt once per process from six
small resizes on both sides of Pillow 13's threshold (``pillow_order``): Pillow's Resample.c up to 12.x always
starts horizontally; Pillow 13 starts vertically where the height shrinks by more than twice the pixels the
width does. With an order this module does not know (a Pillow of another rule) the horizontal pass comes first
and ``pillow_order`` says so once, naming the Pillow and the way out (``decode="cpu"``, whose workers resize
with Pillow itself, or a Pillow it knows): a pixel may then differ by a level here and there (about 55 dB).

Input, as for ``augment.fused``: decoded images packed in one flat uint8 buffer (each (h, w, 3) HWC at its
own offset) and one int64 row per sample (``records.KernelRow``):

    table[b] = (offset, h, w, left, top, resized width, resized height, 0)

Output: (B, 3, S, S) ``dtype`` written through its strides, each pixel ``v * scale[c] + shift[c]`` (uint8 with
scale 1 and shift 0: the pixels themselves). An S x S image with the geometry (0, 0, S, S) is copied exactly.

``center_crop_triton`` is two launches: the coefficients of each sample's crop rows and columns (float64, as
Pillow computes them), then the integer sums, each output pixel on its own: for every tap of the second pass,
the first pass's sum at that row (or column) is computed again and rounded to uint8, so a first-pass value is
recomputed by every output pixel that reads it (taps x taps loads per pixel and channel) rather than computed
once and kept. ``center_crop_reference`` is the same arithmetic in numpy, one sample at a time, its first pass
computed once for the crop (a CPU device, CUDA without Triton, the tests).
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import Sequence

import numpy as np
import torch

PRECISION_BITS = 22  # Pillow's 8-bit coefficients: 32 - 8 - 2
_HALF = 1 << (PRECISION_BITS - 1)


def taps(in_size: int, out_size: int) -> int:
    """Pillow's coefficients per output pixel for resizing ``in_size`` to ``out_size`` (bilinear: support 1,
    scaled by the downscale factor)."""
    return int(math.ceil(max(in_size / out_size, 1.0))) * 2 + 1


def axis_coefficients(in_size: int, out_size: int, first: int, count: int) -> tuple[np.ndarray, np.ndarray]:
    """Pillow's bilinear coefficients for outputs ``first ... first + count - 1`` of an ``in_size`` ->
    ``out_size`` resize: ((count,) int64 first input index, (count, taps) int64 weights, 2**22 = 1)."""
    scale = in_size / out_size
    filterscale = max(scale, 1.0)
    support, ss = filterscale, 1.0 / filterscale
    center = (np.arange(first, first + count, dtype=np.float64) + 0.5) * scale
    lo = np.maximum(np.floor(center - support + 0.5), 0.0)
    n = np.minimum(np.floor(center + support + 0.5), float(in_size)) - lo
    k = taps(in_size, out_size)
    w = np.zeros((count, k))
    ww = np.zeros(count)
    for t in range(k):  # summed in order, as Pillow sums (numpy's pairwise sum rounds otherwise)
        x = ((t + lo) - center + 0.5) * ss
        w[:, t] = np.where(t < n, np.maximum(1.0 - np.abs(x), 0.0), 0.0)
        ww += w[:, t]
    w = np.where(ww[:, None] != 0.0, w / np.where(ww == 0.0, 1.0, ww)[:, None], w)
    return lo.astype(np.int64), np.floor(0.5 + w * float(1 << PRECISION_BITS)).astype(np.int64)


def _clip8(s: np.ndarray) -> np.ndarray:
    return np.clip(s >> PRECISION_BITS, 0, 255)


def vertical_first(width: int, height: int, new_width: int, new_height: int, rule: int) -> bool:
    """Whether Pillow's resize of a ``width`` x ``height`` image to ``new_width`` x ``new_height`` takes its
    vertical pass first: ``rule`` 1 (Pillow 13: where the height shrinks by more than twice the pixels the
    width does), else never (``pillow_order``)."""
    return bool(rule) and new_height < height and height - new_height > 2 * (width - new_width)


def center_crop_pixels(image: np.ndarray, width: int, height: int, left: int, top: int, size: int,
                       rule: int | None = None) -> np.ndarray:
    """(size, size, 3) uint8: the ``size`` square at (``left``, ``top``) of ``image`` ((h, w, 3) uint8) resized
    to ``width`` x ``height`` by Pillow's bilinear filter, computed for that square alone, its passes in the
    order ``rule`` gives (``vertical_first``; None: the installed Pillow's, ``pillow_order``)."""
    h, w = image.shape[:2]
    fy, wy = axis_coefficients(h, height, top, size)
    fx, wx = axis_coefficients(w, width, left, size)
    rows = np.minimum(fy[:, None] + np.arange(wy.shape[1]), h - 1)  # (S, ky): a row past the count weighs 0
    cols = np.minimum(fx[:, None] + np.arange(wx.shape[1]), w - 1)  # (S, kx)
    if vertical_first(w, h, width, height, pillow_order() if rule is None else rule):
        c0, c1 = int(cols.min()), int(cols.max()) + 1
        down = _clip8((image[:, c0:c1].astype(np.int64)[rows] * wy[:, :, None, None]).sum(axis=1) + _HALF)
        return _clip8((down[:, cols - c0] * wx[None, :, :, None]).sum(axis=2) + _HALF).astype(np.uint8)
    r0, r1 = int(rows.min()), int(rows.max()) + 1
    across = _clip8((image[r0:r1].astype(np.int64)[:, cols] * wx[None, :, :, None]).sum(axis=2) + _HALF)
    return _clip8((across[rows - r0] * wy[:, :, None, None]).sum(axis=1) + _HALF).astype(np.uint8)


# (width, height, new width, new height): three shapes that Pillow 13's rule resizes vertically first (the height
# shrinking by just over, and well over, twice the pixels the width does) and three it resizes horizontally
# first though the height shrinks more (exactly twice, and less): each side of the threshold, near it and not
_ORDER_PROBES = ((40, 80, 32, 32), (50, 90, 40, 69), (64, 100, 48, 60),
                 (50, 90, 40, 70), (64, 100, 48, 68), (80, 120, 60, 90))


@functools.cache
def pillow_order() -> int:
    """The installed Pillow's order of passes, as ``vertical_first``'s ``rule``: learnt from resizes of noise
    images (``_ORDER_PROBES``), which the two orders round differently; a rule must give Pillow's pixels on
    every probe. A Pillow that matches neither (another rule) gets 0, said once in a warning."""
    import PIL
    from PIL import Image

    rng = np.random.default_rng(0)
    probes = []
    for w, h, new_w, new_h in _ORDER_PROBES:
        image = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        size = min(new_w, new_h)
        got = np.asarray(Image.fromarray(image).resize((new_w, new_h), Image.BILINEAR))[:size, :size]
        probes.append((image, new_w, new_h, size, got))
    for rule in (1, 0):
        if all(np.array_equal(got, center_crop_pixels(image, new_w, new_h, 0, 0, size, rule))
               for image, new_w, new_h, size, got in probes):
            return rule
    warnings.warn(f"gpufeed: Pillow {PIL.__version__} orders its resize passes by a rule gpufeed does not know; "
                  "validation's Resize + CenterCrop on the device may differ from torchvision's by a level in a few "
                  "pixels. For torchvision's pixels exactly, decode on the CPU (ImageLoader(..., decode=\"cpu\"): the "
                  "workers resize with Pillow itself) or install a Pillow whose order gpufeed knows "
                  "(pip install \"pillow>=12,<13.1\")", stacklevel=2)
    return 0


def center_crop_reference(flat: torch.Tensor, table: torch.Tensor, size: int, scale: Sequence[float] | torch.Tensor,
                          shift: Sequence[float] | torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The kernels' function in numpy, one sample at a time (``out`` on any device)."""
    scale_t = torch.as_tensor(scale, dtype=torch.float32, device=out.device).view(3, 1, 1)
    shift_t = torch.as_tensor(shift, dtype=torch.float32, device=out.device).view(3, 1, 1)
    for b, (off, h, w, left, top, width, height, _) in enumerate(table.tolist()):
        image = flat[off : off + h * w * 3].view(h, w, 3).cpu().numpy()
        pix = torch.from_numpy(center_crop_pixels(image, width, height, left, top, size, pillow_order()))
        pix = pix.to(out.device)
        val = pix.permute(2, 0, 1).float() * scale_t + shift_t
        out[b] = val.add(0.5).floor_().clamp_(0, 255).to(out.dtype) if out.dtype == torch.uint8 else val.to(out.dtype)
    return out


try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton: the reference is used
    triton = None

if triton is not None:
    from .fused import level

    @triton.jit
    def _taps(in_size, out_size):
        """``taps``: Pillow's coefficients per output pixel."""
        return tl.ceil(tl.maximum(in_size.to(tl.float64) / out_size.to(tl.float64), 1.0)).to(tl.int32) * 2 + 1

    @triton.jit
    def _axis_coefficients(dst, in_size, out_size, first, S, K, BLOCK_S: tl.constexpr):
        """``axis_coefficients`` for outputs first ... first + S - 1, into rows of K + 1 int32 at ``dst``: the
        first input index, then K weights (those past this axis's taps 0)."""
        o = tl.arange(0, BLOCK_S)
        m = o < S
        scale = in_size.to(tl.float64) / out_size.to(tl.float64)
        support = tl.maximum(scale, 1.0)
        ss = 1.0 / support
        center = ((first + o).to(tl.float64) + 0.5) * scale
        lo = tl.maximum(tl.floor(center - support + 0.5), 0.0)
        n = tl.minimum(tl.floor(center + support + 0.5), in_size.to(tl.float64)) - lo
        k = _taps(in_size, out_size)
        ww = tl.zeros([BLOCK_S], dtype=tl.float64)
        for t in range(0, k):  # in order, as Pillow sums
            x = ((t + lo) - center + 0.5) * ss
            ww += tl.where(t < n, tl.maximum(1.0 - tl.abs(x), 0.0), 0.0)
        row = dst + o * (K + 1)
        tl.store(row, lo.to(tl.int32), mask=m)
        for t in range(0, K):
            x = ((t + lo) - center + 0.5) * ss
            w = tl.where(t < n, tl.maximum(1.0 - tl.abs(x), 0.0), 0.0)
            w = tl.where(ww != 0.0, w / tl.where(ww == 0.0, 1.0, ww), w)
            w = tl.where(t < k, w, 0.0)
            tl.store(row + 1 + t, tl.floor(0.5 + w * 4194304.0).to(tl.int32), mask=m)

    @triton.jit
    def _coefficients_kernel(table_ptr, coef_ptr, S, K, BLOCK_S: tl.constexpr):
        """Program (b, axis): sample b's crop rows (axis 0) or columns (axis 1)."""
        b = tl.program_id(0)
        axis = tl.program_id(1)
        row = table_ptr + b * 8
        in_size = tl.load(row + 1 + axis)  # h, w
        first = tl.load(row + 4 - axis)  # top, left
        out_size = tl.load(row + 6 - axis)  # resized height, width
        _axis_coefficients(coef_ptr + (b * 2 + axis) * S * (K + 1), in_size, out_size, first, S, K, BLOCK_S)

    @triton.jit
    def _clip8_t(s):
        return tl.minimum(tl.maximum(s >> 22, 0), 255)

    @triton.jit
    def _center_crop_kernel(src_ptr, table_ptr, coef_ptr, out_ptr, scale0, scale1, scale2, shift0, shift1, shift2,
                            S, K, RULE, stride_b, stride_c, stride_y, stride_x,
                            BY: tl.constexpr, BX: tl.constexpr, ROUND: tl.constexpr):
        """Program (b, row block, column block): BY x BX output pixels of sample b, each a sum over the taps of
        Pillow's second pass of its first pass's sums, each of those rounded to a uint8 level as Pillow's
        first pass is; the first pass horizontal, or vertical where ``vertical_first`` says (``RULE``)."""
        b = tl.program_id(0)
        oy = tl.program_id(1) * BY + tl.arange(0, BY)
        ox = tl.program_id(2) * BX + tl.arange(0, BX)
        my, mx = oy < S, ox < S
        m2 = my[:, None] & mx[None, :]
        row = table_ptr + b * 8
        off = tl.load(row)
        h = tl.load(row + 1).to(tl.int32)
        w = tl.load(row + 2).to(tl.int32)
        new_w = tl.load(row + 5).to(tl.int32)
        new_h = tl.load(row + 6).to(tl.int32)
        ky = _taps(h, new_h)
        kx = _taps(w, new_w)
        down = (RULE != 0) & (new_h < h) & (h - new_h > 2 * (w - new_w))  # ``vertical_first``
        cy = coef_ptr + ((b * 2) * S + oy) * (K + 1)
        cx = coef_ptr + ((b * 2 + 1) * S + ox) * (K + 1)
        ymin = tl.load(cy, mask=my, other=0)
        xmin = tl.load(cx, mask=mx, other=0)
        acc0 = tl.full([BY, BX], 1 << 21, tl.int32)
        acc1 = tl.full([BY, BX], 1 << 21, tl.int32)
        acc2 = tl.full([BY, BX], 1 << 21, tl.int32)
        for i in range(0, tl.where(down, kx, ky)):  # the second pass's taps
            s0 = tl.full([BY, BX], 1 << 21, tl.int32)
            s1 = tl.full([BY, BX], 1 << 21, tl.int32)
            s2 = tl.full([BY, BX], 1 << 21, tl.int32)
            for j in range(0, tl.where(down, ky, kx)):  # the first pass's
                tv = tl.where(down, j, i)
                th = tl.where(down, i, j)
                wy = tl.load(cy + 1 + tv, mask=my, other=0)[:, None]
                wx = tl.load(cx + 1 + th, mask=mx, other=0)[None, :]
                y = tl.minimum(ymin + tv, h - 1)  # a row or column past the count weighs 0
                x = tl.minimum(xmin + th, w - 1)
                p = src_ptr + off + (y * w).to(tl.int64)[:, None] * 3 + (x * 3).to(tl.int64)[None, :]
                first = tl.where(down, wy, wx)
                s0 += tl.load(p, mask=m2, other=0).to(tl.int32) * first
                s1 += tl.load(p + 1, mask=m2, other=0).to(tl.int32) * first
                s2 += tl.load(p + 2, mask=m2, other=0).to(tl.int32) * first
            second = tl.where(down, tl.load(cx + 1 + i, mask=mx, other=0)[None, :],
                              tl.load(cy + 1 + i, mask=my, other=0)[:, None])
            acc0 += _clip8_t(s0) * second
            acc1 += _clip8_t(s1) * second
            acc2 += _clip8_t(s2) * second
        dst = out_ptr + b.to(tl.int64) * stride_b + oy[:, None] * stride_y + ox[None, :] * stride_x
        tl.store(dst, level(_clip8_t(acc0).to(tl.float32) * scale0 + shift0, out_ptr, ROUND), mask=m2)
        tl.store(dst + stride_c, level(_clip8_t(acc1).to(tl.float32) * scale1 + shift1, out_ptr, ROUND), mask=m2)
        tl.store(dst + 2 * stride_c, level(_clip8_t(acc2).to(tl.float32) * scale2 + shift2, out_ptr, ROUND), mask=m2)


# the coefficients as Pillow rounds them: no fused multiply-add
_UNFUSED = {"enable_fp_fusion": False}


def max_taps(table: np.ndarray) -> int:
    """The most coefficients per output pixel any sample of ``table`` ((B, 8) int64) needs on either axis."""
    if not len(table):
        return 1
    factor = np.maximum(table[:, 1] / table[:, 6], table[:, 2] / table[:, 5])
    return int(np.ceil(np.maximum(factor, 1.0)).max()) * 2 + 1


def center_crop_triton(flat: torch.Tensor, table: torch.Tensor, size: int, scale: Sequence[float],
                       shift: Sequence[float], out: torch.Tensor, *, taps_at_most: int) -> torch.Tensor:
    """Two launches for the whole batch: ``table`` (B, 8) int64 on ``flat``'s device; ``taps_at_most``:
    ``max_taps`` of it (the coefficient rows' length). The coefficients, (B, 2, S, K + 1) int32, come from
    PyTorch's caching allocator on the current stream, which frees them once both launches ran."""
    if triton is None:
        raise RuntimeError("Triton is not installed; use center_crop_reference")
    batch, k = table.shape[0], taps_at_most
    if not batch:
        return out
    coef = torch.empty((batch, 2, size, k + 1), dtype=torch.int32, device=flat.device)
    block_s = triton.next_power_of_2(size)
    _coefficients_kernel[(batch, 2)](table, coef, size, k, BLOCK_S=block_s, **_UNFUSED)
    # the interpreter runs each program's block as whole numpy arrays: one program per image there
    by, bx = (block_s, block_s) if not flat.is_cuda else (16, 32)
    grid = (batch, triton.cdiv(size, by), triton.cdiv(size, bx))
    _center_crop_kernel[grid](flat, table, coef, out, *[float(s) for s in scale], *[float(s) for s in shift], size, k,
                              pillow_order(), out.stride(0), out.stride(1), out.stride(2), out.stride(3), BY=by, BX=bx,
                              ROUND=out.dtype == torch.uint8, **_UNFUSED)
    return out
