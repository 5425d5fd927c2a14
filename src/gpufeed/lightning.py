"""Lightning: gpufeed's loaders in a ``LightningDataModule``, their position in Lightning's checkpoints.

    dm = ImageDataModule(train="/data/train", val="/data/val", batch_size=256, image_size=224)
    trainer.fit(model, datamodule=dm)                        # a resume: ..., ckpt_path="last.ckpt"

What Lightning 2.x (``lightning.pytorch`` or ``pytorch_lightning``) does with a loader that is not a torch
``DataLoader``, read from its fit loop and ``CombinedLoader``, and what this module relies on:

- A train loader with ``state_dict``/``load_state_dict`` (its ``_Stateful`` protocol) has its state saved in
  every checkpoint (``loops.fit_loop.state_dict.combined_loader``), and loaded before the first batch of a
  resumed fit: a mid-epoch checkpoint resumes with exactly the rest of the epoch.
- Every epoch it calls ``set_epoch(epoch)`` on the loader's ``sampler`` attribute (``_set_sampler_epoch``):
  ``ImageLoader.sampler``, which gives a fresh epoch its order and keeps a resumed epoch's position.
- ``use_distributed_sampler`` re-wraps torch ``DataLoader`` s only; an ``ImageLoader`` shards itself, with
  rank and world size from ``torch.distributed``, initialised by the time ``setup`` makes the loaders.
- Those states are not loaded when ``trainer.estimated_stepping_batches`` was read before the fit loop
  started (``configure_optimizers`` sizing a OneCycleLR: Lightning-AI/pytorch-lightning#20550), so
  ``ImageDataModule`` also keeps the training loader's state as its own (``state_dict``), which Lightning
  restores before ``configure_optimizers`` runs.
- It takes ``len()`` batches an epoch and never asks for one more, so a loader's iteration would not end by
  itself: ``LightningLoader`` ends it as the last batch is handed over (the next epoch's first batches then
  start early, as in a plain loop) and stops one left unfinished (``max_steps``, ``limit_train_batches``,
  the sanity check's validation batches) before the next one starts.
- It reads ``len()`` once a fit and ends every epoch, and runs the epoch-end validation, at that many
  batches, counted from the batches it restored from the checkpoint (counted at the world size it was saved
  on). A resume on another number of ranks leaves a different number of batches in the epoch, so
  ``ExactResume`` (which ``ImageDataModule`` adds to the Trainer itself) sets Lightning's count of the
  resumed epoch's batches to ``len()`` less the batches the loader has left, at ``on_train_start``: Lightning
  then takes exactly those, ends the epoch at its last and validates, and every later epoch is whole.
"""

from __future__ import annotations

import warnings
from typing import Any, Iterator

from .loader import ImageLoader

try:
    import lightning.pytorch as pl
except ImportError:
    try:
        import pytorch_lightning as pl
    except ImportError:
        raise ImportError("gpufeed.lightning needs Lightning 2.x: pip install lightning") from None

__all__ = ["ExactResume", "ImageDataModule", "LightningLoader"]

# what only a training loader takes: the validation loader leaves them out (``ImageDataModule``)
_TRAINING_ONLY = ("transform", "batch_transform", "train", "drop_last")


class LightningLoader:
    """An ``ImageLoader`` as Lightning iterates it: each iteration is the rest of the loader's current epoch;
    ``len``, ``sampler``, ``state_dict`` and ``load_state_dict`` are the loader's. ``restart``: each
    iteration starts an epoch from its beginning, even after one was broken off (validation)."""

    batch_sampler = None  # read beside ``sampler`` by Lightning, as a DataLoader has both

    def __init__(self, loader: ImageLoader, *, restart: bool = False) -> None:
        self.loader, self.restart = loader, restart
        self._running: Iterator | None = None
        self.aligned = False  # an ExactResume looked at this loader as the fit started
        self._warned = False

    def __len__(self) -> int:
        return len(self.loader)

    def batches_left(self) -> int:
        """Batches left in the loader's current epoch (all of them at its start)."""
        left, ragged = divmod(len(self.loader.sampler.remaining()), self.loader.batch_size)
        return left + bool(ragged and not self.loader.drop_last)

    @property
    def sampler(self):
        return self.loader.sampler

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)

    def __iter__(self) -> Iterator:
        # a generator: Lightning calls iter() to check the loader is iterable, and later after set_epoch
        if self._running is not None:  # an iteration left unfinished: its work in flight stops now
            self._running.close()
        loader, sampler = self.loader, self.loader.sampler
        if self.restart and not sampler.at_epoch_start:
            loader.set_epoch(sampler.epoch + 1)  # validation's order and crops do not depend on the epoch
        left = self.batches_left()
        if not self.restart and not self.aligned and sampler.begun is not None and not self._warned:
            self._warned = True
            warnings.warn(f"gpufeed: the training loader resumes an epoch begun on another number of ranks, with {left} "
                          f"of {len(self)} batches left; Lightning counts the batches it restored at the world size "
                          "they were saved on, and may "
                          "end the epoch early or late, without its end-of-epoch validation. Add "
                          "gpufeed.lightning.ExactResume() to the Trainer's callbacks (ImageDataModule adds it "
                          "itself)", stacklevel=2)
        self._running = it = iter(loader)
        for k, batch in enumerate(it, start=1):
            if k == left and next(it, None) is not None:  # the loader moves on to its next epoch now
                raise RuntimeError(f"the loader gave more than the {left} batches left in its epoch")
            yield batch
        self._running = None


