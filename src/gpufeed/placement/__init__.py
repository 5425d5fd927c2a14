"""Placement policy: who decodes what, and on which cores. Every rule that decides this at run time
lives here, once, with its reason; the loader, the workers, the GPU stage and ``gpufeed info`` ask it.

- which GPU decoder, if any (``create_gpu_decoders``), chosen once at construction;
- how many worker processes (``default_num_workers``) and which CPUs they run on (``worker_cpus``);
- which samples go to the GPU at all (``gpu_may_take``), and the GPU memory the loader holds
  (``gpu_memory``);
- what share of each GPU-path batch the CPU workers decode (``ShareControl``) and which samples of a
  chunk that share takes (``cheapest_on_cpu``, from the cost model ``cpu_cost`` / ``engine_cost``);
- which ops of a torchvision recipe run on the device and which in the CPU workers (``ops.on_device``).

One module each: ``decoders`` (which GPU decoder), ``cpus`` (workers and their CPUs), ``samples`` (what the
GPU may take, the cost model), ``share`` (the CPU share), ``memory`` (the GPU budget), ``ops`` (the recipe's
ops). None imports torch at
load time: worker processes use the cost model.
"""

from __future__ import annotations

from .cpus import KEPT_CORES, WORKERS_NORMALISE_FROM, default_num_workers, worker_cpus
from .decoders import DECODE_CHOICES, DECODER_THREADS, cpu_crops, create_gpu_decoders, decode_call_images
from .memory import BUFFER_PIXELS_PER_IMAGE, ENGINE_ROOM_SIDE, GpuMemory, gpu_memory, reserved_bytes, ring_slots
from .samples import (ENGINE_BYTES_PER_IMAGE, GPU_BYTES_CAPACITY, GPU_MAX_SIDE, Candidate, cheapest_on_cpu, cpu_cost,
                      engine_cost, gpu_may_take)
from .share import ShareControl

__all__ = ["DECODE_CHOICES", "DECODER_THREADS", "GPU_BYTES_CAPACITY", "GPU_MAX_SIDE", "KEPT_CORES",
           "WORKERS_NORMALISE_FROM", "BUFFER_PIXELS_PER_IMAGE", "ENGINE_ROOM_SIDE", "ENGINE_BYTES_PER_IMAGE",
           "Candidate", "GpuMemory",
           "ShareControl", "cheapest_on_cpu", "cpu_cost", "cpu_crops", "create_gpu_decoders", "decode_call_images",
           "default_num_workers", "engine_cost", "gpu_may_take", "gpu_memory", "reserved_bytes", "ring_slots",
           "worker_cpus"]
