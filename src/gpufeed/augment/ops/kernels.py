"""The auto-augment family's colour and point operations in two Triton kernels per step on CUDA: each sample
of a ``(n, 3, H, W)`` uint8 batch through its own operation and magnitude, where the PyTorch passes of
``pixels`` take some 90 calls from Python per step (one pass per operation, each a gather, a dozen ops and
a scatter). The training's process spends that host time under the interpreter lock the training needs
(BENCHMARKS.md, "Training recipes").

Each operation is computed as ``pixels`` computes it (torchvision's arithmetic, in float32, with its
fused multiply-adds and correctly rounded divisions), so the two give the same pixels. One exception:
Contrast's grey sum is exact here (integers), while PyTorch's float32 sum is exact only below 2^24, that is
up to about 256 x 256 pixels; above, the two means may differ in the last bits, and a pixel by a level.

``normalize`` takes a recipe's uint8 result to the normalised batch in one kernel, and ``mixup`` blends each
sample with the one before it (MixUp, ``augment.mix``) in one, each with the bits of the PyTorch passes it
replaces (for the first a multiply, an add, the layout's copy and the dtype's cast; for the second a copy,
two multiplies and an add; each a pass over the batch).

Triton is optional: without it, on a CPU tensor, or with ``GPUFEED_OPS_KERNELS=0`` in the environment,
``usable`` is False and the PyTorch passes run. A launch that fails (a compiler or driver missing a piece, a
new specialisation that does not build) turns the kernels off for the process with one warning that says
why. ``gpufeed info`` says which runs.
"""

from __future__ import annotations

import contextlib
import os
import warnings

from typing import Sequence

import numpy as np
import torch

from .pixels import on, point_parameters

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton here: the PyTorch passes
    triton = None

# One code per pass the kernels make; 0 leaves the sample as it is (Identity, and the geometry operations
# the caller puts through ``pixels.affine``)
KEEP, BRIGHTNESS, COLOR, CONTRAST, SHARPNESS, POINT, AUTOCONTRAST, EQUALIZE = range(8)
CODES = {"Brightness": BRIGHTNESS, "Color": COLOR, "Contrast": CONTRAST, "Sharpness": SHARPNESS,
         "Posterize": POINT, "Solarize": POINT, "Invert": POINT, "AutoContrast": AUTOCONTRAST, "Equalize": EQUALIZE}
_BLOCK = 1024  # pixels per program
_NORMALIZED = (torch.float32, torch.bfloat16, torch.float16)  # what ``normalize`` writes
# two roundings, a product then a sum, as PyTorch's two passes round: no fused multiply-add
_UNFUSED = {"enable_fp_fusion": False}
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # Triton's CPU interpreter (the tests' CPU check)
_failed: str | None = None


class KernelsFailed(RuntimeError):
    """A launch of the kernels failed; they are off from now on (``describe`` says why)."""


def _switched_off() -> bool:
    return os.environ.get("GPUFEED_OPS_KERNELS", "1") == "0"


def usable(images: torch.Tensor) -> bool:
    """Whether the kernels run on ``images``' device: Triton importable, a CUDA tensor (any tensor under
    Triton's interpreter), not switched off, and no earlier failure to compile."""
    return triton is not None and _failed is None and (images.is_cuda or _INTERPRET) and not _switched_off()


def describe() -> str:
    """What runs the auto-augment family's colour and point operations on CUDA, for ``gpufeed info``."""
    if triton is None:
        return "PyTorch passes (Triton not installed)"
    if _failed is not None:
        return f"PyTorch passes (the Triton kernels failed: {_failed})"
    if _switched_off():
        return "PyTorch passes (GPUFEED_OPS_KERNELS=0)"
    return f"two Triton kernels per step (triton {triton.__version__})"


def params(name: str, magnitude: float) -> tuple[int, float, float, float, float]:
    """(code, w0, w1, threshold, bit mask) for one step: the blend's weights ``f`` and ``1 - f`` rounded
    from float64 to float32 as torchvision's scalars are (``pixels._blend``), Solarize's threshold (256 for
    none, 0 for Invert) and Posterize's mask (``pixels.point_ops``)."""
    f = 1.0 + magnitude
    threshold, mask = point_parameters(name, magnitude)
    return CODES.get(name, KEEP), f, 1.0 - f, threshold, float(mask)


