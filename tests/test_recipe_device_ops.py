"""A recipe mixing device ops (RandomPerspective, containers) with ops that run in the CPU workers
(ElasticTransform, a user's own callable) through ImageLoader on the CPU: each sample is the workers'
torchvision ops then the device ops with the sample's draws, a training step runs on it, a resumed epoch
repeats, and placement.ops sends each op where its place lets it run."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as F

from gpufeed import ImageLoader
from gpufeed.augment.ops import SampleOps
from gpufeed.augment.recipe import read_transform
from tests.helpers import torchvision_ops


class PaintRow:
    """A user's own op on a PIL image: a white row at a height drawn from torch's generator."""

    def __call__(self, image: Image.Image) -> Image.Image:
        pixels = np.array(image)
        pixels[int(torch.randint(0, pixels.shape[0], ()).item())] = 255
        return Image.fromarray(pixels)


CROP = [v2.RandomResizedCrop(32, scale=(0.3, 1.0)), v2.RandomHorizontalFlip()]
IN_WORKERS = [v2.ElasticTransform(alpha=30.0), PaintRow()]
ON_DEVICE = [v2.RandomPerspective(distortion_scale=0.6, p=0.7, fill=(20, 40, 60)),
             v2.RandomApply([v2.RandomVerticalFlip(1.0)], p=0.5)]
FLOAT = [v2.ToImage(), v2.ToDtype(torch.float32, scale=True)]


def _loader(root, recipe, **kw) -> ImageLoader:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ImageLoader(root, transform=v2.Compose(recipe), batch_size=8, device="cpu", num_workers=1, seed=3, **kw)


def _first(loader: ImageLoader) -> tuple[torch.Tensor, list[int]]:
    try:
        images, _ = next(iter(loader))
        return (images * 255).round().to(torch.uint8), list(loader.batch_indices)
    finally:
        loader.close()


def _in_workers(image: np.ndarray, index: int) -> torch.Tensor:
    """The workers' ops on sample ``index``'s crop, as torchvision runs them with the sample's seeds."""
    return torch.from_numpy(np.array(torchvision_ops(IN_WORKERS, image, 3, 0, index))).permute(2, 0, 1)


def test_the_workers_ops_then_the_device_ops_give_torchvisions_tensor_kernels_pixels_per_sample(synth_root):
    """Each sample: the crop gpufeed makes, through ElasticTransform and PaintRow in the workers (torchvision's
    ops on the PIL image), then RandomPerspective and RandomApply on the device with the sample's draws: what
    torchvision's tensor kernels (``F.perspective``, ``F.vertical_flip`` on the uint8 tensor) give for those
    draws. torchvision's own RandomPerspective here would get the PIL image and warp it with Pillow, which
    differs from its tensor warp (docs/recipes.md). Said once in the warning, and in loader.stats."""
    with pytest.warns(UserWarning, match="ElasticTransform, PaintRow have no device version") as said:
        loader = ImageLoader(synth_root, transform=v2.Compose(CROP + IN_WORKERS + ON_DEVICE + FLOAT), batch_size=8,
                             device="cpu", num_workers=1, seed=3)
    assert sum("device version" in str(w.message) for w in said) == 1
    assert loader.stats["ops_on_device"] == ["RandomPerspective", "RandomApply"]
    assert loader.stats["ops_in_workers"] == ["ElasticTransform", "PaintRow"]
    warp, flip = loader.sample_ops.pixel
    images, indices = _first(loader)
    crops, same = _first(_loader(synth_root, CROP + FLOAT))
    assert indices == same
    warps, flips = (SampleOps.draws(op, indices, seed=3, epoch=0, size=32) for op in (warp, flip))
    start = [[0, 0], [31, 0], [31, 31], [0, 31]]
    for got, crop, index, corners, flipped in zip(images, crops, indices, warps, flips, strict=True):
        want = _in_workers(crop.permute(1, 2, 0).numpy(), index)  # a uint8 tensor from here: the tensor kernels
        if corners is not None:
            want = F.perspective(want, start, [list(c) for c in corners], fill=[20, 40, 60])
        if flipped is not None:
            want = F.vertical_flip(want)
        assert torch.equal(got, want), index
    assert 0 < sum(c is not None for c in warps) < 8


