"""MixUp and CutMix in the loader (augment/mix.py): the draws follow torchvision's, a resumed epoch mixes as
an uninterrupted one, and what gpufeed does not read is called as given."""

import pytest
import torch
from torchvision.transforms import v2

from gpufeed import ImageLoader
from gpufeed.augment.mix import read_batch_transform
from gpufeed.augment.params import SampleRandom

from .stats import assert_same_distribution, assert_same_frequencies

N = 3000


def _ours(transform, n=N, h=32, w=24):
    mix = read_batch_transform(transform)
    return [mix.draw(SampleRandom(7 ^ mix.salt, 0, k), h, w) for k in range(n)]


def _theirs_cutmix(t, n=N, h=32, w=24):
    torch.manual_seed(0)
    image = torch.zeros(1, 3, h, w)
    return [t.make_params([image]) for _ in range(n)]


@pytest.mark.parametrize("alpha", [0.2, 1.0])
def test_mixup_lam_follows_torchvisions_beta(alpha):
    t = v2.MixUp(num_classes=10, alpha=alpha)
    torch.manual_seed(0)
    theirs = [t.make_params([])["lam"] for _ in range(N)]
    ours = _ours(t)
    assert {m.kind for m in ours} == {"MixUp"} and all(m.box is None for m in ours)
    assert assert_same_distribution([m.lam for m in ours], theirs, f"MixUp(alpha={alpha}) lam") == N


def test_cutmix_boxes_follow_torchvisions():
    t = v2.CutMix(num_classes=10, alpha=1.0)
    ours, theirs = _ours(t), _theirs_cutmix(t)
    assert all(0 <= m.box[0] <= m.box[2] <= 24 and 0 <= m.box[1] <= m.box[3] <= 32 for m in ours)
    compared = assert_same_distribution([m.lam for m in ours], [p["lam_adjusted"] for p in theirs], "CutMix lam")
    for k, side in enumerate(("x1", "y1", "x2", "y2")):
        compared += assert_same_distribution([m.box[k] + 0.0 for m in ours], [p["box"][k] + 0.0 for p in theirs],
                                             f"CutMix {side}")
    assert compared == 5 * N
    # the label weight is the share of the image left outside the box, as torchvision adjusts it
    assert all(abs(m.lam - (1 - (m.box[2] - m.box[0]) * (m.box[3] - m.box[1]) / (24 * 32))) < 1e-12 for m in ours)


def test_random_choice_picks_with_its_probabilities():
    t = v2.RandomChoice([v2.MixUp(num_classes=3), v2.CutMix(num_classes=3)], p=[1, 3])
    torch.manual_seed(0)
    theirs = [type(t.transforms[int(torch.multinomial(torch.tensor(t.p), 1))]).__name__ for _ in range(N)]
    assert assert_same_frequencies([m.kind for m in _ours(t)], theirs, "RandomChoice") == N


def test_a_resumed_epoch_mixes_as_an_uninterrupted_one(synth_root):
    """The mix of each batch is keyed by the loader's seed, the epoch and the batch's first sample: a loader
    resumed from a mid-epoch state gives the rest of the epoch exactly, mixes included."""
    kw = dict(batch_size=4, image_size=16, device="cpu", num_workers=2, seed=3,
              batch_transform=v2.RandomChoice([v2.MixUp(num_classes=4), v2.CutMix(num_classes=4)]))
    with ImageLoader(synth_root, **kw) as loader:
        whole = [(x, y) for x, y in loader]
    with ImageLoader(synth_root, **kw) as loader:
        it = iter(loader)
        head = [next(it) for _ in range(3)]
        state = loader.state_dict()
        it.close()
    with ImageLoader(synth_root, **kw) as loader:
        loader.load_state_dict(state)
        rest = [(x, y) for x, y in loader]
    assert len(whole) == 10 and len(head) + len(rest) == 10
    for (x, y), (xw, yw) in zip(head + rest, whole, strict=True):
        assert torch.equal(x, xw) and torch.equal(y, yw)
    assert any(not torch.equal(y.max(dim=1).values, torch.ones(4)) for _, y in whole)  # labels were mixed


