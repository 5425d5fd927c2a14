"""What the dependencies are for: the cropped-decode C extension's absence said once when a crop first takes the
whole-image path, and by `gpufeed info` with the way to build it; the bounds pyproject.toml states."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np

SRC = str(Path(__file__).resolve().parent.parent / "src")

_WITHOUT_EXTENSION = """
import sys
sys.modules["gpufeed.decode._turbo_crop"] = None  # the extension not built: importing it fails
import numpy as np
from gpufeed import ImageLoader
from gpufeed.decode.cpu import cropped_decode_available

assert not cropped_decode_available()
for _ in range(2):  # a second loader in the same process says nothing more
    with ImageLoader(sys.argv[1], batch_size=12, image_size=64, device="cpu", num_workers=3, seed=1) as loader:
        images, labels = next(iter(loader))
np.save(sys.argv[2], images.numpy())
np.save(sys.argv[3], labels.numpy())
"""


def _python(code: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env,
                          stdin=subprocess.DEVNULL, timeout=300)


def test_a_missing_cropped_decoder_is_said_once_in_one_line_and_crops_still_come(synth_root, tmp_path):
    """Said once by the process that makes the loaders, not once more by each of its workers."""
    from gpufeed import ImageLoader

    run = _python(_WITHOUT_EXTENSION, str(synth_root), str(tmp_path / "out.npy"), str(tmp_path / "labels.npy"))
    assert run.returncode == 0, run.stderr
    said = [line for line in run.stderr.splitlines() if "cropped-decode" in line]
    assert len(said) == 1 and said[0].startswith("gpufeed: the cropped-decode extension is not built"), run.stderr
    assert "libjpeg-dev" in said[0] and "reinstall gpufeed" in said[0]
    # the whole-image path gives the batch the cropped decoder gives here
    with ImageLoader(str(synth_root), batch_size=12, image_size=64, device="cpu", num_workers=3, seed=1) as loader:
        images, labels = next(iter(loader))
    np.testing.assert_array_equal(np.load(tmp_path / "labels.npy"), labels.numpy())
    np.testing.assert_allclose(np.load(tmp_path / "out.npy"), images.numpy(), atol=1e-6)
    assert images.std() > 0.1


def test_info_says_whether_the_cropped_decoder_is_built_and_how_to_build_it():
    code = ("import sys\n" + 'sys.modules["gpufeed.decode._turbo_crop"] = None\n'
            "from gpufeed.info import collect_info\n"
            'print(collect_info()["decode: cpu cropped (libjpeg-turbo ext)"])\n')
    run = _python(code)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("NO: the cropped-decode extension is not built"), run.stdout
    assert "apt install libjpeg-dev" in run.stdout and "pip install -e . again" in run.stdout
    from gpufeed.info import collect_info

    assert collect_info()["decode: cpu cropped (libjpeg-turbo ext)"].startswith("built")


def test_the_core_dependencies_bound_opencv_below_its_next_major_and_bring_tqdm():
    from packaging.requirements import Requirement

    from .conftest import PYPROJECT

    try:
        import tomllib
    except ImportError:  # Python 3.10: pytest depends on tomli there
        import tomli as tomllib
    core = {r.name: r for r in map(Requirement, tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"])}
    import cv2
    import tqdm

    assert core["opencv-python-headless"].specifier.contains(cv2.__version__)  # the version the suite runs on
    assert not core["opencv-python-headless"].specifier.contains("6.0.0")
    assert core["tqdm"].specifier.contains(tqdm.__version__)


def test_a_torchvision_of_another_build_is_said_with_the_way_out(tmp_path):
    """A torchvision built for another torch fails its import with "operator torchvision::nms does not exist"
    (PyTorch's CPU index and PyPI mixed): gpufeed's import says what it means and how to install both. The
    broken install is stood in for by a package that fails as that one does."""
    fake = tmp_path / "torchvision"
    fake.mkdir()
    (fake / "__init__.py").write_text('raise RuntimeError("operator torchvision::nms does not exist")\n')
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), SRC])}
    done = subprocess.run([sys.executable, "-c", "from gpufeed import ImageLoader"], capture_output=True, text=True,
                          env=env, timeout=120)
    assert done.returncode != 0
    last = done.stderr.rstrip().splitlines()[-1]
    assert last.startswith("ImportError: torchvision does not load with this torch ") and \
        "(operator torchvision::nms does not exist): the two come from different builds" in last, last
    assert "pip install --force-reinstall torch torchvision" in last
    info = subprocess.run([sys.executable, "-m", "gpufeed", "info"], capture_output=True, text=True, env=env,
                          timeout=120)
    assert info.returncode == 2, info.stderr
    assert info.stderr.rstrip().splitlines()[-1].startswith("gpufeed info: error: torchvision does not load with "
                                                            "this torch "), info.stderr
