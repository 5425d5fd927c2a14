"""ImageNet-style training on gpufeed's ImageLoader: DDP, bf16 autocast, SGD + cosine, top-1/top-5,
checkpoint and resume (the loader's position included), as jobs run on clusters.

    python examples/train.py                         # one GPU (or the CPU), synthetic data
    torchrun --nproc_per_node=8 examples/train.py --data /data/imagenet --epochs 90
    torchrun --nproc_per_node=4 examples/train.py --data /data/imagenet --resume checkpoint.pt

SIGTERM (how schedulers preempt a job) or Ctrl-C: every rank finishes its step, rank 0 saves a
checkpoint, and the job exits with status 128 + the signal's number (130 for Ctrl-C), as an unfinished run;
--max-steps saves and exits with 0. A checkpoint resumes on any number of
processes: the rest of the epoch is sharded over the new ranks, each sample once. Each epoch reports
its steady images/s (the first steps, which include start-up, left out) and the time per step spent
waiting for data.

With no --data, a synthetic ImageNet-like dataset is generated once under ~/.cache/gpufeed. A
progress bar is shown when attached to a terminal; otherwise plain log lines (so
`nohup python examples/train.py > log.txt &` reads well).
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchvision

from gpufeed import ImageLoader, create_synthetic_dataset


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """--help: the module docstring as written, every option's default after its help."""


def create_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="examples/train.py", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--data", metavar="DIR",
                   help="ImageFolder root holding train/ and val/ (none: the synthetic set under ~/.cache/gpufeed)")
    p.add_argument("--model", default="resnet50", help="torchvision classifier name (torchvision.models.get_model)")
    p.add_argument("--epochs", type=int, default=2, help="epochs to train")
    p.add_argument("--batch-size", type=int, default=256, help="images per step on each process")
    p.add_argument("--lr", type=float, default=0.1, help="SGD learning rate for a total batch of 256; scaled linearly")
    p.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
    p.add_argument("--weight-decay", type=float, default=1e-4, help="SGD weight decay")
    p.add_argument("--image-size", type=int, default=224, help="training crop and validation size, in pixels")
    p.add_argument("--workers", type=int, metavar="N",
                   help="loader worker processes per process (none: this node's usable cores / local ranks)")
    p.add_argument("--decode", default="auto",
                   help="ImageLoader decode: auto, cpu, gpu, nvjpeg, nvimgcodec, torchvision")
    p.add_argument("--device", default="auto", help="auto (this rank's GPU, else the CPU), cpu, cuda or cuda:N")
    p.add_argument("--synthetic-n", type=int, default=10_000, metavar="N",
                   help="training images of the synthetic set (without --data)")
    p.add_argument("--checkpoint", default="checkpoint.pt", metavar="FILE",
                   help="where rank 0 saves after each epoch and at a stop")
    p.add_argument("--checkpoint-every", type=int, default=0, metavar="N",
                   help="also save every N steps (0: each epoch only)")
    p.add_argument("--resume", metavar="FILE", help="checkpoint to resume from, on any number of processes")
    p.add_argument("--max-steps", type=int, default=0, metavar="N",
                   help="stop after this many steps in total (0: no limit)")
    p.add_argument("--seed", type=int, default=0, help="the model's initialisation and the loader's order and crops")
    p.add_argument("--stop-check-every", type=int, default=10, metavar="N",
                   help="steps between the ranks' checks for a stop request (SIGTERM, Ctrl-C) under DDP")
    p.add_argument("--sample-log", metavar="FILE",
                   help="append each step's sample indices to FILE.rank<r> (to audit delivery)")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    return create_parser().parse_args(argv)


