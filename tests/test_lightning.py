"""gpufeed.lightning: a Trainer stopped mid-epoch and a new one resumed from its checkpoint see the epoch's
samples exactly once, in the order a plain loader gives them."""

import subprocess
import sys

import pytest
import torch

from gpufeed import ImageLoader

try:
    import lightning.pytorch as pl
except ImportError:  # the tests of what happens without it still run
    pl = None
needs_lightning = pytest.mark.skipif(pl is None, reason="lightning is not installed")
KW = dict(batch_size=4, image_size=16, num_workers=1, device="cpu", seed=11)


class Recorder(pl.LightningModule if pl is not None else object):
    """A linear classifier that records the source indices of every batch it trains and validates on;
    ``one_cycle``: its learning rate schedule is sized by ``trainer.estimated_stepping_batches``."""

    def __init__(self, one_cycle=False, sizes=None):
        super().__init__()
        self.one_cycle, self.sizes = one_cycle, sizes
        self.shapes = []
        self.layer = torch.nn.Linear(3 * 4 * 4, 4)  # on 4 x 4 pooled images: any image size
        self.seen = {"train": [], "val": []}

    def training_step(self, batch, batch_idx):
        images, labels = batch
        self.seen["train"].append((self.current_epoch, list(self.trainer.datamodule.train_loader.batch_indices)))
        self.shapes.append(tuple(images.shape[-2:]))
        pooled = torch.nn.functional.adaptive_avg_pool2d(images, 4).flatten(1)
        return torch.nn.functional.cross_entropy(self.layer(pooled), labels)

    def on_train_epoch_start(self):
        if self.sizes:  # progressive resizing: this epoch's size
            self.trainer.datamodule.train_loader.set_image_size(self.sizes[self.current_epoch])

    def validation_step(self, batch, batch_idx):
        self.seen["val"].append(list(self.trainer.datamodule.val_loader.batch_indices))

    def configure_optimizers(self):
        sgd = torch.optim.SGD(self.parameters(), lr=0.01)
        if not self.one_cycle:
            return sgd
        steps = self.trainer.estimated_stepping_batches  # sets the training loader up before the fit loop
        return {"optimizer": sgd, "lr_scheduler": torch.optim.lr_scheduler.OneCycleLR(sgd, 0.1, total_steps=steps)}


def _trainer(root_dir, **kw):
    return pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, default_root_dir=root_dir, **kw)


def _data_module(*args, **kw):
    from gpufeed.lightning import ImageDataModule  # imports Lightning

    return ImageDataModule(*args, **kw)


def _plain_epochs(root, epochs):
    """Each epoch's source indices, batch by batch, from a plain loader of the same settings."""
    out = []
    with ImageLoader(root, **KW) as loader:
        for _ in range(epochs):
            batches = []
            for _batch in loader:
                batches.append(list(loader.batch_indices))
            out.append(batches)
    return out


