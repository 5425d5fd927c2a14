"""The training step the bench times, and the model's own rate on GPU-resident tensors (the ceiling)."""

from __future__ import annotations

import math
import statistics
import time
from typing import Callable

import torch

from .ranks import over_ranks, ranks, together

TrainStep = Callable[[torch.Tensor, torch.Tensor], None]


def make_train_step(name: str, device: torch.device, compile: bool = False) -> TrainStep:
    """One SGD step of torchvision model ``name`` under bf16 autocast, channels_last (DDP-wrapped under an
    initialised process group); ``compile``: the model through ``torch.compile`` (static shapes: the epoch's
    last, smaller batch is compiled once more)."""
    import torchvision

    model = torchvision.models.get_model(name, num_classes=1000).to(device).to(memory_format=torch.channels_last)
    if ranks()[1] > 1:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index])
    if compile:
        model = torch.compile(model, dynamic=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step(images: torch.Tensor, labels: torch.Tensor) -> None:
        images = images.to(device, non_blocking=True).contiguous(memory_format=torch.channels_last)
        labels = labels.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_fn(model(images), labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return step


def resident_batch(batch_size: int, device: torch.device, image_size: int = 224) -> tuple[torch.Tensor, torch.Tensor]:
    """A random (B, 3, S, S) float32 channels_last batch and its labels, on the GPU (never zeros: they can run
    faster than real data)."""
    images = torch.randn(batch_size, 3, image_size, image_size, device=device)
    return images.contiguous(memory_format=torch.channels_last), torch.randint(0, 1000, (batch_size,), device=device)


def model_rate(step: TrainStep, images: torch.Tensor, labels: torch.Tensor, seconds: float) -> float:
    """Images/s of ``step`` on one GPU-resident batch over about ``seconds``: the median of 1 s windows, the
    device synchronised at each window's ends."""
    rates, end = [], time.perf_counter() + seconds
    while time.perf_counter() < end:
        torch.cuda.synchronize()
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < 1.0:
            step(images, labels)
            n += images.shape[0]
        torch.cuda.synchronize()
        rates.append(n / (time.perf_counter() - t0))
    return statistics.median(rates)


def ceiling_rate(step: TrainStep, batch_size: int, device: torch.device, seconds: float = 5.0) -> float:
    """The model's own images/s (summed over ranks) on one batch already on the GPU: the end-to-end ceiling.
    Warmed up first; under DDP every rank takes the same number of steps (a step's all-reduce pairs up across
    ranks: a time limit would leave one rank waiting for a step the others never take)."""
    images, labels = resident_batch(batch_size, device)
    for _ in range(10):
        step(images, labels)
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(10):
        step(images, labels)
    torch.cuda.synchronize(device)
    steps = int(over_ranks(max(30.0, math.ceil(seconds / ((time.perf_counter() - t0) / 10))), device, "MAX"))
    together()
    t0 = time.perf_counter()
    for _ in range(steps):
        step(images, labels)
    torch.cuda.synchronize(device)
    return over_ranks(steps * batch_size / (time.perf_counter() - t0), device)
