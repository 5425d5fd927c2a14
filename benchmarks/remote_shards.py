"""The same WebDataset shards read from local disk and from a local S3 server, side by side in one run,
and the time to the first batch from 1,000 shards on that server.

    python3 benchmarks/remote_shards.py [DATA] [--n 2000] [--per-shard 100] [--epochs 4] [--workers 2]
                                        [--batch-size 64] [--startup-shards 1000]

DATA: an ImageFolder tree (default: ``gpufeed synth``'s cached dataset of ``--n`` images). Its images are
packed into WebDataset shards (``<id>.jpg`` + ``<id>.cls``) of ``--per-shard`` samples in a temporary
folder and uploaded to moto's standalone S3 server, started here as its own process on a free port. Then
ImageLoader (CPU decode, train augmentation) reads the local shards and ``s3://`` in alternating epochs,
each loader keeping its workers; the table gives the median images/s of the epochs after the first. Then
the CPU cost of fetching the shards once through s3fs and through a presigned URL with the standard
library (the two routes of ``sources/fetch.py``).

Start-up: the images are packed again as ``--startup-shards`` shards (brace range
``shard-{000000..000999}.tar``), and the time from making the source to the first batch is measured for
counts declared (``samples_per_shard``), counts from the index cache a previous run wrote (brace range, and
folder URL listed once), and neither (every shard fetched and indexed first).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gpufeed import ImageLoader
from gpufeed.sources import folder_source, remote_tar_source
from gpufeed.sources.fetch import http_get
from gpufeed.sources.urls import filesystem
from gpufeed.synth import tar_shards


class MotoProcess:
    """``python -m moto.server`` on a free port, as its own process (it does not share this one's GIL)."""

    def __init__(self) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        endpoint = f"http://127.0.0.1:{self.port}"
        self.storage_options = {"key": "bench", "secret": "bench",
                                "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}}
        import boto3

        self.client = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="bench",
                                   aws_secret_access_key="bench", region_name="us-east-1")
        for _ in range(100):
            try:
                self.client.list_buckets()
                return
            except Exception:  # not listening yet
                time.sleep(0.1)
        raise RuntimeError("moto's S3 server did not start")

    def upload(self, bucket: str, prefix: str, shards: list[bytes]) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.client.create_bucket(Bucket=bucket)
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda s: self.client.put_object(Bucket=bucket, Key=f"{prefix}/shard-{s[0]:06d}.tar",
                                                           Body=s[1]), enumerate(shards)))

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait()


def side_by_side(local: str, moto: MotoProcess, args) -> dict[str, list[float]]:
    """images/s per epoch of each loader, the epochs alternating between them."""
    kw = dict(batch_size=args.batch_size, num_workers=args.workers, device="cpu", decode="cpu")
    loaders = {"local disk": ImageLoader(local, **kw),
               "S3 server": ImageLoader("s3://bench/shards/", storage_options=moto.storage_options, **kw)}
    rates: dict[str, list[float]] = {name: [] for name in loaders}
    for epoch in range(args.epochs):
        for name, loader in loaders.items():
            loader.set_epoch(epoch)
            n, t0 = 0, time.perf_counter()
            for images, _ in loader:
                n += images.shape[0]
            rates[name].append(n / (time.perf_counter() - t0))
    for loader in loaders.values():
        loader.close()
    return rates


def first_batch(url: str, moto: MotoProcess, args, **source_kw) -> float:
    """Seconds from making the source to holding the first batch."""
    t0 = time.perf_counter()
    source = remote_tar_source(url, storage_options=moto.storage_options, **source_kw)
    with ImageLoader(source, batch_size=args.batch_size, num_workers=args.workers, device="cpu", decode="cpu") as loader:
        next(iter(loader))
        return time.perf_counter() - t0