def test_the_bar_recipe_trains_a_step_on_the_cpu(synth_root):
    """Compose([RandomResizedCrop, RandomPerspective, ElasticTransform, a user's op, RandomChoice, ...,
    Normalize]): one SGD step of a small network on its batches moves the weights."""
    recipe = [v2.RandomResizedCrop(32), v2.RandomPerspective(p=1.0), v2.ElasticTransform(alpha=20.0), PaintRow(),
              v2.RandomChoice([v2.RandomPerspective(0.3, p=1.0), v2.RandomGrayscale(1.0)]), *FLOAT,
              v2.Normalize([0.5] * 3, [0.25] * 3)]
    loader = _loader(synth_root, recipe)
    assert loader.stats["ops_in_workers"] == ["RandomPerspective", "ElasticTransform", "PaintRow"]
    assert loader.stats["ops_on_device"] == ["RandomChoice"]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, stride=2), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
                                torch.nn.Flatten(), torch.nn.Linear(8, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    try:
        images, labels = next(iter(loader))
    finally:
        loader.close()
    assert images.shape == (8, 3, 32, 32) and images.dtype == torch.float32
    loss = torch.nn.functional.cross_entropy(model(images), labels)
    loss.backward()
    optimizer.step()
    assert torch.isfinite(loss) and any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_a_resumed_epoch_repeats_the_device_draws(synth_root):
    recipe = CROP + [v2.RandomOrder([v2.RandomPerspective(p=1.0), v2.RandomGrayscale(0.5)])] + FLOAT
    loader = _loader(synth_root, recipe)
    try:
        it = iter(loader)
        next(it)
        state = loader.state_dict()
        rest = [images.clone() for images, _ in it]
        epoch_1 = next(iter(loader))[0]
    finally:
        loader.close()
    resumed = _loader(synth_root, recipe)
    resumed.load_state_dict(state)
    try:
        again = [images for images, _ in resumed]
    finally:
        resumed.close()
    assert len(rest) == len(again) == 4 and all(torch.equal(a, b) for a, b in zip(rest, again, strict=True))
    assert not torch.equal(epoch_1, rest[0])


def _placed(ops):
    recipe = read_transform(v2.Compose(ops))
    return recipe.device, recipe.workers and recipe.workers.names, recipe.workers and recipe.workers.placed


@pytest.mark.parametrize("ops, device, workers, placed", [
    ([v2.RandomResizedCrop(32), v2.RandomPerspective()], ("RandomPerspective",), None, None),
    ([v2.RandomResizedCrop(32), v2.TrivialAugmentWide(), v2.RandomHorizontalFlip()], (),
     ("TrivialAugmentWide", "RandomHorizontalFlip"), ("TrivialAugmentWide",)),
    ([v2.RandomResizedCrop(32), v2.ColorJitter(0.4), v2.RandomHorizontalFlip()], ("ColorJitter",), None, None),
    ([v2.ColorJitter(0.4), v2.RandomResizedCrop(32)], (), ("ColorJitter", "RandomResizedCrop"), ("ColorJitter",)),
    ([v2.RandomResizedCrop(32), v2.RandomGrayscale(), v2.RandomPerspective(), v2.RandomGrayscale()], (),
     ("RandomGrayscale", "RandomPerspective", "RandomGrayscale"), ("RandomGrayscale",)),
    ([v2.RandomResizedCrop(32), v2.RandomPerspective(), v2.ElasticTransform(), v2.ColorJitter(0.2)], ("ColorJitter",),
     ("RandomPerspective", "ElasticTransform"), ()),
], ids=["after-crop", "before-flip", "commutes-with-flip", "before-crop", "second-of-a-kind", "among-worker-ops"])
def test_each_op_runs_where_its_place_lets_it(ops, device, workers, placed):
    assert _placed(ops) == (device, workers, placed)


def test_a_device_op_placed_for_the_workers_is_said_so(synth_root):
    with pytest.warns(UserWarning, match="TrivialAugmentWide stands where the device does not run it .*before a flip"):
        loader = ImageLoader(synth_root, transform=v2.Compose([v2.RandomResizedCrop(16), v2.TrivialAugmentWide(),
                                                               v2.RandomHorizontalFlip()]), batch_size=8, device="cpu",
                             num_workers=1)
    loader.close()
