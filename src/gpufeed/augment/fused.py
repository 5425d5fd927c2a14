"""Batched crop + resize + flip + normalise for images of different sizes, in one launch.

Input: decoded images packed into one flat uint8 buffer (each (h, w, 3) HWC,
at its own offset) and one int64 row per sample:

    meta[b] = (offset, h, w, box_x, box_y, box_w, box_h, flip)

Output: (B, 3, S, S) ``dtype`` written through its strides, so contiguous and
channels_last outputs come from the same kernel. Each output pixel averages
``taps x taps`` bilinear samples spread over its footprint in the source
(``taps = ceil(box / S)``, at most 4): bilinear when enlarging, an area-like
antialiasing filter when shrinking, as roi_align's adaptive sampling does.
Normalisation is folded in: ``out = mean_of_samples * scale[c] + shift[c]``. A uint8 output is
rounded to the nearest level (half up) and clamped: with scale 1 and shift 0, the crop's own pixels for
a recipe's pixel ops, which start from uint8 (``augment.ops``).

``resized_crop_reference`` computes the same function with plain torch ops
(used on the CPU, without Triton, and by the tests); ``resized_crop_triton``
is the GPU kernel.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

MAX_TAPS = 4


def taps_for(box_w: int, box_h: int, size: int) -> int:
    """Samples per axis and output pixel: enough to cover the footprint when shrinking."""
    return max(1, min(MAX_TAPS, math.ceil(max(box_w, box_h) / size - 1e-6)))


def resized_crop_reference(
    flat: torch.Tensor, meta: torch.Tensor, size: int, scale: torch.Tensor, shift: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """The kernel's function in plain torch, one sample at a time (any device)."""
    for b in range(meta.shape[0]):
        off, h, w, bx, by, bw, bh, flip = (int(v) for v in meta[b].tolist())
        img = flat[off : off + h * w * 3].view(h, w, 3).float()
        k = taps_for(bw, bh, size)
        o = torch.arange(size, dtype=torch.float32, device=flat.device)
        t = (torch.arange(k, dtype=torch.float32, device=flat.device) + 0.5) / k
        ys = (by + (o[:, None] + t[None, :]) * (bh / size) - 0.5).clamp(0, h - 1)  # (S, k)
        ox = (size - 1 - o) if flip else o
        xs = (bx + (ox[:, None] + t[None, :]) * (bw / size) - 0.5).clamp(0, w - 1)
        y0, x0 = ys.floor().long(), xs.floor().long()
        y1, x1 = (y0 + 1).clamp(max=h - 1), (x0 + 1).clamp(max=w - 1)
        wy, wx = (ys - y0)[:, :, None, None, None], (xs - x0)[None, None, :, :, None]
        g = lambda yy, xx: img[yy[:, :, None, None], xx[None, None, :, :]]  # (S, k, S, k, 3)
        val = (g(y0, x0) * (1 - wx) + g(y0, x1) * wx) * (1 - wy) + (g(y1, x0) * (1 - wx) + g(y1, x1) * wx) * wy
        pix = val.mean(dim=(1, 3))  # (S, S, 3)
        val = pix * scale + shift
        if out.dtype == torch.uint8:
            val = val.add(0.5).floor_().clamp_(0, 255)
        out[b] = val.permute(2, 0, 1).to(out.dtype)
    return out


try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton: the reference path is used
    triton = None

