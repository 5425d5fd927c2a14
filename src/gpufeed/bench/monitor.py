"""Sampled during a run: GPU utilisation (NVML, every 50 ms), host RSS/PSS and CPU time of the process tree."""

from __future__ import annotations

import os
import threading
import time


class Monitor:
    """Background sampler; ``start()``/``stop()`` around one measured phase.

    gpu_busy: mean NVML utilisation (%) of ``gpu_index``, None without NVML.
    peak_rss: largest sum of RSS over this process and all its descendants
    (shared pages counted once per process, as ``ps`` reports them);
    start_rss: the same sum when ``start()`` was called. Pipelines run one
    after another in one process, so the main process carries what earlier
    ones left (PyTorch's pinned-memory cache, for one): ``peak - start`` of the
    first epoch is what a pipeline added.
    peak_pss / start_pss: the same with PSS (proportional set size: a page
    shared by k processes counts 1/k in each), so the sum is the tree's real
    resident memory; RSS sums count the shared-memory ring and the pages
    forked workers share with the main process once per process. 0 where
    PSS cannot be read. PSS is read at ``start()`` and when ``read_pss()``
    is called (``gpufeed bench``: once, halfway through the epoch, while
    every pipeline's workers run; the usual DataLoader's are gone by the
    epoch's end), not sampled: reading it walks each process's page tables
    under its memory map lock, which stalls the threads that map or fault
    pages meanwhile (BENCHMARKS.md, "How these are measured"); RSS is a
    counter, read every fourth sample.
    cores_busy: CPU time (user + system) used by the process tree between
    ``start()`` and ``stop()``, divided by the wall time: the number of cores
    the pipeline kept busy (worker processes that exited count once reaped).
    """

    def __init__(self, gpu_index: int | None, interval: float = 0.05) -> None:
        self.interval = interval
        self._nvml = None
        self._handle = None
        self.nvml_error: str | None = None
        if gpu_index is not None:
            try:
                import pynvml

                pynvml.nvmlInit()
                self._handle = pynvml.nvmlDeviceGetHandleByIndex(gpu_index)
                self._nvml = pynvml
            except Exception as e:  # NVML missing or no driver: report, don't fail
                self.nvml_error = f"{type(e).__name__}: {e}"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.util: list[int] = []
        self.gpu_mem_start: int | None = None  # NVML "used" when start() was called
        self.gpu_mem_peak: int | None = None
        self.peak_rss = self.peak_pss = 0
        self.start_rss = self.start_pss = 0
        self.cores_busy: float | None = None
        self._cpu0: float | None = None
        self._t0 = 0.0

    def start(self) -> None:
        self.util, self.peak_rss, self.peak_pss, self._stop = [], 0, 0, threading.Event()
        self.start_rss, self.start_pss = self._sample_memory()
        self.cores_busy = None
        self._cpu0, self._t0 = _tree_cpu_seconds(), time.perf_counter()
        self.gpu_mem_start = self.gpu_mem_peak = self.gpu_used()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        cpu = _tree_cpu_seconds()
        if cpu is not None and self._cpu0 is not None:
            self.cores_busy = (cpu - self._cpu0) / max(time.perf_counter() - self._t0, 1e-9)

    def read_pss(self) -> None:
        """Read the process tree's PSS now, into ``peak_pss`` (and its RSS, read with it, into ``peak_rss``)."""
        rss, pss = self._sample_memory()
        self.peak_rss, self.peak_pss = max(self.peak_rss, rss), max(self.peak_pss, pss)

    def gpu_used(self) -> int | None:
        """NVML's \"used\" of this GPU now, in bytes (None without NVML)."""
        if self._nvml is None:
            return None
        return self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used

    @staticmethod
    def _sample_memory(pss: bool = True) -> tuple[int, int]:
        """(RSS, PSS) of the process tree now (PSS 0 with ``pss=False``)."""
        try:
            import psutil
        except ImportError:
            return 0, 0
        return _tree_memory(psutil.Process(os.getpid()), psutil, pss)

    @property
    def gpu_busy(self) -> float | None:
        return sum(self.util) / len(self.util) if self.util else None

    def _run(self) -> None:
        try:
            import psutil
        except ImportError:
            psutil = None
        me = psutil.Process(os.getpid()) if psutil else None
        tick = 0
        while not self._stop.is_set():
            if self._nvml is not None:
                self.util.append(self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu)
                self.gpu_mem_peak = max(self.gpu_mem_peak or 0, self.gpu_used())
            if me is not None and tick % 4 == 0:
                self.peak_rss = max(self.peak_rss, _tree_memory(me, psutil, pss=False)[0])
            tick += 1
            time.sleep(self.interval)


def _tree_memory(proc, psutil, pss: bool = True) -> tuple[int, int]:
    """(RSS, PSS) summed over ``proc`` and its descendants; PSS 0 when some process's cannot be read, or
    not asked for (``pss=False``: RSS alone, a counter, read without walking the page tables)."""
    rss, pss_sum, pss_ok = 0, 0, pss
    for p in [proc, *proc.children(recursive=True)]:
        try:
            try:
                m = p.memory_full_info() if pss else p.memory_info()  # RSS and PSS in one read
            except psutil.AccessDenied:
                m = p.memory_info()
            rss += m.rss
            if getattr(m, "pss", None) is None:  # not readable, or no PSS on this platform
                pss_ok = False
            else:
                pss_sum += m.pss
        except (psutil.NoSuchProcess, psutil.AccessDenied):  # a worker that just exited
            continue
    return rss, pss_sum if pss_ok else 0


def _tree_cpu_seconds() -> float | None:
    """User + system CPU seconds of this process and its descendants, including reaped children."""
    try:
        import psutil
    except ImportError:
        return None
    me = psutil.Process(os.getpid())
    total = 0.0
    for p in [me, *me.children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return total