def fetch_cost(moto: MotoProcess, count: int, folder: str) -> dict[str, float]:
    """CPU seconds of this process to fetch the ``count`` shards of s3://bench/shards/ once, by each route."""
    fs = filesystem("s3://bench", moto.storage_options)
    urls = [f"s3://bench/shards/shard-{s:06d}.tar" for s in range(count)]
    routes = {"s3fs get_file (fsspec)": lambda u, p: fs.get_file(u, p),
              "presigned URL, standard library GET": lambda u, p: http_get(fs.sign(u, expiration=600), p)}
    cost = {}
    for name, get in routes.items():
        get(urls[0], os.path.join(folder, "warm"))
        t0 = time.process_time()
        for u in urls:
            get(u, os.path.join(folder, "x"))
            os.unlink(os.path.join(folder, "x"))
        cost[name] = time.process_time() - t0
    return cost


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("data", nargs="?")
    p.add_argument("--n", type=int, default=2000)
    p.add_argument("--per-shard", type=int, default=100)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--startup-shards", type=int, default=1000)
    args = p.parse_args()
    if args.data is None:
        from gpufeed.synth import create_synthetic_dataset

        args.data = create_synthetic_dataset(Path.home() / ".cache" / "gpufeed" / f"synth-{args.n}-seed0", n=args.n)
    src = folder_source(args.data)
    moto = MotoProcess()
    saved = os.environ.get("GPUFEED_CACHE_DIR")
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["GPUFEED_CACHE_DIR"] = os.path.join(tmp, "cache")  # the index cache starts empty
        shards = tar_shards(src, args.per_shard)
        local = Path(tmp, "shards")
        local.mkdir()
        for s, data in enumerate(shards):
            (local / f"shard-{s:06d}.tar").write_bytes(data)
        moto.upload("bench", "shards", shards)
        try:
            rates = side_by_side(str(local), moto, args)
            costs = fetch_cost(moto, len(shards), tmp)
            per = -(-len(src) // args.startup_shards)
            small = tar_shards(src, per, min(len(src), per * args.startup_shards))
            moto.upload("startup", "s", small)
            url = f"s3://startup/s/shard-{{000000..{len(small) - 1:06d}}}.tar"
            counts = [per] * (len(small) - 1) + [min(len(src), per * len(small)) - per * (len(small) - 1)]
            declared = first_batch(url, moto, args, samples_per_shard=counts)
            cold = first_batch(url, moto, args)  # indexes every shard, and writes the index cache
            cached = first_batch(url, moto, args)
            listed = first_batch("s3://startup/s/", moto, args)  # one listing, then the index cache
        finally:
            moto.stop()
            if saved is None:
                os.environ.pop("GPUFEED_CACHE_DIR")
            else:
                os.environ["GPUFEED_CACHE_DIR"] = saved
    mb = sum(map(len, shards)) / 1e6
    print(f"{len(src)} images, {len(shards)} shards of {args.per_shard} ({mb:.0f} MB), batch {args.batch_size}, "
          f"{args.workers} workers, CPU decode, {args.epochs} epochs each, alternating; median of epochs 2-{args.epochs}\n")
    print("| source | images/s per epoch | median images/s (epochs 2+) | of local disk |")
    print("|---|---|---|---|")
    base = statistics.median(rates["local disk"][1:])
    for name, r in rates.items():
        med = statistics.median(r[1:])
        print(f"| {name} | {', '.join(f'{x:,.0f}' for x in r)} | {med:,.0f} | {med / base:.0%} |")
    print(f"\nCPU seconds of the fetching process for the {len(shards)} shards once ({mb:.0f} MB), by route:\n")
    print("| route | CPU s |")
    print("|---|---|")
    for name, c in costs.items():
        print(f"| {name} | {c:.2f} |")
    print(f"\nFirst batch from {len(small)} shards of {per} on the S3 server (source made, workers started, "
          f"first batch in hand):\n")
    print("| sample counts | seconds to the first batch |")
    print("|---|---|")
    print(f"| declared (samples_per_shard) | {declared:.2f} |")
    print(f"| from the index cache of an earlier run | {cached:.2f} |")
    print(f"| folder URL: one listing, then the index cache | {listed:.2f} |")
    print(f"| neither: every shard fetched and indexed first | {cold:.2f} |")


if __name__ == "__main__":
    main()
