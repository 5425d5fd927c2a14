"""The `gpufeed` command: synth, bench, shards, info."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _cmd_synth(args: argparse.Namespace) -> int:
    from .synth import _classes, create_synthetic_dataset

    root = create_synthetic_dataset(args.dir, n=args.n, num_classes=args.classes, seed=args.seed)
    print(f"{args.n} JPEGs in {_classes(args.n, args.classes)} under {root}")
    return 0


def _start_ranks(cuda: bool) -> tuple[int, int, str | None]:
    """Under torchrun: join the process group (NCCL on CUDA, gloo otherwise), one GPU per local rank.
    (rank, local ranks on this node, this rank's device or None)."""
    import torch
    import torch.distributed as dist

    from .sampling import launcher_env

    launched = launcher_env()
    if launched is None or launched[1] < 2 or dist.is_initialized():
        return 0, 1, None
    local = launched[2]
    if cuda:
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    else:
        dist.init_process_group("gloo")
    return dist.get_rank(), launched[3], f"cuda:{local}" if cuda else "cpu"


def _cmd_bench(args: argparse.Namespace) -> int:
    import os

    from .bench.data import check_data

    storage_options = _storage_options(args.storage_options)
    if args.data and "://" in args.data and os.environ.get("RANK", "0") == "0":  # torchrun's rank 0, or no torchrun
        print(f"gpufeed bench: checking --data {_without_secrets(args.data, storage_options)} (listing it)",
              file=sys.stderr, flush=True)
    # before torch is imported: a wrong --data fails in a fraction of a second
    data = check_data(args.data, storage_options) if args.data else None
    import torch

    from .bench.run import SyntheticDataError

    try:
        return _bench(args, storage_options, data)
    except SyntheticDataError as e:  # said in one line: the process that made it printed its own error
        print(f"gpufeed bench: error: {e}", file=sys.stderr)
        return 2
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _bench(args: argparse.Namespace, storage_options: dict | None, data) -> int:
    """The bench after ``--data`` (``data``: its ``DataSummary``, None for the synthetic data) was checked."""
    import torch

    from .bench.chart import write_chart
    from .bench.progress import Progress
    from .bench.report import format_result, write_json
    from .bench.run import BenchConfig, plan, run_bench, synthetic_root
    from .placement import default_num_workers

    cuda = torch.cuda.is_available() and args.device != "cpu"
    rank, local_ranks, rank_device = _start_ranks(cuda)
    device = rank_device or args.device or ("cuda" if cuda else "cpu")
    model = args.model if args.model != "none" else None
    if args.model is None:
        model = "resnet50" if device.startswith("cuda") else None
    # the baseline (torchvision's ImageFolder) reads only local folders: by default URLs, shards and
    # Parquet files are measured with gpufeed alone
    pipelines = args.pipelines or ("baseline,gpufeed" if args.data is None or Path(args.data).is_dir() and not
                                   _holds_only(Path(args.data), (".tar", ".parquet")) else "gpufeed")
    cfg = BenchConfig(
        data=args.data, n=args.n or (10_000 if cuda else 2_000), batch_size=args.batch_size or (256 if cuda else 64),
        workers=args.workers or default_num_workers(local_ranks), epochs=args.epochs, model=model, device=device,
        pipelines=tuple(pipelines.split(",")), storage_options=storage_options, recipe=args.recipe,
        compile=args.compile,
    )
    _check_batches(cfg, data)
    progress = Progress(quiet=rank != 0)  # rank 0 speaks for all
    described = (f"{_without_secrets(args.data, storage_options)}: {data.describe()}" if data is not None else
                 f"{cfg.n:,} synthetic ImageNet-like JPEGs (about 100 KB each) under {synthetic_root(cfg)}: made "
                 "once, then reused from there")
    for line in plan(cfg, described):
        progress.say(line)
    result = _without_secrets(run_bench(cfg, progress), storage_options)
    failed = [r for r in result["rows"] if r.get("error")]
    if rank != 0:  # rank 0 reports for all
        return 1 if failed else 0
    if args.json:
        write_json(result, args.json)
    if args.chart:
        if any(r.get("images_per_s") for r in result["rows"]):
            write_chart(result, args.chart)
        else:
            progress.say(f"no chart written to {args.chart}: no row was measured")
    print(format_result(result, args.format), flush=True)
    for r in failed:
        print(f"\n{r['name']} failed:\n{r['error']}", file=sys.stderr)
    return 1 if failed else 0


def _storage_options(text: str | None) -> dict | None:
    """``--storage-options`` as a dict; errors say what is wrong with it without repeating it (it may hold
    credentials)."""
    if not text:
        return None
    try:
        options = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--storage-options must be a JSON object; it is not JSON ({e.msg} at line {e.lineno}, "
                         f"column {e.colno})") from None
    if not isinstance(options, dict):
        raise ValueError(f"--storage-options must be a JSON object, got a JSON {type(options).__name__}")
    return options


def _secrets(options: object, key: str = "") -> dict[str, str]:
    """The text values in storage options (credentials among them, at any depth) -> the key that holds each,
    as ``client_kwargs.endpoint_url``; values shorter than 8 characters are no credential (and would match
    common words)."""
    found: dict[str, str] = {}
    items = options.items() if isinstance(options, dict) else enumerate(options) if isinstance(options, list) else ()
    for k, v in items:
        name = f"{key}.{k}" if key else str(k)
        if isinstance(v, str) and len(v) >= 8:
            found[v] = name
            found[json.dumps(v)[1:-1]] = name  # as it reads inside the JSON of the command line
        else:
            found.update(_secrets(v, name))
    return found


def _without_secrets(value: object, options: dict | None) -> object:
    """``value`` (the bench's result: text, lists, dicts) with each storage option's value replaced by the
    name of its key, and URLs redacted; the options in its config keep their keys only."""
    from .sources.urls import scrub

    secrets = _secrets(options or {})

    def clean(v: object, key: str | None = None) -> object:
        if key == "storage_options" and isinstance(v, dict):
            return {k: "<redacted>" for k in v}
        if isinstance(v, str):
            for secret in sorted(secrets, key=len, reverse=True):
                v = v.replace(secret, f"<storage_options {secrets[secret]}>")
            return scrub(v)
        if isinstance(v, dict):
            return {k: clean(x, k) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [clean(x) for x in v]
        return v

    return clean(value)


def _holds_only(folder: Path, suffixes: tuple[str, ...]) -> bool:
    from .sources import folder_entries

    entries = folder_entries(folder)
    return bool(entries) and all(e.suffix in suffixes for e in entries)


def _cmd_shards(args: argparse.Namespace) -> int:
    from .shards import ShardOptions, ShardSize, write_shards

    shuffle = args.shuffle
    if shuffle not in ("auto", "none"):
        try:
            shuffle = int(shuffle)
        except ValueError:
            raise ValueError(f"--shuffle must be a seed (an integer), 'none' or 'auto', got {args.shuffle!r}") from None
    if args.verify:
        return _verify_shards(args)
    if args.dest is None:
        raise ValueError("give SRC and DEST (or --verify DEST)")
    options = ShardOptions(format=args.format, max_side=args.max_side, quality=args.quality,
                           shard_size=ShardSize.parse(args.shard_size), shuffle=None if shuffle == "none" else shuffle,
                           workers=args.workers, on_error=args.on_error, engine=args.engine,
                           max_bytes=args.max_bytes)
    bar = _ImageBar()
    try:
        manifest = write_shards(args.src, args.dest, options, storage_options=_storage_options(args.storage_options),
                                progress=bar)
    finally:
        bar.close()
    broken = len(manifest["broken"])
    print(f"{manifest['samples']} samples ({manifest['resized']} resized) in {len(manifest['shards'])} "
          f"{manifest['format']} shards under {args.dest}; {broken} input(s) left out"
          + (" (listed in manifest.json)" if broken else ""))
    return 0


def _verify_shards(args: argparse.Namespace) -> int:
    from .shards import verify_shards

    if args.dest is not None:
        raise ValueError(f"--verify takes one folder, the destination to check; got {args.src!r} and {args.dest!r}")
    problems = verify_shards(args.src, storage_options=_storage_options(args.storage_options))
    for line in problems:
        print(f"gpufeed shards: {args.src}: {line}", file=sys.stderr)
    if problems:
        print(f"gpufeed shards: {len(problems)} shard(s) differ from the manifest; run the conversion's command "
              "again to make them anew", file=sys.stderr)
        return 2
    print(f"{args.src}: every shard as its manifest lists it (size and sha256)")
    return 0


class _ImageBar:
    """Inputs done of all on stderr (``progress.Progress``): tqdm's bar with images/s and the ETA on a
    terminal, else a plain line at each tenth of the inputs and at least every few seconds while they move."""

    def __init__(self) -> None:
        self._progress = None

    def __call__(self, done: int, total: int) -> None:
        from .progress import Progress

        if self._progress is not None and self._progress.total != max(total, 1):
            self._progress.close()
            self._progress = None
        if self._progress is None:
            self._progress = Progress("gpufeed shards", max(total, 1))
        self._progress.update(done)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.close()


def _cmd_info(args: argparse.Namespace) -> int:
    from .info import collect_info, format_info

    print(format_info(collect_info(say=lambda line: print(f"gpufeed info: {line} ...", file=sys.stderr, flush=True))))
    return 0


def _check_batches(cfg, data) -> None:
    """A ValueError, before anything runs, where a rank's share of ``--data`` holds no whole batch (every
    pipeline drops the ragged tail, so each epoch would yield nothing)."""
    from .bench.ranks import ranks

    world = ranks()[1]
    if data is None or data.images // world >= cfg.batch_size:
        return
    each = f"the {data.images // world:,} images each of {world} ranks reads" if world > 1 else \
        f"its {data.images:,} images"
    raise ValueError(f"--batch-size {cfg.batch_size} is more than {each} of --data {cfg.data}: an epoch would hold "
                     f"no batch; give --batch-size {max(1, data.images // world)} or less, or more images")


def _bench_epilog() -> str:
    from .bench.report import columns_help

    return columns_help() + """

While it runs, the bench says what it does on standard error (the plan first, then each step); the
table, CSV or JSON go to standard output. Each pipeline runs in a fresh process. Under torchrun
(torchrun --nproc_per_node=N -m gpufeed bench ...) every rank trains with DDP, pipelines run one
after another in each rank's process, and images/s are summed over the ranks.
"""


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    p = argparse.ArgumentParser(prog="gpufeed", description="Keep the training GPU busy.")
    p.add_argument("--version", action="version", version=f"gpufeed {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("synth", help="write a synthetic ImageNet-like JPEG folder",
                       description="Write N seeded, ImageNet-like JPEGs (about 470 x 390 px and 100 KB on average, "
                                   "baseline 4:2:0, quality 80-96) in an ImageFolder layout under DIR. The same "
                                   "arguments give the same files; files already there are kept.",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    s.add_argument("dir", help="the folder to write (class folders class_000, class_001, ... inside)")
    s.add_argument("--n", type=int, default=10_000, help="number of images")
    s.add_argument("--classes", type=int, default=100, help="number of classes (class folders)")
    s.add_argument("--seed", type=int, default=0, help="random seed: the same seed gives the same files")
    s.set_defaults(fn=_cmd_synth)

    from .bench.report import FORMATS  # light: no torch

    b = sub.add_parser("bench", help="the usual DataLoader against gpufeed, in one run and one table",
                       description="Time the usual torchvision DataLoader and gpufeed on the same data, loader only "
                                   "or training a model,\nand print one table.",
                       epilog=_bench_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    b.add_argument("--data", help="an ImageFolder-layout folder, tar shards, Parquet files, or a URL of shards or "
                                  "Parquet files (s3://, gs://, az://, https://...{000..099}.tar); default: a cached "
                                  "synthetic dataset under ~/.cache/gpufeed")
    b.add_argument("--storage-options", help="JSON object passed to fsspec for --data URLs, e.g. "
                                             "'{\"client_kwargs\": {\"endpoint_url\": \"http://host:9000\"}}'")
    b.add_argument("--n", type=int, help="synthetic images when --data is not given (default: 10,000 with a GPU, "
                                         "else 2,000)")
    b.add_argument("--batch-size", type=int, help="default: 256 with a GPU, else 64")
    b.add_argument("--workers", type=int, help="worker processes for every pipeline, per rank (default: the usable "
                                              "cores, shared among the node's ranks)")
    b.add_argument("--epochs", type=int, default=4, help="timed epochs per pipeline, the first a warm-up; one more "
                                                         "reads host memory (default: 4)")
    b.add_argument("--model", help="torchvision model to train per batch (resnet50, resnet18, ...), or 'none' for "
                                   "the loader alone (default: resnet50 on a GPU, none on a CPU)")
    b.add_argument("--device", help="'cuda', 'cuda:N' or 'cpu' (default: cuda when available)")
    b.add_argument("--pipelines",
                   help="comma-separated (default: baseline,gpufeed; gpufeed alone for data the baseline cannot "
                        "read: URLs, shards, Parquet), from: baseline (torchvision ImageFolder + DataLoader), "
                        "baseline+prefetch (the same through gpufeed.prefetch), gpufeed (decode where 'auto' puts "
                        "it), gpufeed-cpu, gpufeed-gpu (GPU decode + the CPU share cpu_share='auto' settles on), "
                        "gpufeed-gpu-only (GPU decoders alone)")
    b.add_argument("--recipe", help="a training recipe timed both ways: standard, trivialaugment (+ RandomErasing "
                   "0.1), trivialaugment-mix (+ MixUp/CutMix), resize-randomcrop (Resize + RandomCrop + flip), or a "
                   ".py file defining `transform` and optionally `batch_transform` (default: standard)")
    b.add_argument("--compile", action="store_true", help="train the model through torch.compile (its own rate "
                   "too), to see what share of a compiled model's rate the loader keeps")
    b.add_argument("--format", choices=FORMATS, default="markdown",
                   help="what goes to standard output: markdown (a table that fits 100 columns), csv (every "
                        "figure, one row per pipeline) or json (everything, epoch by epoch) (default: markdown)")
    b.add_argument("--json", help="write all numbers, epoch by epoch, to this JSON file")
    b.add_argument("--chart", help="write a PNG bar chart to this file")
    b.set_defaults(fn=_cmd_bench)

    from .shards.options import DEFAULT_QUALITY, ENGINES, FORMATS, ON_ERROR, ShardOptions  # light: no torch

    h = sub.add_parser("shards", help="write WebDataset tar or Parquet shards from a folder, file list, shards or URL",
                       description="Write SRC's samples as shards in DEST, with their counts, options, checksums and "
                                   "the inputs left out in DEST/manifest.json (ImageLoader and gpufeed bench read DEST "
                                   "as it is). Images whose longer side is over --max-side are resized to it with "
                                   "Pillow's Lanczos filter (aspect ratio kept) and re-encoded as JPEG at --quality; "
                                   "the others are copied byte for byte. The same inputs and options give the same "
                                   "bytes, with either engine; a conversion stopped part-way resumes when run again.")
    h.add_argument("src", help="an ImageFolder tree, a 'path,label' file list, tar shards or Parquet files, or a URL "
                               "of shards or Parquet files")
    h.add_argument("dest", nargs="?", help="a folder or folder URL (s3://, gs://, az://...): empty, or holding "
                                           "this same conversion to resume")
    h.add_argument("--verify", action="store_true",
                   help="gpufeed shards --verify DEST: check every shard of the finished conversion in DEST against "
                        "its manifest (size and sha256); exit status 2 naming each that differs")
    h.add_argument("--format", choices=FORMATS, default=ShardOptions.format,
                   help="tar: WebDataset <key>.jpg + <key>.cls; parquet: an image {bytes, path} struct and a label "
                        "(default tar)")
    h.add_argument("--max-side", type=int, help="resize images whose longer side is over this many pixels to it "
                                                 "(Lanczos; default: copy every image as it is)")
    h.add_argument("--quality", type=int, default=DEFAULT_QUALITY,
                   help=f"JPEG quality of the resized images (default {DEFAULT_QUALITY})")
    h.add_argument("--shard-size", default="256MB", help="inputs per shard (1000) or about this many bytes "
                   "(256MB, 1GiB; set from a probe of 256 inputs) (default 256MB)")
    h.add_argument("--shuffle", default="auto", help="seed of the sample order across shards, or 'none' for the "
                   "source's order (default: seed 0 for folders, file lists and local tar shards; the source's "
                   "order for remote shards and Parquet, which a shuffle would fetch many times over)")
    h.add_argument("--workers", type=int, help="processes (local engine; default: the cores this process may run on) or actors "
                                              "(ray; default: the cluster's CPUs)")
    h.add_argument("--on-error", choices=ON_ERROR, default=ShardOptions.on_error,
                   help="an input that cannot be read or decoded: skip it (listed in the manifest) or stop "
                        "(default skip)")
    h.add_argument("--max-bytes", type=int, default=ShardOptions.max_bytes,
                   help="an input file over this many bytes is broken, refused unread, as the loader's max_bytes "
                        f"(default {ShardOptions.max_bytes})")
    h.add_argument("--engine", choices=ENGINES, default=ShardOptions.engine,
                   help="local: processes on this machine; ray: a Ray Data job on the cluster ray.init() finds "
                        "(RAY_ADDRESS) or a local one (pip install 'gpufeed[ray]') (default local)")
    h.add_argument("--storage-options", help="JSON object passed to fsspec for SRC and DEST URLs")
    h.set_defaults(fn=_cmd_shards)

    i = sub.add_parser("info", help="versions, hardware, and which decode backends work here")
    i.set_defaults(fn=_cmd_info)
    return p


def _unknown_options(parser: argparse.ArgumentParser, command: str, unknown: list[str]) -> None:
    """Exit (status 2) naming the arguments ``command`` does not take, with its usage, and for each that looks
    like a misspelt option the option it is closest to."""
    import difflib

    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    options = [o for a in sub._actions for o in a.option_strings if o.startswith("--")]
    meant = [close[0] for u in unknown if u.startswith("-")
             for close in [difflib.get_close_matches(u.split("=", 1)[0], options, n=1, cutoff=0.75)] if close]
    sub.error(f"unrecognized arguments: {' '.join(unknown)}"
              + (f"; did you mean {' and '.join(meant)}?" if meant else ""))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    if not (sys.argv[1:] if argv is None else argv):  # a first try: what the commands are, not a missing argument
        parser.print_help(sys.stderr)
        return 2
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # said by the command's own parser, with its usage and the option meant where one is close
        _unknown_options(parser, args.command, unknown)
    try:
        try:
            return args.fn(args)
        except RuntimeError as e:  # a torchvision of another build fails its import so
            if "torchvision::" not in str(e):
                raise
            from . import _mismatch

            raise ImportError(_mismatch(e)) from None
    except KeyboardInterrupt:  # Ctrl-C: one line, and the shell's status for it, not a traceback
        print(f"gpufeed {args.command}: interrupted", file=sys.stderr)
        return 130
    except (ValueError, OSError, ImportError) as e:  # each names its file or URL and the way out: one line
        options = None
        try:  # the message names storage options by their keys, never their values
            options = _storage_options(getattr(args, "storage_options", None))
        except ValueError:
            pass
        print(f"gpufeed {args.command}: error: {_without_secrets(str(e), options)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
