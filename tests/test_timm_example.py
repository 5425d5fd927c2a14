"""examples/timm_recipe.py on the CPU: two steps of timm's recipe on generated JPEGs, with a timm model and
timm's Mixup where timm is installed, and with torchvision's model and MixUp/CutMix without it."""

import math
import re

import pytest

from .examples import load_example


@pytest.mark.parametrize("with_timm", [True, False])
def test_two_steps_of_the_recipe(capsys, with_timm):
    recipe = load_example("timm_recipe")
    if with_timm and recipe.timm is None:
        pytest.skip("timm is not installed")
    if not with_timm:
        recipe.timm = None  # the fallback, as where timm is missing
    args = ["--synth", "16", "--steps", "2", "--device", "cpu", "--model", "resnet18", "--image-size", "32",
            "--batch-size", "8", "--workers", "1"]
    assert recipe.main(args) == 0
    out = capsys.readouterr().out
    model = "model: timm " if with_timm else "model: torchvision "
    assert model in out and ("(timm is not installed)" in out) != with_timm
    losses = [float(v) for v in re.findall(r"^step \d: loss ([\d.]+|nan|inf)", out, re.M)]
    assert len(losses) == 2 and all(math.isfinite(v) and v > 0 for v in losses)
    assert "2 steps; " in out
    mixing = recipe.mixing(4)
    assert type(mixing).__name__ == ("Mixup" if with_timm else "RandomChoice")


def test_data_or_synth_is_required():
    recipe = load_example("timm_recipe")
    with pytest.raises(SystemExit):
        recipe.parse_args([])
    with pytest.raises(SystemExit):
        recipe.parse_args(["/data", "--synth", "8"])
