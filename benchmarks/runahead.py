"""Where an end-to-end step's time goes when a fast model trains from the loader, and what bounding the
training thread's run-ahead changes.

    python3 benchmarks/runahead.py DATA [--model resnet18] [--variants "base|depth=4"] [--epochs 4]

A model trains from an ImageLoader (bf16, channels_last, SGD, as ``gpufeed bench``). For each variant the
images/s of the timed epochs (median) against the model's own rate on one GPU-resident batch, measured at
the start and the end, and, per batch, the wall time each thread spent where:

- training: waiting in ``next(loader)``, and in the step's own calls (which block once CUDA's launch queue
  is full);
- the loader's thread: waiting for the workers' next batch, laying out and starting a batch, finishing one
  (waiting for the decoders, the kernel);
- the decoder threads: in nvJPEG's calls. Per epoch: the training's wait for its first batch and for the others
(how many over 2 ms, the longest), the CPU share over the epoch's batches, the longest of each timed part,
the CUDA caching allocator's calls to the driver, and generation-2 garbage collections.

Variants (``--variants "base|depth=4|prio=-1"``): ``lag`` N: before step k the training thread waits (the
interpreter lock released) until step k-N's work has run on the device (0: unbounded, CUDA's own queue
limit); ``switch``: the interpreter's switch interval in ms (Python's default 5); ``depth``: prefetch_depth;
``share``: cpu_share; ``prio``: the priority of the loader's CUDA streams; ``blocking=1``: every CUDA event
made while the variant runs waits asleep (the loader's events that the host waits for already do, since
commit b17e72f; ``blocking=0`` leaves each event as the code makes it); ``loopcopies=1``: the CPU-decoded rows
copied to the device one call each; ``sidestream=1``: the training runs on a stream of its own rather than
the default (legacy) stream. Also, from CUDA events on the training's stream: how long it waited on the device for each
batch, and the device time of each step.
"""

from __future__ import annotations

import argparse
import collections
import gc
import statistics
import sys
import time

import torch

from gpufeed import ImageLoader
from gpufeed.bench.recipes import load_recipe
from gpufeed.bench.run import machine_description, make_train_step, model_rate
from gpufeed.decode.gpu_stage import GpuDecodeAugment
from gpufeed.augment.ops import SampleOps
from gpufeed.decode import gpu_stage
from gpufeed.schedule import Scheduler, Slots
from gpufeed.transfer import Prefetcher
from gpufeed.workers import WorkerPool

TIMES: dict[str, list[float]] = collections.defaultdict(list)
# what a stall can come from: the caching allocator going to the driver (which synchronises the device) and
# garbage collection of the oldest generation
ALLOCATOR = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams")
GC: list[float] = []  # ms of each generation-2 collection
GC_COUNTS = collections.Counter()  # collections by generation
_gc_start = [0.0]


def _gc_timer(phase: str, info: dict) -> None:
    if phase == "start":
        _gc_start[0] = time.perf_counter()
        return
    GC_COUNTS[info["generation"]] += 1
    if info["generation"] == 2:
        GC.append(1000 * (time.perf_counter() - _gc_start[0]))
STEP_CALLS = "training: the step's own calls"


def timed(name: str, fn, cpu: bool = False):
    """``fn`` timed under ``name`` (wall), and with ``cpu`` its thread's CPU time under ``name`` + " (CPU)"."""
    def wrapper(*a, **k):
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return fn(*a, **k)
        finally:
            TIMES[name].append(time.perf_counter() - t0)
            if cpu:
                TIMES[name + " (CPU)"].append(time.thread_time() - c0)
    return wrapper


def timed_iter(name: str, gen_fn):
    def wrapper(*a, **k):
        it = gen_fn(*a, **k)
        try:
            while True:
                t0 = time.perf_counter()
                try:
                    x = next(it)
                except StopIteration:
                    return
                TIMES[name].append(time.perf_counter() - t0)
                yield x
        finally:
            it.close()
    return wrapper


def instrument() -> None:
    Prefetcher._start = timed("loader: start a batch", Prefetcher._start, cpu=True)
    Prefetcher._finish = timed("loader: finish a batch", Prefetcher._finish, cpu=True)
    Scheduler.batches = timed_iter("loader: next batch from the scheduler", Scheduler.batches)
    WorkerPool.collect = timed("loader: scheduler: collect from the workers", WorkerPool.collect)
    WorkerPool.submit = timed("loader: scheduler: submit to the workers", WorkerPool.submit)
    Slots.reclaim = timed("loader: scheduler: wait for a free slot", Slots.reclaim)
    GpuDecodeAugment._await_decode = timed("loader: wait for decoders", GpuDecodeAugment._await_decode)
    SampleOps.__call__ = timed("loader: per-sample ops", SampleOps.__call__, cpu=True)
    SampleOps.from_pixels = timed("loader: per-sample ops", SampleOps.from_pixels, cpu=True)


