"""How many worker processes a loader starts and which CPUs they run on."""

from __future__ import annotations

from ..cores import usable_cores
from ..cores import worker_cpus as _cpus_without

# GPU path: physical cores per rank kept free of workers, for the two decoder threads and the training loop,
# which then never wait for a core (+2-7% loader-only at the same share, ResNet-18 77.6% of its own rate
# against 69.6%: BENCHMARKS.md#cores-kept-from-the-workers). At most a quarter of the cores, and none under 8,
# where the workers and the training share every core anyway.
KEPT_CORES = 3
KEPT_AT_MOST = 1 / 4
KEEP_FROM_CPUS = 8

# A CPU device with at least this many workers has them normalise the images they finish: one process
# normalising every batch cannot keep up with 16 workers (1.6x the DataLoader, against 3.5x with the workers
# doing it), while with 2 workers every core is busy decoding anyway and the copy out of the ring costs 5-8%
# (BENCHMARKS.md#cpu-only-machines).
WORKERS_NORMALISE_FROM = 8


def default_num_workers(local_world_size: int = 1) -> int:
    """One worker per core this process may use (affinity mask and cgroup CPU quota,
    ``cores.usable_cores``), shared among the ranks of this node."""
    return max(1, usable_cores() // max(1, local_world_size))


def worker_cpus(gpu_path: bool, local_world_size: int = 1) -> set[int] | None:
    """The CPUs the workers run on: on the GPU path all but ``KEPT_CORES`` physical cores per rank of this
    node (``cores.worker_cpus``); None (this process's whole mask) on the CPU path, where the workers are
    the whole pipeline."""
    if not gpu_path:
        return None
    return _cpus_without(KEPT_CORES * max(1, local_world_size), least=KEEP_FROM_CPUS, most=KEPT_AT_MOST)
