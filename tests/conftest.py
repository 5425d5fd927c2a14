"""Shared fixtures: small generated datasets (nothing is downloaded)."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from gpufeed.synth import create_synthetic_dataset


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def synth_root(tmp_path_factory):
    """40 synthetic JPEGs in 4 classes."""
    return create_synthetic_dataset(tmp_path_factory.mktemp("synth"), n=40, num_classes=4, seed=1, workers=1)


@pytest.fixture()
def coloured(tmp_path):
    """Three classes of flat colours, 4 JPEGs each of varied widths, and a PNG named .jpg in class 1."""
    colours = [(220, 30, 30), (30, 220, 30), (30, 30, 220)]
    for c, colour in enumerate(colours):
        (tmp_path / f"c{c}").mkdir()
        for i in range(4):
            Image.new("RGB", (60 + 10 * i, 50), colour).save(tmp_path / f"c{c}" / f"{i}.jpg", quality=95)
    Image.new("RGB", (40, 40), colours[1]).save(tmp_path / "c1" / "png.jpg", "PNG")
    return tmp_path


def jpeg_bytes(width: int, height: int, seed: int = 0, quality: int = 90, **save_kw) -> bytes:
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (height // 8 + 1, width // 8 + 1, 3), dtype=np.uint8)
    img = Image.fromarray(pixels).resize((width, height), Image.BILINEAR)
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=quality, **save_kw)
    return buf.getvalue()
