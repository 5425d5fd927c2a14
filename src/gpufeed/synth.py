"""Synthetic ImageNet-like JPEG folders, deterministic for a seed.

Content is natural-image-like rather than flat colour or white noise: a
colour 1/f ("pink") noise field, which has the power spectrum of photographs,
with a few blurred-edged shapes on top. Sizes follow ImageNet's training set
(mean about 470x390 px); files are baseline 4:2:0 JPEGs of quality 80-96,
about 100 KB each on average.

``create_synthetic_dataset`` writes ``DIR/class_XXX/img_XXXXXX.jpg`` plus a
``.gpufeed-synth.json`` marker; calling it again with the same arguments
returns at once (the cache ``gpufeed bench`` relies on). It says on stderr what
it makes, or that it reuses what is there, and how far it has got
(``progress.Progress``): about 0.1 s of one core per image.
"""

from __future__ import annotations

import io
import json
import multiprocessing
import os
import re
import signal
import sys
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

from .progress import Progress

__all__ = ["create_synthetic_dataset", "synthetic_jpeg"]

_MARKER = ".gpufeed-synth.json"
_FORMAT_VERSION = 1
_CHUNK = 16  # images per task of the process pool: progress moves every few seconds


def _pink_noise(rng: np.random.Generator, h: int, w: int) -> np.ndarray:
    """(h, w, 3) float32 in [0, 1]: colour noise with a 1/f amplitude spectrum."""
    fy = np.fft.fftfreq(h)[:, None]
    fx = np.fft.rfftfreq(w)[None, :]
    radius = np.sqrt(fx * fx + fy * fy)
    radius[0, 0] = 1.0
    alpha = rng.uniform(0.6, 0.95)  # spectral slope varies like real scenes
    amplitude = 1.0 / radius**alpha
    amplitude[0, 0] = 0.0
    out = np.empty((h, w, 3), np.float32)
    mix = rng.normal(0.0, 1.0, (3, 3)) * 0.4 + np.eye(3)  # correlated channels
    base = []
    for _ in range(3):
        phase = rng.uniform(0, 2 * np.pi, amplitude.shape)
        field = np.fft.irfft2(amplitude * np.exp(1j * phase), s=(h, w))
        base.append(field / (field.std() + 1e-8))
    stacked = np.stack(base, axis=-1) @ mix.T
    for c in range(3):
        ch = stacked[..., c]
        lo, hi = np.percentile(ch, [1, 99])
        out[..., c] = np.clip((ch - lo) / (hi - lo + 1e-8), 0, 1)
    tint = rng.uniform(0.6, 1.0, 3).astype(np.float32)
    return out * tint + rng.uniform(0, 0.2, 3).astype(np.float32)