def instrument_decoders(loader: ImageLoader) -> None:
    stage = loader._gpu_stage
    if stage is None:
        return
    for d in stage.decoders:
        d.decode = timed("decoders: nvJPEG calls", d.decode, cpu=True)


def variant(spec: str) -> dict:
    """"base", or comma-separated key=value: lag (steps queued at most), switch (ms), depth (prefetch_depth),
    share (cpu_share), prio (the loader's stream priority), blocking (1: CUDA events wait without spinning),
    loopcopies (1: the CPU-decoded rows copied one call each, not in one batched call), sidestream (1: the
    training on a stream of its own)."""
    out = {"lag": 0, "switch": 5.0, "depth": 2, "share": "auto", "prio": 0, "blocking": 0, "loopcopies": 0,
           "sidestream": 0}
    for kv in filter(None, spec.split(",")):
        if kv == "base":
            continue
        k, v = kv.split("=")
        out[k] = v if k == "share" and v == "auto" else type(out[k])(float(v)) if k != "share" else float(v)
    return out


class _Patched:
    """torch.cuda.Stream / Event made with the variant's priority and blocking flag while a variant runs."""

    def __init__(self, v: dict) -> None:
        self.v = v

    def __enter__(self):
        self.stream, self.event = torch.cuda.Stream, torch.cuda.Event
        prio, blocking = self.v["prio"], bool(self.v["blocking"])
        base_stream, base_event = self.stream, self.event
        if prio:
            torch.cuda.Stream = lambda device=None, priority=0, **k: base_stream(device, priority=prio, **k)
        self.copy_rooms = gpu_stage._Cuda.copy_rooms
        if self.v["loopcopies"]:
            gpu_stage._Cuda.copy_rooms = lambda *a: False
        if blocking:
            torch.cuda.Event = lambda enable_timing=False, blocking=False, interprocess=False: base_event(
                enable_timing=enable_timing, blocking=True, interprocess=interprocess)
        return self

    def __exit__(self, *exc):
        torch.cuda.Stream, torch.cuda.Event = self.stream, self.event
        gpu_stage._Cuda.copy_rooms = self.copy_rooms


def run(args, step, v: dict, decode: str, recipe) -> dict:
    sys.setswitchinterval(v["switch"] / 1000)
    lag = v["lag"]
    training = torch.cuda.Stream() if v["sidestream"] else torch.cuda.current_stream()
    with _Patched(v), torch.cuda.stream(training):
        loader = ImageLoader(args.data, batch_size=args.batch_size, device="cuda", decode=decode, channels_last=True,
                             num_workers=args.workers or None, prefetch_depth=v["depth"], cpu_share=v["share"],
                             transform=recipe.transform if recipe else None,
                             batch_transform=recipe.batch_transform if recipe else None)
        instrument_decoders(loader)
        rates, per_batch, epochs = [], collections.defaultdict(list), []
        try:
            for epoch in range(args.epochs):
                TIMES.clear()
                queued: collections.deque = collections.deque()
                marks, shares = [], []
                n, batches = 0, 0
                torch.cuda.synchronize()
                memory, collected = torch.cuda.memory_stats(), list(GC)
                GC_COUNTS.clear()
                t0 = time.perf_counter()
                it = iter(loader)
                while True:
                    ea = torch.cuda.Event(enable_timing=True)
                    ea.record()
                    a = time.perf_counter()
                    try:
                        images, labels = next(it)
                    except StopIteration:
                        break
                    eb = torch.cuda.Event(enable_timing=True)
                    eb.record()
                    b = time.perf_counter()
                    if lag:
                        while len(queued) >= lag:
                            queued.popleft().synchronize()
                    c = time.perf_counter()
                    step(images, labels)
                    d = time.perf_counter()
                    ee = torch.cuda.Event(enable_timing=True)
                    ee.record()
                    marks.append((ea, eb, ee))
                    if lag:
                        e = torch.cuda.Event()
                        e.record()
                        queued.append(e)
                    TIMES["training: waits in next()"].append(b - a)
                    shares.append(loader._share.value)
                    TIMES["training: waits for step k-lag"].append(c - b)
                    TIMES[STEP_CALLS].append(d - c)
                    n += images.shape[0]
                    batches += 1
                torch.cuda.synchronize()
                dt = time.perf_counter() - t0
                for ea, eb, ee in marks[1:]:
                    TIMES["GPU: training stream waits for the batch"].append(ea.elapsed_time(eb) / 1000)
                    TIMES["GPU: training step"].append(eb.elapsed_time(ee) / 1000)
                waits = TIMES["training: waits in next()"]
                epochs.append(f"epoch {epoch + 1}: {n / dt:,.0f} images/s, {1000 * dt:.0f} ms; next() waits: first "
                              f"batch {1000 * waits[0]:.1f} ms, the others {1000 * sum(waits[1:]):.1f} ms in all, "
                              f"{sum(w > 0.002 for w in waits[1:])} over 2 ms (longest {1000 * max(waits[1:], default=0):.1f}); "
                              f"CPU share mean {statistics.mean(shares):.2f}, lowest {min(shares):.2f}")
                memory_now = torch.cuda.memory_stats()
                counts = {k: memory_now.get(k, 0) - memory.get(k, 0) for k in ALLOCATOR}
                gcs = GC[len(collected):]
                longest = {k.split(": ")[-1]: 1000 * max(t) for k, t in TIMES.items()
                           if k.startswith(("loader", "decoders")) and not k.endswith("(CPU)") and t}
                epochs.append(f"  longest, ms: {', '.join(f'{k} {v:.1f}' for k, v in longest.items())}; "
                              f"CUDA allocator: {', '.join(f'{k} {v}' for k, v in counts.items())}; "
                              f"gc: collections by generation {GC_COUNTS[0]}, {GC_COUNTS[1]}, {GC_COUNTS[2]}; "
                              f"generation 2 took {sum(gcs):.1f} ms")
                if epoch:
                    rates.append(n / dt)
                    for k, t in TIMES.items():
                        per_batch[k].append(1000 * sum(t) / batches)
        finally:
            share = loader.stats["cpu_share"]
            loader.close()
            sys.setswitchinterval(0.005)
    return {"rate": statistics.median(rates), "rates": rates, "share": share, "epochs": epochs,
            "ms": {k: statistics.median(t) for k, t in per_batch.items()}}


