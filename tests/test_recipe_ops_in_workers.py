"""Recipe ops that do not run on the device (ElasticTransform, a user's own callable, and the device ops among
them, such as RandomPerspective) run per sample in the CPU workers as torchvision's own: checked against
torchvision run on the same crops (or the same decoded image) with the per-sample seeds, so the ops are
applied, in the recipe's order."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.transforms import v2

from gpufeed import ImageLoader
from tests.helpers import torchvision_ops


class PaintRow:
    """A user's own op on a PIL image: a white row at a height drawn from torch's generator."""

    def __call__(self, image: Image.Image) -> Image.Image:
        pixels = np.array(image)
        pixels[int(torch.randint(0, pixels.shape[0], ()).item())] = 255
        return Image.fromarray(pixels)


def invert(image: torch.Tensor) -> torch.Tensor:
    """A user's own function on the (3, H, W) uint8 tensor ToImage makes."""
    return 255 - image


def shrink(image: Image.Image) -> Image.Image:
    return image.resize((image.width // 2, image.height // 2))


def _to_float(*before: object) -> list:
    return [*before, v2.ToImage(), v2.ToDtype(torch.float32, scale=True)]


def _batches(root, transform, n: int, loader: ImageLoader | None = None, **kw) -> list[tuple[torch.Tensor, list[int]]]:
    """The first ``n`` batches (of ``loader``, else of one made here) as uint8 (B, 3, S, S) and their source
    indices."""
    if loader is None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loader = ImageLoader(root, transform=transform, batch_size=8, device="cpu", **kw)
    out = []
    try:
        for images, _ in loader:
            out.append(((images * 255).round().to(torch.uint8), list(loader.batch_indices)))
            if len(out) == n:
                break
    finally:
        loader.close()
    return out


def test_perspective_elastic_and_a_users_op_run_in_the_workers_after_the_crop(synth_root):
    """A Compose with RandomPerspective, ElasticTransform and a user's own op trains with gpufeed; each sample
    is the crop gpufeed makes without them, through torchvision's ops in the recipe's order (RandomPerspective
    there too, standing before the others), with the sample's seeds (whichever of the two workers made it);
    said once, and in loader.stats."""
    crop = [v2.RandomResizedCrop(32, scale=(0.3, 1.0)), v2.RandomHorizontalFlip()]
    extra = [v2.RandomPerspective(p=1.0), v2.ElasticTransform(alpha=30.0), PaintRow()]
    recipe = v2.Compose(_to_float(*crop, *extra))
    with pytest.warns(UserWarning) as said:
        loader = ImageLoader(synth_root, transform=recipe, batch_size=8, device="cpu", num_workers=2, seed=3)
    ours = [w for w in said if "no device version" in str(w.message)]
    assert len(ours) == 1 and "ElasticTransform, PaintRow have no device version" in str(ours[0].message)
    assert "(RandomPerspective too, to keep the recipe's order)" in str(ours[0].message)
    assert "after the crop" in str(ours[0].message)
    assert loader.stats["ops_in_workers"] == ["RandomPerspective", "ElasticTransform", "PaintRow"]
    assert "RandomPerspective" in loader.decode_reason

    got = _batches(synth_root, recipe, 2, loader)
    plain = _batches(synth_root, v2.Compose(_to_float(*crop)), 2, num_workers=1, seed=3)
    changed = 0
    for (images, indices), (crops, same) in zip(got, plain, strict=True):
        assert indices == same  # the same order and the same crops underneath
        for image, crop_pixels, index in zip(images, crops, indices, strict=True):
            want = torchvision_ops(extra, crop_pixels.permute(1, 2, 0).numpy(), 3, 0, index)
            np.testing.assert_array_equal(image.permute(1, 2, 0).numpy(), want)
            # PaintRow ran last: one row is white across (before the warps it would be bent)
            assert (image == 255).all(dim=0).all(dim=1).any()
            changed += not torch.equal(image, crop_pixels)
    assert changed == 16


def test_an_op_before_the_crop_runs_on_the_whole_image_in_the_workers(synth_root):
    """RandomPerspective before RandomResizedCrop: the workers decode the whole image and run both as
    torchvision does on the PIL image the file opens to."""
    recipe = v2.Compose(_to_float(v2.RandomPerspective(p=1.0), v2.RandomResizedCrop(24)))
    with pytest.warns(UserWarning, match="before the crop"):
        loader = ImageLoader(synth_root, transform=recipe, batch_size=8, device="cpu", num_workers=1)
    assert loader.stats["ops_in_workers"] == ["RandomPerspective", "RandomResizedCrop"]
    assert (loader.augment.train, loader.augment.image_size) == (True, 24)
    with pytest.raises(ValueError, match="progressive resizing needs the crop first"):
        loader.set_image_size(16)
    (images, indices), = _batches(synth_root, recipe, 1, loader)
    for image, index in zip(images, indices, strict=True):
        with Image.open(loader.source.path(index)) as f:
            whole = np.asarray(f.convert("RGB"))
        want = torchvision_ops(list(recipe.transforms[:2]), whole, 0, 0, index)
        np.testing.assert_array_equal(image.permute(1, 2, 0).numpy(), want)


def test_a_users_function_after_to_image_takes_the_uint8_tensor(synth_root):
    """Validation with a user's function after ToImage: it gets the (3, H, W) uint8 tensor of the centre
    crop, and the device ops (Normalize) run after it."""
    geometry = [v2.Resize(40), v2.CenterCrop(32)]
    plain, = _batches(synth_root, v2.Compose(_to_float(*geometry)), 1, num_workers=1)
    recipe = v2.Compose([*geometry, v2.ToImage(), invert, v2.ToDtype(torch.float32, scale=True),
                         v2.Normalize([0.5] * 3, [0.25] * 3)])
    with pytest.warns(UserWarning, match="invert has no device version: it runs per sample"):
        loader = ImageLoader(synth_root, transform=recipe, batch_size=8, device="cpu", num_workers=1)
    assert loader.stats["ops_in_workers"] == ["invert"] and not loader.augment.train
    try:
        images, _ = next(iter(loader))
        assert list(loader.batch_indices) == plain[1]
    finally:
        loader.close()
    pixels = ((images * 0.25 + 0.5) * 255).round().to(torch.uint8)
    assert torch.equal(pixels, 255 - plain[0])


def test_the_draws_follow_seed_epoch_and_index_and_a_resumed_epoch_repeats(synth_root):
    recipe = v2.Compose(_to_float(v2.RandomResizedCrop(16), v2.RandomPerspective(p=1.0), PaintRow()))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loader = ImageLoader(synth_root, transform=recipe, batch_size=8, device="cpu", num_workers=1, seed=5)
    try:
        it = iter(loader)
        next(it)
        state = loader.state_dict()
        rest = [images.clone() for images, _ in it]
        epoch_1 = next(iter(loader))[0]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            resumed = ImageLoader(synth_root, transform=recipe, batch_size=8, device="cpu", num_workers=1, seed=5)
        resumed.load_state_dict(state)
        again = [images for images, _ in resumed]
        resumed.close()
    finally:
        loader.close()
    assert len(rest) == len(again) == 4 and all(torch.equal(a, b) for a, b in zip(rest, again, strict=True))
    assert not torch.equal(epoch_1, rest[0])


def test_ops_after_the_crop_follow_progressive_resizing(synth_root):
    recipe = v2.Compose(_to_float(v2.RandomResizedCrop(32), PaintRow()))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loader = ImageLoader(synth_root, transform=recipe, batch_size=8, device="cpu", num_workers=1)
    loader.set_image_size(16)
    (images, _), = _batches(synth_root, recipe, 1, loader)
    assert images.shape == (8, 3, 16, 16)
    assert all((image == 255).all(dim=0).all(dim=1).any() for image in images)  # PaintRow ran at 16 x 16


def test_a_stretch_that_changes_the_size_names_the_ops_and_the_file(synth_root):
    from gpufeed import WorkerError

    recipe = v2.Compose(_to_float(v2.RandomResizedCrop(16), shrink))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loader = ImageLoader(synth_root, transform=recipe, batch_size=8, device="cpu", num_workers=1)
    with pytest.raises(WorkerError, match=r"shrink \(run in the workers\) gave a RGB PIL image of 8 x 8; .*16 x 16"):
        next(iter(loader))
    loader.close()


@pytest.mark.parametrize("ops, message", [
    (lambda: [v2.RandomResizedCrop(16), lambda image: image], "<lambda> .*cannot be pickled.*module-level function"),
    (lambda: [v2.RandomResizedCrop(16), _local()], "local_op .*cannot be pickled.*not a lambda or a local function"),
    (lambda: _to_float(v2.RandomResizedCrop(16)) + [invert], "invert stands after ToDtype.*place it before ToDtype"),
    (lambda: [v2.Resize(16), v2.RandomPerspective(), v2.Resize(16)], "must end their geometry with RandomResizedCrop"),
    (lambda: [v2.RandomPerspective(), v2.CenterCrop(16), v2.ColorJitter(0.2)], "ColorJitter is a training op"),
])
def test_what_the_workers_cannot_run_is_refused_when_the_loader_is_made(synth_root, ops, message):
    with pytest.raises(ValueError, match=message):
        ImageLoader(synth_root, transform=v2.Compose(ops()), device="cpu", num_workers=1)


def _local():
    def local_op(image):
        return image

    return local_op


def test_an_op_defined_in_the_training_script_reaches_the_workers(synth_root, tmp_path):
    """A user's op defined in the script that makes the loader (``__main__``): the workers import the script
    to unpickle it, as they do for a source class defined there."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import sys
        import torch
        from torchvision.transforms import v2
        from gpufeed import ImageLoader

        class Darken:
            def __call__(self, image):
                return image // 2

        if __name__ == "__main__":
            recipe = v2.Compose([v2.Resize(20), v2.CenterCrop(16), v2.ToImage(), Darken(),
                                 v2.ToDtype(torch.float32, scale=True)])
            with ImageLoader(sys.argv[1], transform=recipe, batch_size=8, device="cpu", num_workers=1) as loader:
                images, _ = next(iter(loader))
            print(loader.stats["ops_in_workers"], float(images.max()))
    """))
    done = subprocess.run([sys.executable, str(script), str(synth_root)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 0, done.stderr
    names, top = done.stdout.split("] ")
    assert names == "['Darken'" and float(top) <= 127 / 255 + 1e-6  # halved in the workers



def test_a_script_without_the_main_guard_is_told_to_add_it(synth_root, tmp_path):
    """The same script with its loader at the top level: each worker, importing it, would start workers of its
    own; multiprocessing stops it, and the error says which script and the guard it needs."""
    script = tmp_path / "unguarded.py"
    script.write_text(textwrap.dedent("""
        import sys
        import torch
        from torchvision.transforms import v2
        from gpufeed import ImageLoader

        class Darken:
            def __call__(self, image):
                return image // 2

        recipe = v2.Compose([v2.Resize(20), v2.CenterCrop(16), v2.ToImage(), Darken(),
                             v2.ToDtype(torch.float32, scale=True)])
        with ImageLoader(sys.argv[1], transform=recipe, batch_size=8, device="cpu", num_workers=1) as loader:
            next(iter(loader))
    """))
    done = subprocess.run([sys.executable, str(script), str(synth_root)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode != 0
    last = done.stderr.rstrip().splitlines()[-1]
    assert "WorkerError" in last and f"the workers import the training script {str(script)!r}" in last, last
    assert "must run under if __name__ == '__main__':" in last, last

@pytest.mark.gpu
def test_a_cuda_loader_takes_such_a_recipe_through_the_cpu_workers(synth_root):
    recipe = v2.Compose(_to_float(v2.RandomResizedCrop(32), v2.RandomPerspective(p=1.0), PaintRow()))
    with pytest.warns(UserWarning, match="PaintRow has no device version"):
        loader = ImageLoader(synth_root, transform=recipe, batch_size=8, device="cuda", num_workers=1)
    try:
        assert loader.decode_backend == "cpu" and "RandomPerspective" in loader.decode_reason
        images, _ = next(iter(loader))
        indices = list(loader.batch_indices)
    finally:
        loader.close()
    (want, same), = _batches(synth_root, recipe, 1, num_workers=1)
    assert indices == same
    assert torch.equal((images.cpu() * 255).round().to(torch.uint8), want)


def test_random_apply_and_a_nested_compose_are_read_through():
    """RandomApply (a container gpufeed has no device version of) runs in the workers as torchvision's own; a
    Compose within the recipe is read as its ops, so the crop in it stays gpufeed's."""
    from gpufeed.augment.recipe import read_transform

    recipe = read_transform(v2.Compose([v2.Compose([v2.RandomResizedCrop(16), v2.RandomHorizontalFlip()]),
                                        v2.RandomApply([v2.RandomRotation(30)], p=0.5),
                                        v2.Compose(_to_float(v2.GaussianBlur(3)))]))
    assert recipe.workers.names == ("RandomApply",) and not recipe.workers.from_decode
    assert (recipe.image_size, recipe.hflip, [type(op).__name__ for op in recipe.pixel]) == (16, 0.5, ["Blur"])
