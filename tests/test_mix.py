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
        ImageLoader(synth_root, device="cpu", batch_transform=v2.MixUp())