@needs_lightning
@pytest.mark.parametrize("one_cycle", [False, True])
def test_a_resumed_trainer_sees_exactly_the_rest_of_the_epoch(synth_root, tmp_path, one_cycle):
    """Lightning saves and restores the loader's state as the fit loop's; with a schedule sized by
    ``estimated_stepping_batches`` it does not restore it (Lightning-AI/pytorch-lightning#20550), and the
    data module's own copy of it does."""
    plain = _plain_epochs(synth_root, 2)
    assert [len(e) for e in plain] == [10, 10]  # 40 samples, batches of 4
    first = Recorder(one_cycle)
    checkpoint = pl.callbacks.ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=4, save_top_k=-1)
    _trainer(tmp_path, max_epochs=1, max_steps=4, callbacks=[checkpoint], limit_val_batches=0).fit(
        first, datamodule=_data_module(synth_root, **KW))
    (path,) = tmp_path.glob("*.ckpt")  # epoch=0-step=4.ckpt
    saved = torch.load(path, weights_only=False)
    (state,) = saved["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    assert state["sampler"]["offset"] == 16 and state["sampler"]["epoch"] == 0
    assert saved["ImageDataModule"] == {"train": state}

    resumed = Recorder(one_cycle)
    _trainer(tmp_path, max_epochs=2, limit_val_batches=0).fit(resumed, datamodule=_data_module(synth_root, **KW),
                                                    ckpt_path=path)
    before = [b for _, b in first.seen["train"]]
    rest = [b for e, b in resumed.seen["train"] if e == 0]
    assert len(before) == 4 and len(rest) == 6
    assert before + rest == plain[0]  # the epoch, each sample once, in the loader's order
    ids = [i for b in before + rest for i in b]
    assert sorted(ids) == list(range(40))
    assert [b for e, b in resumed.seen["train"] if e == 1] == plain[1]  # Lightning's set_epoch: the next order


@needs_lightning
def test_validation_sees_its_whole_set_after_the_sanity_check(synth_root, tmp_path):
    """The sanity check takes two validation batches; every validation after it starts at the beginning.
    A size set in ``on_train_epoch_start`` is that epoch's."""
    model = Recorder(sizes=[12, 16])
    dm = _data_module(synth_root, synth_root, **KW)
    _trainer(tmp_path, max_epochs=2, limit_train_batches=2, num_sanity_val_steps=2).fit(model, datamodule=dm)
    val = model.seen["val"]
    whole = [list(range(k, k + 4)) for k in range(0, 40, 4)]  # validation: the source order
    assert val == whole[:2] + whole + whole
    assert model.shapes == [(12, 12)] * 2 + [(16, 16)] * 2
    assert dm.train_loader is None  # closed at the end of fit


@needs_lightning
def test_the_validation_loader_leaves_the_training_recipe_out(synth_root):
    from torchvision.transforms import v2

    recipe = v2.Compose([v2.RandomResizedCrop(16), v2.ToImage(), v2.ToDtype(torch.float32, scale=True)])
    kw = {k: v for k, v in KW.items() if k != "image_size"}
    dm = _data_module(synth_root, synth_root, transform=recipe, val_kwargs={"image_size": 12}, **kw)
    dm.setup("fit")
    try:
        assert dm.train_loader.augment.train and dm.train_loader.augment.image_size == 16
        assert not dm.val_loader.augment.train and dm.val_loader.augment.image_size == 12
        assert len(dm.train_dataloader()) == len(dm.val_dataloader()) == 10
    finally:
        dm.teardown("fit")
    with pytest.raises(ValueError, match="needs a train or a val source"):
        _data_module(batch_size=4)
    with pytest.raises(RuntimeError, match="ImageDataModule has no train loader: it is made in setup"):
        _data_module(synth_root, **KW).train_dataloader()
    assert _data_module(synth_root, **KW).val_dataloader() == []  # no validation


def test_gpufeed_does_not_import_lightning_and_says_when_it_is_missing():
    code = "import sys, gpufeed; gpufeed.ImageLoader; print(sorted(m for m in sys.modules if 'lightning' in m))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    missing = ("import sys; sys.modules['lightning'] = sys.modules['pytorch_lightning'] = None\n"
               "import gpufeed.lightning")  # as where neither is installed
    err = subprocess.run([sys.executable, "-c", missing], capture_output=True, text=True).stderr
    assert "ImportError: gpufeed.lightning needs Lightning 2.x: pip install lightning" in err


class RankRecorder(Recorder):
    """A Recorder that writes each rank's training and validation batches (epoch, source indices) to
    ``out``/rank-R.json when training ends: under DDP each rank is a process of its own."""

    def __init__(self, out):
        super().__init__()
        self.out = str(out)

    def validation_step(self, batch, batch_idx):
        self.seen["val"].append((self.current_epoch, list(self.trainer.datamodule.val_loader.batch_indices)))

    def on_train_end(self):
        import json
        import os

        with open(os.path.join(self.out, f"rank-{self.global_rank}.json"), "w") as f:
            json.dump(self.seen, f)


def _ranks_seen(out):
    import json

    return [json.loads(p.read_text()) for p in sorted(out.glob("rank-*.json"))]


def _fit(tmp_path, out, ranks, datamodule, ckpt_path=None, **kw):
    """A fit on ``ranks`` CPU processes (``ddp_spawn`` over gloo from two on); what each rank saw."""
    out.mkdir()
    ddp = dict(strategy="ddp_spawn", devices=ranks) if ranks > 1 else dict(devices=1)
    pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
               default_root_dir=tmp_path, num_sanity_val_steps=0, **ddp, **kw).fit(
        RankRecorder(out), datamodule=datamodule, ckpt_path=ckpt_path)
    return _ranks_seen(out)