class ExactResume(pl.Callback):
    """Makes Lightning take exactly the batches a resumed ``LightningLoader`` has left in its epoch (module
    docstring): at ``on_train_start`` its count of the epoch's batches becomes ``len()`` less those, so the
    epoch ends, and validates, at its last batch on any number of ranks. A fresh fit, an epoch started from its
    beginning, or an epoch cut by ``limit_train_batches`` are left as they are."""

    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        loaders = trainer.train_dataloader
        loaders = loaders.values() if isinstance(loaders, dict) else loaders if isinstance(loaders, (list, tuple)) \
            else [loaders]
        mine = [dl for dl in loaders if isinstance(dl, LightningLoader)]
        for dl in mine:
            dl.aligned = True
        if len(mine) != 1 or trainer.num_training_batches != len(mine[0]):
            return  # several loaders, or an epoch Lightning cuts short: its own count stands
        epoch_loop = trainer.fit_loop.epoch_loop
        current = epoch_loop.batch_progress.current
        # what Lightning will count as done once it resets the epoch's progress on restart
        counted = current.completed + int(bool(getattr(epoch_loop, "restarted_on_train_batch_end", False)))
        delta = max(0, len(mine[0]) - mine[0].batches_left()) - counted
        for name in ("ready", "started", "processed", "completed"):
            setattr(current, name, getattr(current, name) + delta)


class ImageDataModule(pl.LightningDataModule):
    """Training and validation ``ImageLoader`` s for ``Trainer.fit``: ``train`` and ``val`` are what
    ``ImageLoader`` takes as its source (either may be None); ``loader_kwargs`` go to both loaders, but
    ``transform``, ``batch_transform`` and ``train`` to the training loader only; ``val_kwargs`` add to or
    replace them for validation (e.g. ``{"image_size": 224}`` beside a training transform cropping 176).

    The loaders are made in ``setup`` (after Lightning initialised the process group, so each rank takes its
    shard) and closed in ``teardown``; ``train_loader`` and ``val_loader`` are them, e.g. for
    ``set_image_size`` in ``on_train_epoch_start`` or ``batch_indices`` in ``training_step``. The training
    loader's position is in every checkpoint, so ``fit(..., ckpt_path=...)`` resumes an epoch where it
    stopped, sample for sample, on any number of ranks (``setup`` adds ``ExactResume`` to the Trainer's
    callbacks). Validation sees its whole set: its loader never drops the last batch (``drop_last`` is the
    training loader's alone).
    """

    def __init__(self, train: Any = None, val: Any = None, *, val_kwargs: dict[str, Any] | None = None,
                 **loader_kwargs: Any) -> None:
        super().__init__()
        if train is None and val is None:
            raise ValueError("ImageDataModule needs a train or a val source (or both), got neither")
        self.sources = {"train": train, "val": val}
        self.loader_kwargs = loader_kwargs
        shared = {k: v for k, v in loader_kwargs.items() if k not in _TRAINING_ONLY}
        self.val_kwargs = {**shared, "train": False, **(val_kwargs or {})}
        self.train_loader: ImageLoader | None = None
        self.val_loader: ImageLoader | None = None
        self._wrapped: dict[str, LightningLoader] = {}

    def setup(self, stage: str) -> None:
        trainer = getattr(self, "trainer", None)
        if trainer is not None and not any(isinstance(c, ExactResume) for c in trainer.callbacks):
            trainer.callbacks.append(ExactResume())
        if stage == "fit" and self.sources["train"] is not None and self.train_loader is None:
            self.train_loader = ImageLoader(self.sources["train"], **self.loader_kwargs)
            self._wrapped["train"] = LightningLoader(self.train_loader)
        if stage in ("fit", "validate") and self.sources["val"] is not None and self.val_loader is None:
            self.val_loader = ImageLoader(self.sources["val"], **self.val_kwargs)
            self._wrapped["val"] = LightningLoader(self.val_loader, restart=True)

    def train_dataloader(self) -> LightningLoader:
        return self._loader("train")

    def val_dataloader(self) -> LightningLoader | list:
        return self._loader("val") if self.sources["val"] is not None else []

    def _loader(self, which: str) -> LightningLoader:
        if which not in self._wrapped:
            raise RuntimeError(f"ImageDataModule has no {which} loader: it is made in setup(), and only from a "
                               f"{which} source (given: {self.sources[which]!r})")
        return self._wrapped[which]

    def state_dict(self) -> dict[str, Any]:
        """The training loader's position (saved by Lightning under this class's name in checkpoints)."""
        return {"train": self.train_loader.state_dict()} if self.train_loader is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "train" in state and self.train_loader is not None:  # no training loader: validate() or test()
            self.train_loader.load_state_dict(state["train"])

    def teardown(self, stage: str) -> None:
        for loader in (self.train_loader, self.val_loader):
            if loader is not None:
                loader.close()
        self.train_loader = self.val_loader = None
        self._wrapped = {}
