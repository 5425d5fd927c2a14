"""Loader-only images/s from the same images stored three ways: an ImageFolder tree, local WebDataset tar
shards and Parquet files, side by side in one run.

    python3 benchmarks/formats.py DATA [--per-shard 1000] [--rows-per-group 1000] [--rounds 2] [--device cuda]
        [--read-only]

DATA is packed into tar shards (``<id>.jpg`` + ``<id>.cls``) and Parquet files (an ``image`` bytes column and
an ``label`` column, row groups of ``--rows-per-group``) in a temporary folder; then ``gpufeed bench``'s loader-only
loop (the ``gpufeed`` pipeline: decode where ImageLoader's "auto" puts it) runs on each format in turn, ROUNDS
times, and the table gives each format's images/s per round and its median against the folder's.

``--read-only``: the workers only read each sample and parse its header, their whole work on the GPU path
when the GPU decodes every image, through the loader's scheduler with each format's epoch order and
readahead (after a warm-up epoch); no GPU needed, and no decode hides what reading the format costs.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from gpufeed.augment.params import AugmentSpec
from gpufeed.bench.run import BenchConfig, machine_description, run_bench
from gpufeed.decode.base import SkipLog
from gpufeed.placement import GPU_BYTES_CAPACITY, ShareControl, default_num_workers, gpu_memory
from gpufeed.sampling import ShardedSampler
from gpufeed.schedule import Scheduler
from gpufeed.sources import create_source, folder_source
from gpufeed.synth import tar_shards
from gpufeed.workers import PipelineSpec, WorkerPool

GPU_PATH_SLOTS = 5  # the loader's ring on the GPU path (prefetch depth 2)


def write_formats(data: str, out: Path, per_shard: int, rows_per_group: int) -> dict[str, str]:
    """{format: path} of DATA's samples as tar shards and Parquet files under ``out``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    src = folder_source(data)
    (out / "tar").mkdir()
    for k, shard in enumerate(tar_shards(src, per_shard)):
        (out / "tar" / f"shard-{k:06d}.tar").write_bytes(shard)
    (out / "parquet").mkdir()
    per_file = rows_per_group * 4
    for f, start in enumerate(range(0, len(src), per_file)):
        ids = range(start, min(len(src), start + per_file))
        table = pa.table({"image": pa.array([src.read(i) for i in ids], pa.binary()),
                          "label": pa.array([src.label(i) for i in ids], pa.int64())})
        pq.write_table(table, out / "parquet" / f"train-{f:05d}.parquet", row_group_size=rows_per_group)
    return {"ImageFolder": data, "tar shards": str(out / "tar"), "Parquet": str(out / "parquet")}


def read_only_rate(path: str, workers: int, batch_size: int, epochs: int) -> float:
    """Images/s over ``epochs`` epochs (after a warm-up one) of the workers reading ``path``'s samples and
    parsing their headers as on the GPU path with the GPU taking every image (``--read-only``)."""
    source = create_source(path)
    sampler = ShardedSampler(len(source), groups=getattr(source, "groups", None), window=getattr(source, "window", 4),
                             units=getattr(source, "units", None), drop_last=True)
    memory = gpu_memory(batch_size=batch_size, image_size=224, itemsize=4, prefetch_depth=2, gpu_decoders=1)
    spec = PipelineSpec(source, AugmentSpec(), 10**8, gpu_bytes_capacity=GPU_BYTES_CAPACITY,
                        gpu_buffer_bytes=memory.buffer_bytes)
    start_pool = functools.partial(WorkerPool, spec, num_workers=workers, num_slots=GPU_PATH_SLOTS,
                                   batch_size=batch_size)
    scheduler = Scheduler(start_pool=start_pool, num_slots=GPU_PATH_SLOTS, batch_size=batch_size, drop_last=True,
                          share=ShareControl(0.0), skips=SkipLog(), path=source.path, cuda=False,
                          readahead=getattr(source, "readahead", None))
    try:
        count, start = 0, 0.0
        for epoch in range(epochs + 1):
            if epoch == 1:
                count, start = 0, time.perf_counter()
            sampler.set_epoch(epoch)
            for batch in scheduler.batches(sampler):
                count += len(batch.indices)
                batch.release()
                sampler.advance(batch.consumed)
        return count / (time.perf_counter() - start)
    finally:
        scheduler.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("data")
    p.add_argument("--per-shard", type=int, default=1000)
    p.add_argument("--rows-per-group", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--workers", type=int, default=0, help="0: the loader's default")
    p.add_argument("--read-only", action="store_true", help="the workers only read samples (GPU path, no decode)")
    args = p.parse_args()
    print(f"machine: {machine_description()}\ncommand: {' '.join(sys.argv)}")
    rates: dict[str, list[float]] = {}
    labels: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        paths = write_formats(args.data, Path(tmp), args.per_shard, args.rows_per_group)
        for _ in range(args.rounds):
            for name, path in paths.items():
                if args.read_only:
                    workers = args.workers or default_num_workers()
                    rates.setdefault(name, []).append(read_only_rate(path, workers, args.batch_size, args.epochs))
                    labels[name] = "workers read only (GPU path, no decode)"
                    continue
                cfg = BenchConfig(data=path, batch_size=args.batch_size, epochs=args.epochs, device=args.device,
                                  workers=args.workers or default_num_workers(), pipelines=("gpufeed",))
                (row,) = run_bench(cfg)["rows"]
                if row.get("error"):
                    print(f"{name}: {row['error']}", file=sys.stderr)
                    return 1
                rates.setdefault(name, []).append(row["images_per_s"])
                labels[name] = row["pipeline"]
    folder = statistics.median(rates["ImageFolder"])
    what = "workers reading only" if args.read_only else f"loader only, {args.device}"
    print(f"\n| format ({what}) | images/s per round | median | of ImageFolder | pipeline |")
    print("|---|---|---|---|---|")
    for name, r in rates.items():
        med = statistics.median(r)
        print(f"| {name} | {', '.join(f'{x:,.0f}' for x in r)} | {med:,.0f} | {100 * med / folder:.1f}% "
              f"| {labels[name]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