def synthetic_jpeg(rng: np.random.Generator) -> tuple[bytes, tuple[int, int]]:
    """One ImageNet-like JPEG: returns (file bytes, (width, height))."""
    w = int(np.clip(rng.normal(470, 90), 160, 900))
    h = int(np.clip(w * rng.uniform(0.62, 1.05), 120, 900))
    pixels = np.clip(_pink_noise(rng, h, w) * 255, 0, 255).astype(np.uint8)
    texture = Image.fromarray(pixels, "RGB")
    img = texture.copy()
    draw = ImageDraw.Draw(img)
    for _ in range(int(rng.integers(2, 7))):
        x0, y0 = int(rng.integers(0, w)), int(rng.integers(0, h))
        x1 = x0 + int(rng.integers(w // 10, w // 3))
        y1 = y0 + int(rng.integers(h // 10, h // 3))
        colour = tuple(int(c) for c in rng.integers(0, 256, 3))
        if rng.random() < 0.5:
            draw.ellipse((x0, y0, x1, y1), fill=colour)
        else:
            draw.rectangle((x0, y0, x1, y1), fill=colour)
    # Objects are translucent so the texture (and its detail) shows through them.
    img = Image.blend(texture, img, float(rng.uniform(0.4, 0.7)))
    img = img.filter(ImageFilter.GaussianBlur(float(rng.uniform(0.2, 0.7))))
    grain = rng.normal(0.0, rng.uniform(3.0, 6.0), (h, w, 1))  # sensor noise, after the optics
    img = Image.fromarray(np.clip(np.asarray(img) + grain, 0, 255).astype(np.uint8), "RGB")
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=int(rng.integers(80, 97)), subsampling=2)  # 2 = 4:2:0
    return buf.getvalue(), (w, h)


def _write_task(task: tuple[str, int, int, int, int]) -> tuple[int, int]:
    """A pool's task: ``_write_range`` of (root, seed, start, stop, num_classes); its (start, stop)."""
    _write_range(*task)
    return task[2], task[3]


def _write_range(root: str, seed: int, start: int, stop: int, num_classes: int) -> int:
    total = 0
    for i in range(start, stop):
        rng = np.random.default_rng([seed, i])
        data, _ = synthetic_jpeg(rng)
        path = Path(root, f"class_{i % num_classes:03d}", f"img_{i:06d}.jpg")
        path.write_bytes(data)
        total += len(data)
    return total


def create_synthetic_dataset(
    root: str | os.PathLike,
    *,
    n: int = 2000,
    num_classes: int = 100,
    seed: int = 0,
    workers: int | None = None,
    progress: bool = True,
) -> Path:
    """Write ``n`` JPEGs in ImageFolder layout under ``root``; return ``root``.

    Deterministic for (n, num_classes, seed). A folder already holding the same
    dataset (per its marker file) is reused as is. ``progress``: say on stderr
    what is made (or reused) and how far it has got.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if num_classes < 1:
        raise ValueError(f"num_classes must be >= 1, got {num_classes}")
    root = Path(root)
    spec = {"version": _FORMAT_VERSION, "n": n, "num_classes": num_classes, "seed": seed}
    marker = root / _MARKER
    if marker.exists():
        try:
            held = json.loads(marker.read_text())
        except (OSError, json.JSONDecodeError):
            held = None
        if held == spec:
            if progress:
                _say(f"{root} already holds these {n} JPEGs in {_classes(n, num_classes)} (seed {seed}): reused")
            return root
        if isinstance(held, dict) and {"n", "num_classes", "seed"} <= held.keys():
            raise FileExistsError(f"{str(root)!r} holds another synthetic data set (n={held['n']}, "
                                  f"classes={held['num_classes']}, seed={held['seed']}), which a loader would read "
                                  "with this one: give another folder, or delete it first")
    foreign = _foreign(root, n, num_classes)
    if foreign is not None:
        raise FileExistsError(f"{str(root)!r} holds {foreign!r}, which this data set does not hold: a loader would read "
                              "it with the images written here; give an empty or new folder")
    for c in range(min(num_classes, n)):
        (root / f"class_{c:03d}").mkdir(parents=True, exist_ok=True)
    workers = workers or min(len(os.sched_getaffinity(0)), 32)
    chunks = [(i, min(i + _CHUNK, n)) for i in range(0, n, _CHUNK)]
    workers = min(workers, len(chunks))
    if progress:
        _say(f"writing {n} ImageNet-like JPEGs in {_classes(n, num_classes)} under {root} (seed {seed}, "
             f"{workers} process{'es' if workers > 1 else ''})")
    with Progress("gpufeed synth", n, shown=progress) as bar:
        if workers <= 1:
            for i in range(n):
                _write_range(str(root), seed, i, i + 1, num_classes)
                bar.update(i + 1)
        else:
            # a Pool, not an executor: leaving the block on Ctrl-C or a failed chunk stops the processes at once
            with multiprocessing.Pool(workers, initializer=_leave_ctrl_c_to_the_parent) as pool:
                tasks = [(str(root), seed, a, b, num_classes) for a, b in chunks]
                for a, b in pool.imap_unordered(_write_task, tasks):
                    bar.update(bar.done + b - a)
    marker.write_text(json.dumps(spec))
    return root


def _foreign(root: Path, n: int, num_classes: int) -> str | None:
    """The first entry of ``root`` that this run (``n`` images in ``num_classes`` classes) does not write (None:
    there is none; an unfinished run of the same data set is written over, image for image)."""
    if not root.is_dir():
        return None
    for entry in sorted(root.iterdir()):
        if entry.name == _MARKER:
            continue
        folder = re.fullmatch(r"class_(\d{3,})", entry.name)
        if not (entry.is_dir() and folder and int(folder[1]) < min(n, num_classes)):
            return entry.name
        for f in sorted(entry.iterdir()):
            image = re.fullmatch(r"img_(\d{6,})\.jpg", f.name)
            if not (image and int(image[1]) < n and int(image[1]) % num_classes == int(folder[1])):
                return f"{entry.name}/{f.name}"
    return None


def _leave_ctrl_c_to_the_parent() -> None:
    """A pool process ignores SIGINT: Ctrl-C reaches the whole process group, and the parent alone stops the
    run, with one message instead of one traceback per process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _classes(n: int, num_classes: int) -> str:
    """How many class folders ``n`` images in ``num_classes`` classes fill: image i goes to class i % num_classes."""
    return (f"{num_classes} classes" if n >= num_classes else
            f"{n} class folder{'s' if n > 1 else ''} (of {num_classes} classes: one image each)")


def _say(line: str) -> None:
    print(f"gpufeed synth: {line}", file=sys.stderr, flush=True)


def tar_shards(source, per_shard: int, n: int | None = None) -> list[bytes]:
    """The first ``n`` (default all) samples of ``source`` (a ``sources.Source``) as WebDataset tar shards
    of ``per_shard`` samples each: ``<id>.jpg`` with ``<id>.cls`` holding the label, sample i in shard
    i // per_shard."""
    import tarfile

    n = len(source) if n is None else n
    shards = []
    for start in range(0, n, per_shard):
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tf:
            for i in range(start, min(start + per_shard, n)):
                for name, data in ((f"{i:06d}.jpg", source.read(i)), (f"{i:06d}.cls", str(source.label(i)).encode())):
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    tf.addfile(info, io.BytesIO(data))
        shards.append(buf.getvalue())
    return shards
