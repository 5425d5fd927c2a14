"""CPU worker processes: ``pool`` (the main process's side), ``process`` (a worker from its start),
``chunks`` (what a worker does with a chunk of samples), ``records`` (what travels between them).

Names are imported lazily: a worker process imports this package before it may load numpy
(``process`` limits the native thread pools first).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {"WorkerPool": ".pool", "PipelineSpec": ".chunks", "WorkerError": ".records", "Failure": ".records"}
__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from .chunks import PipelineSpec
    from .pool import WorkerPool
    from .records import Failure, WorkerError


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'gpufeed.workers' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value