def setup_distributed(device_arg: str) -> tuple[int, int, torch.device]:
    """(rank, world size, device); initialises NCCL/Gloo when started by torchrun."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:
        local = int(os.environ.get("LOCAL_RANK", 0))
        use_cuda = torch.cuda.is_available() and device_arg != "cpu"
        device = torch.device("cuda", local) if use_cuda else torch.device("cpu")
        if use_cuda:
            torch.cuda.set_device(local)
            # the rank's GPU named: NCCL need not guess it from the global rank (a hang where the mapping differs)
            try:
                dist.init_process_group("nccl", device_id=device)
            except TypeError:  # torch < 2.3 has no device_id
                dist.init_process_group("nccl")
        else:
            dist.init_process_group("gloo")
        return dist.get_rank(), dist.get_world_size(), device
    if device_arg == "auto":
        device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    else:
        device = torch.device(device_arg)
    return 0, 1, device


def dataset_roots(args) -> tuple[str, str]:
    if args.data:
        return str(Path(args.data) / "train"), str(Path(args.data) / "val")
    cache = Path(os.path.expanduser("~/.cache/gpufeed"))
    n = args.synthetic_n
    if not dist.is_initialized() or dist.get_rank() == 0:
        create_synthetic_dataset(cache / f"synth-{n}-seed0", n=n, seed=0)
        create_synthetic_dataset(cache / f"synth-{max(n // 10, 10)}-seed1", n=max(n // 10, 10), seed=1)
    if dist.is_initialized():
        dist.barrier()
    return str(cache / f"synth-{n}-seed0"), str(cache / f"synth-{max(n // 10, 10)}-seed1")


class StopRequest:
    """SIGTERM and SIGINT ask the training to stop after the current step (a second Ctrl-C stops at once).
    Under DDP the ranks agree on it every ``every`` steps with one all-reduce, so all stop at the same step."""

    def __init__(self, every: int) -> None:
        self.requested, self.every, self.signum = False, max(1, every), None
        self._saved = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGTERM, signal.SIGINT)}

    def _handle(self, signum, frame) -> None:  # sets a flag only: printing here could re-enter a write
        self.requested, self.signum = True, self.signum or signum
        signal.signal(signal.SIGINT, signal.default_int_handler)

    @property
    def exit_status(self) -> int:
        """The shell's status for the signal that asked (128 + its number; 0 if none did), so a wrapper that runs
        the script again until it succeeds sees a stopped run as unfinished."""
        return 128 + self.signum if self.signum else 0

    def agreed(self, step: int, device: torch.device) -> bool:
        """Whether every rank stops now (checked every ``every`` steps; always without DDP)."""
        if not dist.is_initialized():
            return self.requested
        if step % self.every:
            return False
        flag = torch.tensor([int(self.requested)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def restore(self) -> None:
        for sig, handler in self._saved.items():
            signal.signal(sig, handler)


class Progress:
    """A tqdm bar on a terminal; a log line every ``every`` steps otherwise."""

    def __init__(self, total: int, desc: str, enabled: bool, every: int = 50) -> None:
        self.enabled, self.every, self.desc, self.total, self.n = enabled, every, desc, total, 0
        self.bar = None
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=desc, unit="batch")

    def update(self, metrics) -> None:
        """``metrics()`` gives the values to show; it is called only when a line or the bar is written, so the
        training loop does not wait for the GPU every step to read the loss."""
        self.n += 1
        show = self.bar is not None and self.n % 10 == 0
        if self.bar is not None:
            if show:
                self.bar.set_postfix({k: f"{v:.3f}" for k, v in metrics().items()}, refresh=False)
            self.bar.update(1)
        elif self.enabled and (self.n % self.every == 0 or self.n == self.total):
            text = " ".join(f"{k}={v:.4f}" for k, v in metrics().items())
            print(f"{time.strftime('%H:%M:%S')} {self.desc} step {self.n}/{self.total} {text}", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def accuracy(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Correct counts (top-1, top-5) as tensors on the logits' device."""
    top5 = logits.topk(min(5, logits.shape[1]), dim=1).indices
    hit = top5 == labels[:, None]
    return hit[:, :1].sum(), hit.sum()


def save_checkpoint(path, model, opt, sched, epoch, step, loader) -> None:
    state = {"model": (model.module if hasattr(model, "module") else model).state_dict(),
             "optimizer": opt.state_dict(), "scheduler": sched.state_dict(), "epoch": epoch, "step": step,
             "loader": loader.state_dict()}
    tmp = f"{path}.tmp"
    torch.save(state, tmp)
    os.replace(tmp, path)  # never a half-written checkpoint


def evaluate(model, loader, device, autocast) -> tuple[float, float]:
    model.eval()
    c1 = c5 = n = torch.zeros((), device=device, dtype=torch.long)
    with torch.no_grad(), autocast():
        for images, labels in loader:
            t1, t5 = accuracy(model(images), labels)
            c1, c5, n = c1 + t1, c5 + t5, n + labels.shape[0]
    totals = torch.stack([c1, c5, n])
    if dist.is_initialized():
        dist.all_reduce(totals)
    c1, c5, n = totals.tolist()
    model.train()
    return 100.0 * c1 / max(n, 1), 100.0 * c5 / max(n, 1)


