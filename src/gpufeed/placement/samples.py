"""Which samples of a GPU-path batch the GPU may take, and which of them the CPU's share takes: the cost
model. Imports no torch: the worker processes use it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping, NamedTuple

if TYPE_CHECKING:
    from ..augment.params import CropBox

# Per-sample room for encoded bytes in the shared ring on the GPU path; larger files are decoded by the CPU
# workers instead (ImageNet's largest training JPEGs are a few MB; the mean is ~110 KB).
GPU_BYTES_CAPACITY = 2 * 1024 * 1024

# The longest side of an image the GPU decoders take; longer ones go to the CPU workers. nvJPEG's engine
# decoders take room for smaller images when made (``memory.ENGINE_ROOM_SIDE``) and grow to a larger image's
# needs; this bounds that growth. ImageNet's training images are almost all smaller.
GPU_MAX_SIDE = 1024

# The NVJPG engines' cost per JPEG is 0.28 ns per byte + 10.2 us per image on the H200 (pixels barely count):
# the per-image part is worth this many bytes (BENCHMARKS.md#engine-cost-per-jpeg).
ENGINE_BYTES_PER_IMAGE = 36_000


def gpu_may_take(data: bytes, header: tuple[int, int, bool], orientation: int, *, bytes_capacity: int,
                 buffer_bytes: int) -> bool:
    """Whether a GPU decoder may take a sample of a loader with GPU decoders (``decoders.cpu_crops``: only
    recipes that crop by a resampled box have them); the CPU workers finish all others. Not: files
    libjpeg-turbo cannot decode to RGB (not JPEG, CMYK), EXIF-rotated ones when rotation is on, files over
    ``bytes_capacity``, images larger decoded than a decode buffer (``buffer_bytes``) or with a side over
    ``GPU_MAX_SIDE``, and files that fail the structural check (truncated, corrupt, progressive: GPU
    decoders fill damage in silently; ``decode.jpeg_check``)."""
    from ..decode.jpeg_check import gpu_safe_jpeg

    width, height, fast = header
    return (fast and orientation == 1 and len(data) <= bytes_capacity and width * height * 3 <= buffer_bytes
            and max(width, height) <= GPU_MAX_SIDE and gpu_safe_jpeg(data))


class Candidate(NamedTuple):
    """A GPU-decodable sample as the share rule sees it: its file's bytes, its image height, its crop box."""

    nbytes: int
    height: int
    box: "CropBox"


def cpu_cost(c: Candidate) -> float:
    """The cropped CPU decode's cost, in byte-like units: the entropy-coded bytes down to the crop's last
    row (rows above are entropy-decoded too, rows below never) plus half the crop's pixels (IDCT, colour,
    resize). Against the cropped decoder's measured time on ImageNet-like files: r = 0.98."""
    return c.nbytes * (c.box.y + c.box.height) / c.height + 0.5 * c.box.width * c.box.height


def engine_cost(c: Candidate) -> float:
    """The NVJPG engines' cost in the same units: the file's bytes plus a per-image part
    (``ENGINE_BYTES_PER_IMAGE``); the box does not matter to them."""
    return c.nbytes + ENGINE_BYTES_PER_IMAGE


def cheapest_on_cpu(samples: Mapping[int, Candidate], quota: int) -> set[int]:
    """The keys of the ``quota`` samples of a chunk that the CPU decodes: those with the lowest CPU cost per
    engine cost, so the CPU takes what costs it least for what it saves the engines and neither side is left
    the other's expensive files (BENCHMARKS.md#which-samples-the-cpu-takes)."""
    ranked = sorted(samples, key=lambda k: cpu_cost(samples[k]) / engine_cost(samples[k]))
    return set(ranked[: max(0, quota)])
