"""gpufeed: keep the training GPU busy.

Public names are imported lazily, so that worker processes, which import
``gpufeed.workers`` only, start without loading PyTorch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "ImageLoader": "gpufeed.loader",
    "Prefetcher": "gpufeed.transfer",
    "prefetch": "gpufeed.transfer",
    "Normalize": "gpufeed.augment.normalize",
    "IMAGENET_MEAN": "gpufeed.augment.normalize",
    "IMAGENET_STD": "gpufeed.augment.normalize",
    "AugmentSpec": "gpufeed.augment.params",
    "ShardedSampler": "gpufeed.sampling",
    "Source": "gpufeed.sources",
    "FileSource": "gpufeed.sources",
    "folder_source": "gpufeed.sources",
    "filelist_source": "gpufeed.sources",
    "tar_source": "gpufeed.sources",
    "TarSource": "gpufeed.sources",
    "DecodeError": "gpufeed.decode",
    "WorkerError": "gpufeed.workers",
    "create_synthetic_dataset": "gpufeed.synth",
}

__all__ = sorted(_EXPORTS) + ["__version__"]

if TYPE_CHECKING:
    from .augment.normalize import IMAGENET_MEAN, IMAGENET_STD, Normalize
    from .augment.params import AugmentSpec
    from .decode import DecodeError
    from .loader import ImageLoader
    from .transfer import Prefetcher, prefetch
    from .sampling import ShardedSampler
    from .sources import FileSource, Source, TarSource, filelist_source, folder_source, tar_source
    from .synth import create_synthetic_dataset
    from .workers import WorkerError


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'gpufeed' has no attribute {name!r}")
    try:
        value = getattr(importlib.import_module(module), name)
    except RuntimeError as e:
        if "torchvision::" not in str(e):
            raise
        raise ImportError(_mismatch(e)) from e
    globals()[name] = value
    return value


def _mismatch(error: RuntimeError) -> str:
    """What a torchvision built for another torch raises at import, said with the way out."""
    import torch

    return (f"torchvision does not load with this torch {torch.__version__} ({error}): the two come from different "
            "builds, e.g. one from PyTorch's CPU index and the other from PyPI. Install both from one index: pip "
            "install --force-reinstall torch torchvision (add --index-url https://download.pytorch.org/whl/cpu for "
            "the CPU-only build)")


def __dir__() -> list[str]:
    return __all__