if triton is not None:

    @triton.jit
    def _bilinear(p00, p01, p10, p11, w00, w01, w10, w11, mask):
        """One channel of one tap: the four neighbours' weighted sum, in float32."""
        return (tl.load(p00, mask=mask, other=0).to(tl.float32) * w00
                + tl.load(p01, mask=mask, other=0).to(tl.float32) * w01
                + tl.load(p10, mask=mask, other=0).to(tl.float32) * w10
                + tl.load(p11, mask=mask, other=0).to(tl.float32) * w11)

    @triton.jit
    def _neighbours(start, o, t, k, step, last):
        """Along one axis, tap ``t`` of output ``o``: the two source neighbours (clamped to [0, last])
        and the weight of the second."""
        f = start + (o + (t + 0.5) / k) * step - 0.5
        f = tl.minimum(tl.maximum(f, 0.0), last.to(tl.float32))
        f0 = tl.floor(f)
        i0 = f0.to(tl.int32)
        return i0, tl.minimum(i0 + 1, last), f - f0

    @triton.jit
    def level(v, out_ptr, ROUND: tl.constexpr):
        """One channel's value in the output's dtype: rounded half up and clamped for uint8 (``ROUND``)."""
        if ROUND:
            v = tl.minimum(tl.maximum(tl.floor(v + 0.5), 0.0), 255.0)
        return v.to(out_ptr.dtype.element_ty)

    @triton.jit
    def _resized_crop_kernel(
        src_ptr, meta_ptr, out_ptr,
        scale0, scale1, scale2, shift0, shift1, shift2,
        S, stride_b, stride_c, stride_y, stride_x,
        MAX_K: tl.constexpr, BLOCK: tl.constexpr, ROUND: tl.constexpr,
    ):
        b = tl.program_id(1)
        idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = idx < S * S
        oy = (idx // S).to(tl.float32)
        ox_i = idx % S
        row = meta_ptr + b * 8
        off = tl.load(row)
        h = tl.load(row + 1).to(tl.int32)
        w = tl.load(row + 2).to(tl.int32)
        bx = tl.load(row + 3).to(tl.float32)
        by = tl.load(row + 4).to(tl.float32)
        bw = tl.load(row + 5).to(tl.float32)
        bh = tl.load(row + 6).to(tl.float32)
        flip = tl.load(row + 7)
        k = tl.minimum(tl.maximum(tl.ceil(tl.maximum(bw, bh) / S - 1e-6), 1.0), MAX_K)
        ox = tl.where(flip != 0, S - 1 - ox_i, ox_i).to(tl.float32)
        sy = bh / S
        sx = bw / S
        acc0 = tl.zeros([BLOCK], dtype=tl.float32)
        acc1 = tl.zeros([BLOCK], dtype=tl.float32)
        acc2 = tl.zeros([BLOCK], dtype=tl.float32)
        ki = k.to(tl.int32)
        for ty in range(0, ki):
            y0, y1, wy = _neighbours(by, oy, ty, k, sy, h - 1)
            for tx in range(0, ki):
                x0, x1, wx = _neighbours(bx, ox, tx, k, sx, w - 1)
                p00 = src_ptr + off + (y0 * w + x0).to(tl.int64) * 3
                p01 = src_ptr + off + (y0 * w + x1).to(tl.int64) * 3
                p10 = src_ptr + off + (y1 * w + x0).to(tl.int64) * 3
                p11 = src_ptr + off + (y1 * w + x1).to(tl.int64) * 3
                w00 = (1 - wy) * (1 - wx)
                w01 = (1 - wy) * wx
                w10 = wy * (1 - wx)
                w11 = wy * wx
                acc0 += _bilinear(p00, p01, p10, p11, w00, w01, w10, w11, mask)
                acc1 += _bilinear(p00 + 1, p01 + 1, p10 + 1, p11 + 1, w00, w01, w10, w11, mask)
                acc2 += _bilinear(p00 + 2, p01 + 2, p10 + 2, p11 + 2, w00, w01, w10, w11, mask)
        inv = 1.0 / (k * k)
        dst = out_ptr + b.to(tl.int64) * stride_b + (idx // S) * stride_y + ox_i * stride_x
        tl.store(dst, level(acc0 * inv * scale0 + shift0, out_ptr, ROUND), mask=mask)
        tl.store(dst + stride_c, level(acc1 * inv * scale1 + shift1, out_ptr, ROUND), mask=mask)
        tl.store(dst + 2 * stride_c, level(acc2 * inv * scale2 + shift2, out_ptr, ROUND), mask=mask)


def resized_crop_triton(
    flat: torch.Tensor, meta: torch.Tensor, size: int, scale: Sequence[float], shift: Sequence[float],
    out: torch.Tensor, block: int = 256,
) -> torch.Tensor:
    """One launch for the whole batch; ``meta`` (B, 8) int64 on ``flat``'s device."""
    if triton is None:
        raise RuntimeError("Triton is not installed; use resized_crop_reference")
    batch = meta.shape[0]
    grid = (triton.cdiv(size * size, block), batch)
    _resized_crop_kernel[grid](
        flat, meta, out, *[float(s) for s in scale], *[float(s) for s in shift],
        size, out.stride(0), out.stride(1), out.stride(2), out.stride(3), MAX_K=MAX_TAPS, BLOCK=block,
        ROUND=out.dtype == torch.uint8,
    )
    return out


def normalize_constants(mean: Sequence[float], std: Sequence[float]) -> tuple[list[float], list[float]]:
    """uint8 value v maps to v * scale + shift = (v / 255 - mean) / std."""
    return [1.0 / (255.0 * s) for s in std], [-m / s for m, s in zip(mean, std)]
