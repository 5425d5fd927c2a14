"""Whether a GPU decoder writes before the work queued earlier on its stream has run.

    python3 benchmarks/engine_order.py [--trials 40]

For each engine decoder (nvJPEG's batched hardware decode called directly, nvImageCodec), each trial queues
about 50 ms of sleep on a stream, then a copy of 8 image places (filled with 7), then the decode of 8 JPEGs
into those places on that stream. A trial is out of order when the copy saw decoded pixels. Counted with
the decoders as they are (a host wait for the stream's queued work before the call: ``base.engines_after``)
and with that wait taken out, which shows what the wait guards against on this machine.
"""

from __future__ import annotations

import argparse
import io
import sys

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
    return 0


if __name__ == "__main__":
    sys.exit(main())