@needs_lightning
@pytest.mark.parametrize("before, after", [(2, 2), (2, 1), (1, 2), (2, 3)])
def test_a_resume_on_any_number_of_ranks_trains_the_rest_of_the_epoch_and_validates_it(tmp_path, before, after):
    """Stopped mid-epoch on ``before`` ranks (gloo, ``ddp_spawn``), resumed from the checkpoint on ``after``: the
    first run's batches and the resumed epoch's together hold every sample of the epoch; the resumed epoch ends
    with its validation, which sees all 45 validation images; the next epoch is whole and validated too."""
    from gpufeed.synth import create_synthetic_dataset

    train = create_synthetic_dataset(tmp_path / "train", n=96, num_classes=4, seed=2, workers=1)
    val = create_synthetic_dataset(tmp_path / "val", n=45, num_classes=4, seed=3, workers=1)
    kw = dict(KW, batch_size=8)
    steps = 3  # batches per rank before the stop: 24 samples on one rank, 48 on two
    checkpoint = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=steps, save_top_k=-1)
    first = _fit(tmp_path, tmp_path / "first", before, _data_module(train, val, **kw), max_epochs=1, max_steps=steps,
                 callbacks=[checkpoint], limit_val_batches=0)
    done = [i for rank in first for _, b in rank["train"] for i in b]
    assert len(done) == len(set(done)) == steps * 8 * before
    (path,) = (tmp_path / "ckpt").glob("*.ckpt")

    again = _fit(tmp_path, tmp_path / "again", after, _data_module(train, val, **kw), max_epochs=2,
                 ckpt_path=str(path))
    assert len(again) == after
    rest = [i for rank in again for e, b in rank["train"] if e == 0 for i in b]
    # the rest exactly once, filled up to whole batches on every rank with its own first samples
    assert set(done) | set(rest) == set(range(96)) and not set(done) & set(rest)
    (batches,) = {len([b for e, b in rank["train"] if e == 0]) for rank in again}  # the ranks in step
    assert batches == -(-(96 - len(done)) // (8 * after))
    next_epoch = [i for rank in again for e, b in rank["train"] if e == 1 for i in b]
    assert set(next_epoch) == set(range(96)) and len(next_epoch) == 96 // (8 * after) * 8 * after
    for epoch in (0, 1):  # validated at the end of the resumed epoch and of the next: all 45 images
        seen = [i for rank in again for e, b in rank["val"] if e == epoch for i in b]
        assert set(seen) == set(range(45)), epoch


@needs_lightning
def test_validation_loaders_never_drop_their_last_batch(tmp_path, synth_root):
    """``ImageLoader(train=False)`` delivers every image; ``ImageDataModule`` keeps the training loader's
    ``drop_last`` from its validation loader."""
    from gpufeed.synth import create_synthetic_dataset

    val = create_synthetic_dataset(tmp_path / "val", n=45, num_classes=4, seed=3, workers=1)
    with ImageLoader(val, train=False, batch_size=24, image_size=16, num_workers=1, device="cpu") as loader:
        got = []
        for _ in loader:
            got += loader.batch_indices
        assert sorted(got) == list(range(45)) and len(loader) == 2
    dm = _data_module(synth_root, val, drop_last=True, **KW)
    dm.setup("fit")
    try:
        assert dm.train_loader.drop_last and not dm.val_loader.drop_last and len(dm.val_dataloader()) == 12
    finally:
        dm.teardown("fit")


@needs_lightning
def test_an_own_loader_resumed_on_other_ranks_warns_without_exact_resume(synth_root, tmp_path):
    """A loader of the user's own in ``LightningLoader``: resumed on another number of ranks with no
    ``ExactResume`` in the Trainer, it says once what to add; with it, nothing is said."""
    from gpufeed.lightning import ExactResume, LightningLoader

    saved = ImageLoader(synth_root, world_size=2, rank=0, **KW)
    it = iter(saved)
    next(it)
    state = saved.state_dict()
    it.close()
    saved.close()
    with ImageLoader(synth_root, **KW) as mine:
        wrapped = LightningLoader(mine)
        wrapped.load_state_dict(state)
        with pytest.warns(UserWarning, match="Add gpufeed.lightning.ExactResume"):
            next(iter(wrapped))
        again = LightningLoader(mine)
        again.load_state_dict(state)
        again.aligned = True  # as ExactResume leaves it
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("error")
            left = again.batches_left()
            assert len(list(again)) == left == 8  # 36 of 40 left on one rank, in batches of 4 (the last filled)
    assert issubclass(ExactResume, pl.Callback)