def apply(images: torch.Tensor, rows: Sequence[tuple[int, float, float, float, float]]) -> torch.Tensor:
    """(n, 3, H, W) uint8 -> a new contiguous batch with sample i through ``rows[i]`` (``params``' five
    numbers). Raises KernelsFailed (and turns the kernels off) if a launch fails."""
    src = images.contiguous()
    n, c, h, w = src.shape
    if c != 3 or len(rows) != n:
        raise ValueError(f"the colour kernels take 3-channel images and a row per sample, got shape "
                         f"{tuple(images.shape)} and {len(rows)} rows")
    out = torch.empty_like(src)
    if n == 0 or h == 0 or w == 0:
        return out
    table = on(src.device, rows)  # one upload: (n, 5) float32
    stats = torch.empty(n, 8, dtype=torch.float32, device=src.device)
    luts = torch.empty(n, 3, 256, dtype=torch.uint8, device=src.device)
    hw = h * w
    inv_hw = float(np.float32(1.0) / np.float32(hw))  # rounded once in float32, as torch's mean rounds it
    with _launching("colour kernels", src):
        if any(r[0] in (CONTRAST, AUTOCONTRAST, EQUALIZE) for r in rows):
            _stats[(n,)](src, table, stats, luts, hw, inv_hw, BLOCK=_BLOCK)
        _apply[(n, triton.cdiv(hw, _BLOCK))](src, out, table, stats, luts, h, w, BLOCK=_BLOCK)
    return out


