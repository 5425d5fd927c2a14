"""The stretch of a recipe that runs per sample in the CPU worker processes, with torchvision's own ops.

An op that does not run on the device (``placement.ops``: ``v2.ElasticTransform``, a user's own callable, a
device op placed where the device does not run it) is run by the workers, on each sample as torchvision's
pipeline would hand it over: a PIL image where no ``ToImage``/``PILToTensor`` stands before it (an
``ImageFolder`` gives PIL images), else a ``tv_tensors.Image`` (3, H, W) uint8. The ops the device would run
but that stand between two such ops (or after one, among the crop and flip) run there too, as torchvision's
own, so the recipe keeps its order.

    after the crop:   decode + crop + resize (+ flip) as always ─► the stretch ─► the slot's (S, S, 3) uint8
    before the crop:  decode the whole image ─► the stretch, the crop included ─► the slot's (S, S, 3) uint8

Each sample's draws come from torch's, Python's and numpy's global generators, seeded per sample from the
loader's seed, the epoch and the index (``sample_seed``), so a batch is the same whichever worker made it,
and a resumed epoch repeats exactly. The ops travel to the workers pickled: one that cannot be pickled (a
lambda, a local function) is refused when the loader is made. This module imports torch only where it runs
the ops (in the main process it is there already; a worker imports it when it unpickles them).
"""

from __future__ import annotations

import io
import pickle
import random
import sys
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from .params import SampleRandom

_SALT = 0x5EED_0F_0E5  # apart from the crop's stream and every device op's


def op_name(op: Any) -> str:
    """What an op is called in messages and ``loader.stats``: a function's own name, else its class's."""
    name = getattr(op, "__name__", None)
    return name if isinstance(name, str) and callable(op) and not isinstance(op, type) else type(op).__name__


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """A 53-bit seed for sample ``index`` of ``epoch``: a pure function of the three, as the crop's draws are."""
    return int(SampleRandom(seed ^ _SALT, epoch, index).uniform() * (1 << 53))