def test_what_gpufeed_does_not_read_is_called_as_given(synth_root):
    """A function, a MixUp with its own labels getter, MixUp and CutMix of different widths: called on each
    batch on the consumer's side, as before."""
    calls = []

    def mine(images, labels):
        calls.append(len(labels))
        return images, labels

    own_getter = v2.MixUp(num_classes=4, labels_getter=lambda inputs: inputs[1])
    widths = v2.RandomChoice([v2.MixUp(num_classes=4), v2.CutMix(num_classes=5)])
    for transform in (mine, own_getter, widths):
        assert read_batch_transform(transform) is None
    with ImageLoader(synth_root, batch_size=4, image_size=16, device="cpu", num_workers=2,
                     batch_transform=mine) as loader:
        assert loader.batch_mix is None
        assert sum(1 for _ in loader) == 10 and calls == [4] * 10
    with ImageLoader(synth_root, batch_size=4, image_size=16, device="cpu", num_workers=2,
                     batch_transform=own_getter) as loader:
        assert all(y.shape == (4, 4) for _, y in loader)  # torchvision's own, called on each batch


def test_a_mixup_without_num_classes_is_refused_naming_it(synth_root):
    with pytest.raises(ValueError, match=r"MixUp\(alpha=1.0\) has num_classes=None: .* give it num_classes"):
        ImageLoader(synth_root, device="cpu", batch_size=8, batch_transform=v2.MixUp())


def test_the_mix_follows_the_per_sample_ops(synth_root):
    """With TrivialAugmentWide and MixUp/CutMix: the batch the loader gives is torchvision's mix, for the
    loader's draw, of the batch the same recipe gives without it."""
    from gpufeed.augment.params import SampleRandom

    from .test_loader import _torchvision_with

    recipe = v2.Compose([v2.RandomResizedCrop(16), v2.TrivialAugmentWide(), v2.PILToTensor(),
                         v2.ToDtype(torch.float32, scale=True)])
    mixing = v2.RandomChoice([v2.MixUp(num_classes=4), v2.CutMix(num_classes=4)])
    kw = dict(batch_size=4, device="cpu", num_workers=2, seed=9, transform=recipe)
    with ImageLoader(synth_root, **kw) as plain, ImageLoader(synth_root, batch_transform=mixing, **kw) as mixed:
        kinds, compared = set(), 0
        for (x, y), (xm, ym) in zip(plain, mixed, strict=True):
            drawn = mixed.batch_mix.draw(SampleRandom(9 ^ mixed.batch_mix.salt, 0, plain.batch_indices[0]), 16, 16)
            expected_x, expected_y = _torchvision_with(mixing, drawn)(x, y)
            assert torch.equal(xm, expected_x) and torch.equal(ym, expected_y)
            kinds.add(drawn.kind)
            compared += 1
    assert compared == 10 and kinds == {"MixUp", "CutMix"}


def test_setting_batch_transform_takes_effect_for_later_batches(synth_root):
    """``loader.batch_transform = None`` stops the mixing, another one starts it, from the batches made from
    then on; one whose num_classes is under the data's is refused, naming both."""
    with ImageLoader(synth_root, batch_size=4, image_size=16, device="cpu", num_workers=2,
                     batch_transform=v2.MixUp(num_classes=4)) as loader:
        shapes = [tuple(y.shape) for _, y in loader]
        loader.batch_transform = None
        assert loader.batch_mix is None
        plain = [tuple(y.shape) for _, y in loader]
        loader.batch_transform = v2.CutMix(num_classes=4)
        again = [tuple(y.shape) for _, y in loader]
        with pytest.raises(ValueError, match=r"num_classes=3, but the data has 4 classes"):
            loader.batch_transform = v2.MixUp(num_classes=3)
        assert loader.batch_mix.choices == (("CutMix", 1.0),)  # the refused one changed nothing
    assert shapes == again == [(4, 4)] * 10 and plain == [(4,)] * 10


def test_a_tiny_alpha_never_divides_by_zero():
    """Beta(alpha, alpha) with alpha = 0.001: both Gamma draws can underflow; each is clamped as torch's are,
    and lam stays in [0, 1]."""
    mix = read_batch_transform(v2.MixUp(num_classes=2, alpha=0.001))
    lams = [mix.draw(SampleRandom(1, 0, k), 8, 8).lam for k in range(5000)]
    assert all(0.0 <= lam <= 1.0 for lam in lams)


class _Fixed:
    """A SampleRandom stand-in: uniform() 0, Gamma draws 1 and 0 (lam 1: a box of no size, at its centre),
    randint() the upper end of its range."""

    def __init__(self):
        self.gammas = iter([1.0, 0.0])

    def uniform(self):
        return 0.0

    def gamma(self, alpha):
        return next(self.gammas)

    def randint(self, low, high):
        return high


def test_a_cutmix_box_centre_reaches_the_last_row_and_column():
    """torchvision draws the centre with randint(W) and randint(H): up to W - 1 and H - 1."""
    mix = read_batch_transform(v2.CutMix(num_classes=2))
    assert mix.draw(_Fixed(), 32, 24).box == (23, 31, 23, 31)