def normalizes(pixels: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether ``normalize`` takes ``pixels`` into ``dtype``: (n, 3, H, W) uint8 of 2 pixels or more (a
    single pixel's strides are PyTorch's to choose), into float32, bfloat16 or float16."""
    return (pixels.dtype == torch.uint8 and pixels.dim() == 4 and pixels.shape[1] == 3
            and pixels.shape[2] * pixels.shape[3] > 1 and dtype in _NORMALIZED)


def normalize(pixels: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, dtype: torch.dtype,
              channels_last: bool) -> torch.Tensor:
    """(n, 3, H, W) uint8 (any strides; ``normalizes``) and ``scale``, ``shift`` (1, 3, 1, 1) float32, all on
    one device -> a new (n, 3, H, W) ``dtype`` batch on it, channels_last or contiguous: ``(pixels *
    scale).add_(shift).to(dtype=dtype, memory_format=...)`` bit for bit (v x scale rounded to float32, + shift
    rounded, then rounded to nearest even into ``dtype``), with its strides, in one pass. Raises
    KernelsFailed (and turns the kernels off) if the launch fails."""
    if not normalizes(pixels, dtype):
        raise ValueError(f"the normalising kernel takes (n, 3, H, W) uint8 images of 2 pixels or more into one "
                         f"of {_NORMALIZED}, got {pixels.dtype} {tuple(pixels.shape)} and {dtype}")
    n, _, h, w = pixels.shape
    src = pixels.flatten(2)  # a view for either layout (a copy for other strides): pixel k at k x stride(2)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    out = torch.empty(pixels.shape, dtype=dtype, device=pixels.device, memory_format=fmt)
    if n == 0:
        return out
    hw = h * w
    # channels_last: a program writes a run of a sample's interleaved values; contiguous: of one channel's plane
    grid = (triton.cdiv(3 * hw, _BLOCK), n, 1) if channels_last else (triton.cdiv(hw, _BLOCK), n, 3)
    with _launching("normalising kernel", src):
        _normalize[grid](src, out, scale.reshape(3), shift.reshape(3), hw, *src.stride(),
                         CHANNELS_LAST=channels_last, BLOCK=_BLOCK, **_UNFUSED)
    return out


def mixes(images: torch.Tensor) -> bool:
    """Whether ``mixup`` takes ``images``: a float32, bfloat16 or float16 batch of one sample or more whose
    samples are laid out alike one after the other (contiguous, or channels_last for 4 dimensions)."""
    channels_last = images.dim() == 4 and images.is_contiguous(memory_format=torch.channels_last)
    return (images.dtype in _NORMALIZED and images.dim() >= 1 and images.numel() > 0
            and (images.is_contiguous() or channels_last))


def mixup(images: torch.Tensor, lam: float) -> torch.Tensor:
    """(n, ...) batch (``mixes``) -> a new batch with its dtype, strides and device: sample i is images[i] x
    lam + images[i - 1] x (1 - lam) (sample 0 with the last), computed as PyTorch's in-place passes compute
    it (each weight rounded to float32, each product and the sum in float32 rounded into the dtype). Not in
    place, as sample i needs the values sample i - 1 had. Raises KernelsFailed (and turns the kernels off)
    if the launch fails."""
    if not mixes(images):
        raise ValueError(f"the MixUp kernel takes a dense float32, bfloat16 or float16 batch, got {images.dtype} "
                         f"{tuple(images.shape)} with strides {images.stride()}")
    out = torch.empty_like(images)  # the same strides (dense)
    n = images.shape[0]
    per = images.numel() // n
    w0, w1 = float(np.float32(lam)), float(np.float32(1.0 - lam))  # PyTorch's opmath scalars
    with _launching("MixUp kernel", images):
        _mixup[(triton.cdiv(per, _BLOCK), n)](images, out, per, n, w0, w1, BLOCK=_BLOCK, **_UNFUSED)
    return out


@contextlib.contextmanager
def _launching(what: str, tensor: torch.Tensor):
    """Launches of ``what`` on ``tensor``'s GPU. One that fails (a compiler or driver missing a piece) turns
    the kernels off for the process, said in one warning, and raises KernelsFailed: the PyTorch passes from
    now on."""
    global _failed
    try:
        with torch.cuda.device(tensor.device) if tensor.is_cuda else contextlib.nullcontext():
            yield
    except Exception as e:
        _failed = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        warnings.warn(f"gpufeed: the Triton {what} failed ({_failed}); the per-sample ops and MixUp run as "
                      "PyTorch passes (more host time per batch)", RuntimeWarning)
        raise KernelsFailed(_failed) from e


if triton is not None:
    # the codes as Triton constants (a kernel reads no other globals)
    _BRIGHTNESS, _COLOR, _CONTRAST, _SHARPNESS = (tl.constexpr(c) for c in (BRIGHTNESS, COLOR, CONTRAST, SHARPNESS))
    _POINT, _AUTOCONTRAST, _EQUALIZE = (tl.constexpr(c) for c in (POINT, AUTOCONTRAST, EQUALIZE))
    _FUSED = tl.constexpr(not _INTERPRET)  # the interpreter's fma rounds twice: there, float64 and one rounding
    _NATIVE_BF16 = tl.constexpr(not _INTERPRET)  # the interpreter's bfloat16 casts are inexact: there, by hand

    @triton.jit
    def _fma(a, b, c):
        """a x b + c rounded once, as CUDA's fused multiply-add (PyTorch's kernels) rounds it."""
        if _FUSED:
            return tl.fma(a, b, c)
        else:
            return (tl.cast(a, tl.float64) * tl.cast(b, tl.float64) + tl.cast(c, tl.float64)).to(tl.float32)

    @triton.jit
    def _grey(r, g, b):
        # torchvision's luma for uint8 images, floored: r x 0.2989, then + 0.587 g and + 0.114 b as fused adds
        return tl.floor(_fma(b, 0.114, _fma(g, 0.587, r * 0.2989)))

    @triton.jit
    def _to_uint8(v):
        return tl.minimum(tl.maximum(v, 0.0), 255.0).to(tl.uint8)  # clamped, then truncated as .to(uint8)

    @triton.jit
    def _stats(src, table, stats, luts, hw, inv_hw, BLOCK: tl.constexpr):
        """One program per sample: Contrast's grey mean, AutoContrast's lowest and highest value per
        channel, Equalize's lookup table per channel; nothing for the other codes."""
        i = tl.program_id(0)
        code = tl.load(table + i * 5).to(tl.int32)
        base = src + i.to(tl.int64) * 3 * hw
        offs = tl.arange(0, BLOCK)
        if code == _CONTRAST:
            total = tl.zeros([BLOCK], tl.int32)  # whole levels, summed exactly (see the module's note)
            for start in range(0, hw, BLOCK):
                m = start + offs < hw
                r = tl.load(base + start + offs, mask=m, other=0).to(tl.float32)
                g = tl.load(base + hw + start + offs, mask=m, other=0).to(tl.float32)
                b = tl.load(base + 2 * hw + start + offs, mask=m, other=0).to(tl.float32)
                total += _grey(r, g, b).to(tl.int32)
            # int64: past 2^31 from about 8.4 million pixels; torch's mean is sum x (1/count)
            tl.store(stats + i * 8, tl.sum(total.to(tl.int64), 0).to(tl.float32) * inv_hw)
        if code == _AUTOCONTRAST:
            for ch in tl.static_range(3):
                low = tl.full([BLOCK], 255, tl.int32)
                high = tl.zeros([BLOCK], tl.int32)
                for start in range(0, hw, BLOCK):
                    m = start + offs < hw
                    v = tl.load(base + ch * hw + start + offs, mask=m, other=0).to(tl.int32)
                    low = tl.minimum(low, tl.where(m, v, 255))
                    high = tl.maximum(high, v)
                tl.store(stats + i * 8 + 1 + ch, tl.min(low, 0).to(tl.float32))
                tl.store(stats + i * 8 + 4 + ch, tl.max(high, 0).to(tl.float32))
        if code == _EQUALIZE:
            levels = tl.arange(0, 256)
            padded = tl.cdiv(hw, BLOCK) * BLOCK - hw  # lanes past the end, counted at level 0 and taken off
            for ch in tl.static_range(3):
                hist = tl.zeros([256], tl.int32)
                for start in range(0, hw, BLOCK):
                    m = start + offs < hw
                    hist += tl.histogram(tl.load(base + ch * hw + start + offs, mask=m, other=0).to(tl.int32), 256)
                hist -= tl.where(levels == 0, padded, 0)
                cum = tl.cumsum(hist, 0)
                brightest = tl.max(tl.where(hist > 0, levels, -1), 0)
                step = (hw - tl.sum(tl.where(levels == brightest, hist, 0), 0)) // 255
                lut = (cum - hist + step // 2) // tl.maximum(step, 1)
                lut = tl.where(step != 0, tl.minimum(tl.maximum(lut, 0), 255), levels)  # step 0: left as is
                tl.store(luts + i * 768 + ch * 256 + levels, lut.to(tl.uint8))

    @triton.jit
    def _sharpened(base, idx, inner, w, w1):
        """One channel's adjust_sharpness: torchvision's 3x3 smoothing (1/13 around, 5/13 in the middle,
        an integer rounded as its float division rounds, no ties) blended in, the border kept."""
        c = tl.load(base + idx, mask=inner, other=0).to(tl.int32)
        box = c * 5
        for dy in tl.static_range(-1, 2):
            for dx in tl.static_range(-1, 2):
                if dy != 0 or dx != 0:
                    box += tl.load(base + idx + dy * w + dx, mask=inner, other=0).to(tl.int32)
        blurred = (box + 6) // 13
        x = c.to(tl.float32)
        return _to_uint8(_fma(blurred.to(tl.float32) - x, w1, x))

    @triton.jit
    def _apply(src, out, table, stats, luts, h, w, BLOCK: tl.constexpr):
        """Program (sample, tile): the tile's pixels of the three channels through the sample's code."""
        i = tl.program_id(0)
        hw = h * w
        idx = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = idx < hw
        base = src + i.to(tl.int64) * 3 * hw
        x0 = tl.load(base + idx, mask=m, other=0)
        x1 = tl.load(base + hw + idx, mask=m, other=0)
        x2 = tl.load(base + 2 * hw + idx, mask=m, other=0)
        code = tl.load(table + i * 5).to(tl.int32)
        w0 = tl.load(table + i * 5 + 1)
        w1 = tl.load(table + i * 5 + 2)
        o0, o1, o2 = x0, x1, x2
        f0, f1, f2 = x0.to(tl.float32), x1.to(tl.float32), x2.to(tl.float32)
        if code == _BRIGHTNESS:
            o0, o1, o2 = _to_uint8(f0 * w0), _to_uint8(f1 * w0), _to_uint8(f2 * w0)
        if code == _COLOR:
            g = _grey(f0, f1, f2)
            o0, o1, o2 = (_to_uint8(_fma(g, w1, f0 * w0)), _to_uint8(_fma(g, w1, f1 * w0)),
                          _to_uint8(_fma(g, w1, f2 * w0)))
        if code == _CONTRAST:
            mean = tl.load(stats + i * 8)
            o0, o1, o2 = (_to_uint8(_fma(mean, w1, f0 * w0)), _to_uint8(_fma(mean, w1, f1 * w0)),
                          _to_uint8(_fma(mean, w1, f2 * w0)))
        if code == _SHARPNESS:
            y, x = idx // w, idx % w
            inner = m & (y > 0) & (y < h - 1) & (x > 0) & (x < w - 1)
            o0 = tl.where(inner, _sharpened(base, idx, inner, w, w1), x0)
            o1 = tl.where(inner, _sharpened(base + hw, idx, inner, w, w1), x1)
            o2 = tl.where(inner, _sharpened(base + 2 * hw, idx, inner, w, w1), x2)
        if code == _POINT:  # inverted at or above the threshold (float32), then the kept bits
            threshold = tl.load(table + i * 5 + 3)
            bits = tl.load(table + i * 5 + 4).to(tl.int32)
            o0 = _point(x0, f0, threshold, bits)
            o1 = _point(x1, f1, threshold, bits)
            o2 = _point(x2, f2, threshold, bits)
        if code == _AUTOCONTRAST:
            o0 = _stretched(f0, tl.load(stats + i * 8 + 1), tl.load(stats + i * 8 + 4))
            o1 = _stretched(f1, tl.load(stats + i * 8 + 2), tl.load(stats + i * 8 + 5))
            o2 = _stretched(f2, tl.load(stats + i * 8 + 3), tl.load(stats + i * 8 + 6))
        if code == _EQUALIZE:
            lut = luts + i * 768
            o0 = tl.load(lut + x0.to(tl.int32), mask=m, other=0)
            o1 = tl.load(lut + 256 + x1.to(tl.int32), mask=m, other=0)
            o2 = tl.load(lut + 512 + x2.to(tl.int32), mask=m, other=0)
        obase = out + i.to(tl.int64) * 3 * hw
        tl.store(obase + idx, o0, mask=m)
        tl.store(obase + hw + idx, o1, mask=m)
        tl.store(obase + 2 * hw + idx, o2, mask=m)

    @triton.jit
    def _point(x, f, threshold, bits):
        """Solarize (inverted at or above ``threshold``, compared in float32), Invert (threshold 0) and
        Posterize (the ``bits`` kept) of one channel (``pixels.point_ops``)."""
        return (tl.where(f >= threshold, 255 - x.to(tl.int32), x.to(tl.int32)) & bits).to(tl.uint8)

    @triton.jit
    def _stretched(x, low, high):
        """autocontrast of one channel: from its lowest and highest value to 0-255 (``pixels.autocontrast``;
        a channel of one value left as it is)."""
        flat = high == low
        scale = tl.where(flat, 1.0, (high - low) * (1.0 / 255))
        return _to_uint8(tl.math.div_rn(x - tl.where(flat, 0.0, low), scale))

    @triton.jit
    def _rounded(v, dtype: tl.constexpr):
        """float32 ``v`` in ``dtype``, rounded to nearest even as PyTorch's ``.to`` rounds it."""
        if dtype == tl.bfloat16 and not _NATIVE_BF16:
            bits = v.to(tl.uint32, bitcast=True)
            even = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # ties go up only to an even kept bit
            bits = tl.where(v != v, 0x7FC0, even)  # NaN: PyTorch's quiet NaN on the CPU
            return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
        else:
            return v.to(dtype)

    @triton.jit
    def _widened(x):
        """``x`` in float32, exactly (the interpreter's bfloat16 cast loses subnormals: there, by hand)."""
        if x.dtype == tl.bfloat16 and not _NATIVE_BF16:
            return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
        else:
            return x.to(tl.float32)

    @triton.jit
    def _normalize(src, out, scale, shift, hw, sn, sc, sk, CHANNELS_LAST: tl.constexpr, BLOCK: tl.constexpr):
        """Program (tile, sample, plane): BLOCK values of the output in its memory order, pixel k of channel c
        of sample i read at src + i x sn + c x sc + k x sk, times scale[c] plus shift[c]. Launched without fp
        fusion (``_UNFUSED``)."""
        i = tl.program_id(1).to(tl.int64)
        j = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        if CHANNELS_LAST:  # the sample's values: pixel j // 3, channel j % 3
            m = j < 3 * hw
            c = j % 3
            k = j // 3
            dst = out + i * 3 * hw + j
        else:  # channel c's plane
            m = j < hw
            c = tl.program_id(2)
            k = j
            dst = out + (i * 3 + c) * hw + j
        # the channel's constants picked from the three, not gathered per value
        a = tl.where(c == 0, tl.load(scale), tl.where(c == 1, tl.load(scale + 1), tl.load(scale + 2)))
        b = tl.where(c == 0, tl.load(shift), tl.where(c == 1, tl.load(shift + 1), tl.load(shift + 2)))
        v = tl.load(src + i * sn + c * sc + k * sk, mask=m, other=0).to(tl.float32) * a + b
        tl.store(dst, _rounded(v, out.dtype.element_ty), mask=m)

    @triton.jit
    def _mixup(src, out, per, n, w0, w1, BLOCK: tl.constexpr):
        """Program (tile, sample): BLOCK values of sample i (``per`` values a sample) mixed with those of
        sample i - 1; each product and the sum rounded into the dtype, as PyTorch's passes store them.
        Launched without fp fusion (``_UNFUSED``)."""
        i = tl.program_id(1).to(tl.int64)
        j = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = j < per
        dtype = out.dtype.element_ty
        x = _widened(tl.load(src + i * per + j, mask=m, other=0))
        before = _widened(tl.load(src + tl.where(i == 0, n - 1, i - 1) * per + j, mask=m, other=0))
        mixed = _widened(_rounded(x * w0, dtype)) + _widened(_rounded(before * w1, dtype))
        tl.store(out + i * per + j, _rounded(mixed, dtype), mask=m)