@dataclass(frozen=True)
class WorkerOps:
    """``ops`` (a stretch of the recipe, in its order) run per sample in the workers. ``names``: each op's
    name; ``own``: the names of those that do not run on the device, ``placed`` among them those that have a
    device version but stand where the device does not run them; ``from_decode``: the stretch holds the crop,
    so the workers decode the whole image and run it from there; ``tensors``: the stretch's input is a
    ``tv_tensors.Image`` (a ``ToImage``/``PILToTensor`` stood before it), else a PIL image. Picklable."""

    ops: tuple[Any, ...]
    names: tuple[str, ...]
    own: tuple[str, ...]
    from_decode: bool
    tensors: bool
    placed: tuple[str, ...] = ()
    main_module: bool = field(default=False, compare=False)  # an op is defined in the training script itself

    @classmethod
    def create(cls, ops: Sequence[Any], *, own: Sequence[str], from_decode: bool, tensors: bool,
               placed: Sequence[str] = ()) -> "WorkerOps":
        """The stretch, each op checked to reach the workers (``_check_picklable``)."""
        main = [_check_picklable(op) for op in ops]
        return cls(tuple(ops), tuple(op_name(op) for op in ops), tuple(own), from_decode, tensors, tuple(placed),
                   any(main))

    @property
    def why_cpu(self) -> str:
        """Why every sample is decoded by the CPU workers (on a CUDA device too)."""
        return (f"{', '.join(self.own)}: not run on the device; the CPU workers decode every sample and run "
                f"{', '.join(self.names)} on it (torchvision's own ops)")

    def warning(self) -> str:
        among = [n for n in self.names if n not in self.own]
        also = f" ({', '.join(among)} too, to keep the recipe's order)" if among else ""
        where = "on the whole decoded image, before the crop" if self.from_decode else "after the crop"
        lacking = [n for n in self.own if n not in self.placed]
        why = [f"{', '.join(lacking)} {'has' if len(lacking) == 1 else 'have'} no device version"] if lacking else []
        if self.placed:
            one = len(self.placed) == 1
            why.append(f"{', '.join(self.placed)} {'stands' if one else 'stand'} where the device does not run "
                       f"{'it' if one else 'them'} (before the crop, before a flip it does not commute with, or "
                       f"a second of its kind)")
        they = "it runs" if len(self.own) == 1 else "they run"
        return (f"gpufeed: {'; '.join(why)}: {they} per sample in the CPU worker processes{also}, {where}, as "
                f"torchvision's own ops; correct, and slower than the device ops (loader.stats['ops_in_workers'] "
                f"lists them)")

    def check_size(self, image_size: int, made_for: int) -> None:
        """ValueError where the stretch holds the crop (its size fixed in it) and ``image_size`` is another."""
        if self.from_decode and image_size != made_for:
            raise ValueError(f"image_size={image_size}: the crop runs in the workers as the transform's own op "
                             f"(beside {', '.join(self.own)}), which makes {made_for} x {made_for} images; "
                             f"progressive resizing needs the crop first in the recipe")

    def apply(self, image: np.ndarray, out: np.ndarray, *, seed: int, epoch: int, index: int) -> None:
        """``image`` ((H, W, 3) uint8: the crop, or the whole image ``from_decode``) through the stretch, into
        ``out`` ((S, S, 3) uint8; it may be ``image`` itself). ValueError naming the stretch where its result is
        not an S x S RGB uint8 image."""
        import torch

        _one_thread(torch)
        value = sample_seed(seed, epoch, index)
        torch.manual_seed(value)
        random.seed(value)
        np.random.seed(value & 0xFFFF_FFFF)
        x = self._input(np.ascontiguousarray(image), torch)
        for op in self.ops:
            x = op(x)
        out[:] = self._pixels(x, out.shape, torch)

    def _input(self, image: np.ndarray, torch: Any) -> Any:
        if self.tensors:
            from torchvision import tv_tensors

            return tv_tensors.Image(torch.from_numpy(image.copy()).permute(2, 0, 1))
        from PIL import Image

        return Image.fromarray(image)

    def _pixels(self, x: Any, shape: tuple[int, ...], torch: Any) -> np.ndarray:
        """The stretch's result as (S, S, 3) uint8."""
        from PIL import Image

        got = None
        if isinstance(x, Image.Image):
            got = np.asarray(x) if x.mode == "RGB" else None
            what = f"a {x.mode} PIL image of {x.size[0]} x {x.size[1]}"
        elif isinstance(x, torch.Tensor):
            if x.dtype == torch.uint8 and x.ndim == 3 and x.shape[0] == 3:
                got = x.permute(1, 2, 0).numpy()
            what = f"a {tuple(x.shape)} {x.dtype} tensor"
        else:
            what = f"a {type(x).__name__}"
        if got is None or got.shape != tuple(shape):
            raise ValueError(f"the transform's {' -> '.join(self.names)} (run in the workers) gave {what}; gpufeed's "
                             f"batches take {shape[0]} x {shape[1]} RGB uint8 images (a PIL image, or (3, H, W) "
                             f"uint8): the ops that run in the workers must keep that, the cast to float after them")
        return got


def _one_thread(torch: Any) -> None:
    """torch's intra-op pool held to one thread in a worker (``workers.process``: one process per core)."""
    if torch.get_num_threads() != 1 and _in_worker():
        torch.set_num_threads(1)


def _in_worker() -> bool:
    import multiprocessing

    return multiprocessing.parent_process() is not None


class _Finder(pickle.Pickler):
    """Pickles into nothing, noting whether anything is found by reference in ``__main__``."""

    def __init__(self) -> None:
        super().__init__(io.BytesIO(), protocol=pickle.HIGHEST_PROTOCOL)
        self.main = False

    def persistent_id(self, obj: Any) -> None:
        if isinstance(obj, type) or callable(obj) and hasattr(obj, "__qualname__"):
            self.main = self.main or getattr(obj, "__module__", None) == "__main__"
        return None


def _check_picklable(op: Any) -> bool:
    """Whether ``op`` reaches the workers only with the training script imported there (it is defined in
    ``__main__``); ValueError, naming it and the way out, where it cannot reach them at all."""
    finder = _Finder()
    try:
        finder.dump(op)
    except Exception as e:  # PicklingError, AttributeError (a local object), TypeError (a lock, a generator)
        raise ValueError(f"transform: {op_name(op)} has no device version, so it runs in gpufeed's worker "
                         f"processes, which receive it pickled; it cannot be pickled ({type(e).__name__}: {e}): define "
                         f"it as a module-level function or class (not a lambda or a local function)") from None
    if finder.main and not getattr(sys.modules.get("__main__"), "__file__", None):
        raise ValueError(f"transform: {op_name(op)} has no device version, so it runs in gpufeed's worker processes, "
                         f"but it is defined in an interactive session (a notebook or REPL), which they cannot import: "
                         f"define it in a .py module and import it from there")
    return finder.main
