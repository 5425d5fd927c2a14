"""Shared fixtures: small generated datasets (nothing is downloaded). Under ``CI=true``: every part the test
dependency group installs must be here, and no test may skip but those marked ``gpu`` (no CUDA here)."""

from __future__ import annotations

import importlib.util
import io
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from gpufeed.synth import create_synthetic_dataset

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"
# the import name of each distribution of the test group whose name is not its import name ("-" read as "_")
IMPORT_NAMES = {"nvidia-ml-py": "pynvml"}
# what the suite needs beyond the test group's list: the C extension
C_EXTENSION = "the cropped-decode C extension (python setup.py build_ext --inplace, or pip install -e .)"


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def group_requirements(pyproject: Path = PYPROJECT) -> list[str]:
    """The requirement strings of pyproject.toml's ``test`` dependency group."""
    try:
        import tomllib
    except ImportError:  # Python 3.10: pytest itself depends on tomli there
        import tomli as tomllib
    return tomllib.loads(pyproject.read_text())["dependency-groups"]["test"]


def required_modules(pyproject: Path = PYPROJECT) -> dict[str, str]:
    """Import name -> the part it stands for: each distribution of the test dependency group."""
    from packaging.requirements import Requirement  # a dependency of pytest's

    reqs = [Requirement(r) for r in group_requirements(pyproject)]
    names = {r.name.lower() for r in reqs if r.marker is None or r.marker.evaluate()}  # this platform's
    modules = {IMPORT_NAMES.get(n, n.replace("-", "_").replace(".", "_")): f"{n} (the test group)" for n in names}
    return modules


def missing_parts(pyproject: Path = PYPROJECT) -> list[str]:
    """What the suite needs and this environment lacks, one line each ("" when nothing is missing)."""
    missing = []
    for module, part in sorted(required_modules(pyproject).items()):
        try:
            found = importlib.util.find_spec(module) is not None  # located, not imported: cheap at each start
        except (ImportError, ValueError):  # ValueError: a module set to None in sys.modules
            found = False
        if not found:
            missing.append(f"{part}: cannot import {module!r}")
    from gpufeed.decode.cpu import cropped_decode_available

    if not cropped_decode_available():
        missing.append(C_EXTENSION)
    return missing


def pytest_configure(config):
    if not in_ci():
        return
    missing = missing_parts()
    if missing:
        raise pytest.UsageError("CI=true and parts the suite needs are missing, so their tests would only skip:\n  "
                                + "\n  ".join(missing) + "\ninstall them: pip install -e . --group test")


def _ci_skip_failure(reason: str) -> str:
    return (f"CI=true: skipped ({reason}). Under CI only tests marked gpu may skip (no CUDA here); any other skip "
            "means a part the test dependency group installs is missing or broken: pip install -e . --group test (and build the "
            "C extension)")


def _reason(longrepr) -> str:
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return reason.removeprefix("Skipped: ")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Under CI=true a skipped test fails, unless it carries the gpu marker (the marker: a test whose name,
    parameters or folder merely say "gpu" is no exemption), and so does an expected failure."""
    outcome = yield
    report = outcome.get_result()
    if not (report.skipped and in_ci()):
        return
    if hasattr(report, "wasxfail"):
        report.outcome = "failed"
        report.longrepr = f"CI=true: an expected failure ({report.wasxfail or 'xfail'}) is a failure; fix it or remove it"
    elif item.get_closest_marker("gpu") is None:
        report.outcome = "failed"
        report.longrepr = _ci_skip_failure(_reason(report.longrepr))


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """Under CI=true a module that skips itself (``pytest.importorskip`` at module level) fails to collect."""
    outcome = yield
    report = outcome.get_result()
    if report.outcome == "skipped" and in_ci():
        report.outcome = "failed"
        report.longrepr = _ci_skip_failure(_reason(report.longrepr))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def synth_root(tmp_path_factory):
    """40 synthetic JPEGs in 4 classes."""
    return create_synthetic_dataset(tmp_path_factory.mktemp("synth"), n=40, num_classes=4, seed=1, workers=1)


@pytest.fixture()
def coloured(tmp_path):
    """Three classes, each a colour over texture (the mean colour names the class, and two crops of an image
    differ), 4 JPEGs each of varied widths, and a PNG named .jpg in class 1."""
    from tests.helpers import textured

    colours = [(220, 30, 30), (30, 220, 30), (30, 30, 220)]
    for c, colour in enumerate(colours):
        (tmp_path / f"c{c}").mkdir()
        for i in range(4):
            textured(60 + 10 * i, 50, 10 * c + i, colour).save(tmp_path / f"c{c}" / f"{i}.jpg", quality=95)
    textured(40, 40, 99, colours[1]).save(tmp_path / "c1" / "png.jpg", "PNG")
    return tmp_path


def jpeg_bytes(width: int, height: int, seed: int = 0, quality: int = 90, **save_kw) -> bytes:
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (height // 8 + 1, width // 8 + 1, 3), dtype=np.uint8)
    img = Image.fromarray(pixels).resize((width, height), Image.BILINEAR)
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=quality, **save_kw)
    return buf.getvalue()
