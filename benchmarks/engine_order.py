"""Whether a GPU decoder writes before the work queued earlier on its stream has run, and whether its calls
wait for work queued on other streams.

    python3 benchmarks/engine_order.py [--trials 40]

For each engine decoder (nvJPEG's batched hardware decode called directly, nvImageCodec), each trial queues
about 50 ms of sleep on a stream, then a copy of 8 image places (filled with 7), then the decode of 8 JPEGs
into those places on that stream. A trial is out of order when the copy saw decoded pixels. Counted with
the decoders as they are (a host wait for the stream's queued work before the call: ``base.engines_after``)
and with that wait taken out, which shows what the wait guards against on this machine.

Then, for each decoder, a decode on a stream of its own while 100 ms of sleep is queued elsewhere: on no
stream, on the default (legacy) stream, on another stream. Per call: the host time of each nvJPEG function
called, and how long until the decode's stream has run. A call that waits for the legacy stream stalls a
training that runs on it (as most do) every time the loader decodes.
"""

from __future__ import annotations

import argparse
import io
import sys
import time

import numpy as np
import torch
from PIL import Image

from gpufeed.decode import nvimgcodec, nvjpeg_hw
from gpufeed.decode.base import DecodeJob


def _jpegs(n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        b = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (240, 320, 3), dtype=np.uint8)).save(b, "JPEG", quality=90)
        out.append(np.frombuffer(b.getvalue(), np.uint8))
    return out


def trials(dec, datas: list[np.ndarray], n: int) -> int:
    """How many of ``n`` trials the snapshot queued before the decode saw decoded pixels."""
    stream, late = torch.cuda.Stream(), 0
    for _ in range(n):
        outs = [torch.full((240, 320, 3), 7, dtype=torch.uint8, device="cuda") for _ in datas]
        with torch.cuda.stream(stream):
            torch.cuda._sleep(100_000_000)  # cycles: about 50 ms
            snaps = [o.clone() for o in outs]
        ok = dec.decode(DecodeJob.of(datas, outs), stream)
        stream.synchronize()
        if not ok.all():
            raise RuntimeError(f"{type(dec).__name__} decoded {int(ok.sum())} of {len(ok)}")
        late += any(not bool((s == 7).all()) for s in snaps)
    return late


class _Timed:
    """A libnvjpeg whose calls are timed (host ms, by name); other attributes as the library's."""

    def __init__(self, lib) -> None:
        self._lib, self.ms = lib, {}

    def __getattr__(self, name):
        fn = getattr(self._lib, name)

        def call(*a):
            t = time.perf_counter()
            try:
                return fn(*a)
            finally:
                self.ms[name] = self.ms.get(name, 0.0) + 1000 * (time.perf_counter() - t)
        return call


def waits(name: str, dec, datas: list[np.ndarray]) -> None:
    """Prints, for sleep queued on no stream, the legacy stream and another stream: the decode's host calls
    and how long until its own stream has run (median of 5)."""
    import statistics

    own, other = torch.cuda.Stream(), torch.cuda.Stream()
    legacy = torch.cuda.default_stream()
    outs = [torch.empty((240, 320, 3), dtype=torch.uint8, device="cuda") for _ in datas]
    timed = None
    if isinstance(dec, nvjpeg_hw.NvJpegHwDecoder):
        timed = dec._lib = _Timed(dec._lib)
    for where, busy in (("none", None), ("legacy", legacy), ("other", other)):
        runs, calls = [], []
        for _ in range(5):
            torch.cuda.synchronize()
            if busy is not None:
                with torch.cuda.stream(busy):
                    torch.cuda._sleep(200_000_000)  # cycles: about 100 ms
            if timed is not None:
                timed.ms = {}
            t = time.perf_counter()
            dec.decode(DecodeJob.of(datas, outs), own)
            host = 1000 * (time.perf_counter() - t)
            own.synchronize()
            runs.append((1000 * (time.perf_counter() - t), host))
            calls.append(dict(timed.ms) if timed is not None else {})
        torch.cuda.synchronize()
        done = statistics.median(r for r, _ in runs)
        host = statistics.median(h for _, h in runs)
        per = {k: statistics.median(c.get(k, 0.0) for c in calls) for k in calls[0]}
        detail = ", ".join(f"{k.replace('nvjpeg', '')} {v:.1f}" for k, v in per.items() if v >= 0.05)
        print(f"| {name} | {where} | {host:.1f} | {done:.1f} | {detail or '-'} |")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=40)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("engine_order.py needs a CUDA GPU")
        return 0
    datas = _jpegs(8)
    device = torch.device("cuda", 0)
    kept = nvjpeg_hw.engines_after, nvimgcodec.engines_after
    decoders = []
    print("| decoder | trials | out of order, host wait (as shipped) | out of order, no host wait |")
    print("|---|---|---|---|")
    for name, make in (("nvjpeg-hw", nvjpeg_hw.NvJpegHwDecoder), ("nvimgcodec", nvimgcodec.NvImageCodecDecoder)):
        try:
            dec = make(device)
        except RuntimeError as e:
            print(f"| {name} | - | not available: {e} | - |")
            continue
        shipped = trials(dec, datas, args.trials)
        nvjpeg_hw.engines_after = nvimgcodec.engines_after = lambda stream: None
        try:
            bare = trials(dec, datas, args.trials)
        finally:
            nvjpeg_hw.engines_after, nvimgcodec.engines_after = kept
        print(f"| {name} | {args.trials} | {shipped} | {bare} |")
        decoders.append((name, dec))
    print("\n| decoder | 100 ms queued on | decode call, host ms | until its stream ran, ms | nvJPEG calls, host ms |")
    print("|---|---|---|---|---|")
    for name, dec in decoders:
        waits(name, dec, datas)
    return 0


if __name__ == "__main__":
    sys.exit(main())