def main(argv=None) -> int:
    args = parse_args(argv)
    rank, world, device = setup_distributed(args.device)
    torch.manual_seed(args.seed)
    train_root, val_root = dataset_roots(args)
    common = dict(batch_size=args.batch_size, image_size=args.image_size, device=device, num_workers=args.workers,
                  rank=rank, world_size=world, channels_last=device.type == "cuda", decode=args.decode,
                  seed=args.seed)
    train_loader = ImageLoader(train_root, train=True, drop_last=True, **common)
    val_loader = ImageLoader(val_root, train=False, drop_last=False, **common)
    num_classes = len(getattr(train_loader.source, "classes", ())) or 1000
    model = torchvision.models.get_model(args.model, num_classes=num_classes).to(device)
    if device.type == "cuda":
        model = model.to(memory_format=torch.channels_last)
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    lr = args.lr * args.batch_size * world / 256
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=args.momentum, weight_decay=args.weight_decay)
    total_steps = args.epochs * len(train_loader)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, total_steps) / total_steps)))
    start_epoch, step = 0, 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location=device, weights_only=False)
        (model.module if hasattr(model, "module") else model).load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        sched.load_state_dict(ckpt["scheduler"])
        train_loader.load_state_dict(ckpt["loader"])
        start_epoch, step = ckpt["epoch"], ckpt["step"]
        if rank == 0:
            print(f"resumed from {args.resume}: epoch {start_epoch}, step {step}, "
                  f"{ckpt['loader']['sampler']['offset']} samples of the epoch done", flush=True)
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if device.type == "cuda" else (
        lambda: torch.autocast("cpu", enabled=False))
    if rank == 0:
        print(f"model {args.model}, {world} process(es) on {device.type}, decode {train_loader.decode_backend}, "
              f"{len(train_loader)} steps/epoch, batch {args.batch_size}/process, lr {lr:.4f}", flush=True)
    stop = StopRequest(args.stop_check_every)
    stopped = False
    log = open(f"{args.sample_log}.rank{rank}", "a", buffering=1) if args.sample_log else None  # line by line
    try:
        for epoch in range(start_epoch, args.epochs):
            train_loader.set_epoch(epoch)
            progress = Progress(len(train_loader), f"epoch {epoch + 1}/{args.epochs}", enabled=rank == 0)
            rate = Rate(len(train_loader))
            reason = None
            for images, labels in rate.timed(train_loader):
                with autocast():
                    loss = F.cross_entropy(model(images), labels)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                sched.step()
                step += 1
                if log is not None:
                    log.write(f"{epoch} {step} {' '.join(map(str, train_loader.batch_indices))}\n")
                progress.update(lambda: {"loss": loss.item(), "lr": sched.get_last_lr()[0]})
                if args.checkpoint_every and step % args.checkpoint_every == 0 and rank == 0:
                    save_checkpoint(args.checkpoint, model, opt, sched, epoch, step, train_loader)
                if args.max_steps and step >= args.max_steps:
                    reason = "--max-steps"
                elif stop.agreed(step, device):
                    reason = "stop requested"
                if reason:
                    break
            progress.close()
            if reason:  # mid-epoch: the checkpoint holds the loader's position in this epoch
                if rank == 0:
                    save_checkpoint(args.checkpoint, model, opt, sched, epoch, step, train_loader)
                    print(f"stopping at step {step} ({reason}); checkpoint {args.checkpoint} saved", flush=True)
                stopped = reason == "stop requested"
                break
            top1, top5 = evaluate(model, val_loader, device, autocast)
            if rank == 0:
                print(f"epoch {epoch + 1}: {rate.summary(world)}, val top-1 {top1:.2f}% top-5 {top5:.2f}%", flush=True)
                save_checkpoint(args.checkpoint, model, opt, sched, epoch + 1, step, train_loader)
    finally:
        stop.restore()
        if log is not None:
            log.close()
        train_loader.close(), val_loader.close()
        if dist.is_initialized():
            dist.destroy_process_group()
    return stop.exit_status or 128 + signal.SIGTERM if stopped else 0


class Rate:
    """An epoch's steady images/s, leaving out its first ``warmup`` steps (workers and decoders starting,
    first kernels compiled), and the mean time a step waited for its batch."""

    def __init__(self, steps: int) -> None:
        self.warmup = max(1, min(10, steps // 10))
        self.images = self.steps = 0
        self.wait = 0.0
        self.t0 = self.t_end = time.perf_counter()

    def timed(self, loader):
        it = iter(loader)
        while True:
            t = time.perf_counter()
            try:
                images, labels = next(it)
            except StopIteration:
                return
            now = time.perf_counter()
            self.steps += 1
            if self.steps == self.warmup + 1:
                self.t0 = t  # steady from the end of the last warm-up step
            if self.steps > self.warmup:
                self.images += labels.shape[0]
                self.wait += now - t
            self.t_end = now
            yield images, labels

    def summary(self, world: int) -> str:
        steady = self.steps - self.warmup
        if steady < 1:
            return f"{self.steps} steps (too few to time after {self.warmup} warm-up steps)"
        dt = self.t_end - self.t0
        return (f"{self.images * world / dt:,.0f} images/s steady (steps {self.warmup + 1}-{self.steps}, {dt:.1f} s), "
                f"data wait {1e3 * self.wait / steady:.1f} ms/step")


if __name__ == "__main__":
    sys.exit(main())
