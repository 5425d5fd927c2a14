"""Shards from any source the loader reads: WebDataset tar or Parquet, images over a size resized once,
sample counts and options in a manifest the loader reads at start-up (``gpufeed shards``).

    source ─► plan (order, inputs per shard, fingerprint) ─► engine: local processes or a Ray Data job
           ─► Preparer per input (decode check, resize + re-encode or copy) ─► write_shard (temporary
              file, sha256, published whole, progress record) ─► manifest.json

Modules: ``options`` (what is asked), ``plan`` (what goes where), ``prepare`` (one input), ``writers``
(tar and Parquet bytes), ``shard`` (one shard), ``dest`` (local folder or URL), ``manifest`` (the
manifest, and what a destination holds to resume), ``local`` and ``ray_engine`` (the engines), ``run``
(``write_shards``). Importing this package imports neither Ray nor PyTorch.
"""

from .options import ShardOptions, ShardSize
from .prepare import RESAMPLE
from .run import verify_shards, write_shards
from .shard import BrokenInput, DestinationFull

__all__ = ["RESAMPLE", "BrokenInput", "DestinationFull", "ShardOptions", "ShardSize", "verify_shards", "write_shards"]
