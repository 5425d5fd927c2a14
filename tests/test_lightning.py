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
    """A Recorder that writes each rank's training batches (source indices) to ``out``/rank-R.json when
    training ends: under DDP each rank is a process of its own."""

    def __init__(self, out):
        super().__init__()
        self.out = str(out)

    def on_train_end(self):
        import json
        import os

        with open(os.path.join(self.out, f"rank-{self.global_rank}.json"), "w") as f:
            json.dump([b for _, b in self.seen["train"]], f)


def _ranks_seen(out):
    import json

    return {p.name: json.loads(p.read_text()) for p in sorted(out.glob("rank-*.json"))}


@needs_lightning
def test_ddp_ranks_share_the_epoch_and_a_resume_on_fewer_ranks_sees_the_rest(synth_root, tmp_path):
    """Two ranks over gloo (``ddp_spawn``), stopped after two steps: each took its own samples. Resumed from
    that checkpoint on two ranks, and on one, the rest of the epoch comes exactly once: the ranks' batches
    and the first run's together are the 40 samples."""
    first_out, again_out, alone_out = (tmp_path / n for n in ("first", "again", "alone"))
    for d in (first_out, again_out, alone_out):
        d.mkdir()
    ddp = dict(strategy="ddp_spawn", devices=2)
    checkpoint = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
               default_root_dir=tmp_path, max_epochs=1, max_steps=2, callbacks=[checkpoint], limit_val_batches=0,
               **ddp).fit(RankRecorder(first_out), datamodule=_data_module(synth_root, **KW))
    first = _ranks_seen(first_out)
    assert sorted(first) == ["rank-0.json", "rank-1.json"] and all(len(b) == 2 for b in first.values())
    done = [i for b in first.values() for batch in b for i in batch]
    assert len(done) == len(set(done)) == 16  # 2 ranks x 2 batches of 4, no sample twice
    (path,) = (tmp_path / "ckpt").glob("*.ckpt")

    pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
               default_root_dir=tmp_path, max_epochs=1, limit_val_batches=0, **ddp).fit(
        RankRecorder(again_out), datamodule=_data_module(synth_root, **KW), ckpt_path=path)
    again = _ranks_seen(again_out)
    rest = [i for b in again.values() for batch in b for i in batch]
    assert all(len(b) == 3 for b in again.values())  # 20 samples a rank, 2 batches of them done
    assert sorted(done + rest) == list(range(40))

    _trainer(tmp_path, max_epochs=1, limit_val_batches=0).fit(
        RankRecorder(alone_out), datamodule=_data_module(synth_root, **KW), ckpt_path=path)
    alone = [i for b in _ranks_seen(alone_out)["rank-0.json"] for i in b]
    assert sorted(done + alone) == list(range(40))  # the same rest, on one rank