def launch_ms(step, images, labels, n: int = 20) -> float:
    """Host ms to queue one step when nothing is queued on the device (median of ``n``): how far ahead of
    the device the training thread can run alone."""
    out = []
    for _ in range(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        step(images, labels)
        out.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    return 1000 * statistics.median(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("data")
    p.add_argument("--model", default="resnet18")
    p.add_argument("--variants", default="base", help="|-separated variants (see variant())")
    p.add_argument("--decode", default="auto")
    p.add_argument("--recipe", default=None)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--compile", action="store_true")
    args = p.parse_args()
    if args.epochs < 2:
        p.error("--epochs must be at least 2 (the first is not timed)")
    if not torch.cuda.is_available():
        print("runahead.py needs a CUDA GPU")
        return 0
    device = torch.device("cuda", torch.cuda.current_device())
    print(f"machine: {machine_description()}\ncommand: {' '.join(sys.argv)}")
    instrument()
    gc.callbacks.append(_gc_timer)
    step = make_train_step(args.model, device, args.compile)
    images = torch.randn(args.batch_size, 3, 224, 224, device=device).contiguous(memory_format=torch.channels_last)
    labels = torch.randint(0, 1000, (args.batch_size,), device=device)
    recipe = load_recipe(args.recipe) if args.recipe else None
    if recipe is not None and recipe.batch_transform is not None:
        # MixUp/CutMix give (B, classes) float labels: the loss takes them as they come
        labels = torch.nn.functional.one_hot(labels, 1000).float()
    for _ in range(20):
        step(images, labels)
    alone = [model_rate(step, images, labels, 4.0)]
    print(f"alone: {1000 * args.batch_size / alone[0]:.2f} ms per step on the device, "
          f"{launch_ms(step, images, labels):.2f} ms of the training thread's calls to queue one")
    results = []
    for spec in args.variants.split("|"):
        r = run(args, step, variant(spec), args.decode, recipe)
        results.append((spec, r))
        print(f"{spec}: {r['rate']:,.0f} images/s (epochs {', '.join(f'{x:,.0f}' for x in r['rates'])}),"
              f" CPU share {r['share']}", flush=True)
        for k, t in sorted(r["ms"].items()):
            print(f"    {k:42s} {t:7.2f} ms per batch")
        for line in r["epochs"]:
            print(f"    {line}")
    alone.append(model_rate(step, images, labels, 4.0))
    own = statistics.mean(alone)
    print(f"\n{args.model}{' compiled' if args.compile else ''}, decode={args.decode}, recipe={args.recipe}: "
          f"own rate {alone[0]:,.0f} / {alone[1]:,.0f}")
    print("| variant | images/s | of own rate | CPU share | next() wait | GPU: stream waits for batch | GPU: step |")
    print("|---|---|---|---|---|---|---|")
    for spec, r in results:
        ms = r["ms"]
        print(f"| {spec} | {r['rate']:,.0f} | {100 * r['rate'] / own:.1f}% | {r['share']} | "
              f"{ms['training: waits in next()']:.2f} | {ms['GPU: training stream waits for the batch']:.2f} | "
              f"{ms['GPU: training step']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
