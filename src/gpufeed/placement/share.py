"""The CPU workers' share of each GPU-path batch."""

from __future__ import annotations

import threading

from ..cores import IdleCores

class ShareControl:
    """The CPU workers' share of each GPU-path batch: fixed, or adapted ("auto").

    "auto" puts on the workers as much as keeps the training fed, since a JPEG the CPU decodes costs the training's
    GPU least (an engine decode takes its streaming multiprocessors 9-13 us; BENCHMARKS.md, "What the loader's GPU
    work costs the training"). At the end of every ``IdleCores.WINDOW_S`` window of batches: when the training took
    every batch of the window ready (it never waited for the loader), the share goes up one step, whatever the
    workers' load, where cores are kept from the workers for the training process (``training_cores_kept``:
    ``worker_cpus`` restricts them; below ``cpus.KEEP_FROM_CPUS`` cores the workers share the training's cores, so
    the load rules alone decide). Otherwise the loader sets the pace, and the workers get what they keep up with
    while a quarter of the cores (``reserve``) stay idle for the training process: the share goes down one step per
    core missing from the reserve (at most ``MAX_DOWN_STEPS``), or one step if most batches were late (the workers
    finished them more than ``LATE_S`` after the GPU stage asked, by their own clock: the interpreter lock's delays
    in the training process are not the workers'); otherwise up one step when a core more than the reserve stayed
    idle, so that the CPU takes a part beside the GPU decoders without crowding out the threads that feed them. Up
    stays one step, since while the workers start and at epoch boundaries cores idle with no batch to decode
    (BENCHMARKS.md#cpu-share). A window longer than ``PAUSE_S`` spans a pause of the loader's work (a validation
    pass, a checkpoint), whose load was other work's: it changes nothing, and the share stays what the loader
    learned. A change reaches the batches submitted from then on.
    """

    STEP, LATE_S, MAX_DOWN_STEPS, START, PAUSE_S = 1 / 32, 0.002, 4, 0.5, 2.0

    def __init__(self, setting: float | str, idle: IdleCores | None = None, *,
                 training_cores_kept: bool = True) -> None:
        self.check(setting)
        self.auto = setting == "auto"
        self.value = self.START if self.auto else float(setting)
        self._idle = (idle or IdleCores()) if self.auto else None
        self.reserve = max(1.0, self._idle.capacity / 4) if self._idle is not None else 0.0
        self._training_cores_kept = training_cores_kept
        self._batches = self._late = 0
        self._takes, self._lock = [0, 0], threading.Lock()  # the window's (taken, waited): the training's thread

    @staticmethod
    def check(setting: object) -> None:
        if not (setting == "auto" or (isinstance(setting, (int, float)) and 0 <= setting <= 1)):
            raise ValueError(f"cpu_share must be 'auto' or a fraction in [0, 1], got {setting!r}")

    def taken(self, waited: bool) -> None:
        """The training took a batch (its thread, ``Prefetcher``'s ``on_take``); ``waited``: none was ready."""
        if self._idle is None:  # a fixed share
            return
        with self._lock:
            self._takes[0] += 1
            self._takes[1] += waited

    def update(self, collect_wait: float) -> None:
        """After each GPU-path batch: ``collect_wait`` seconds from asking for it to the workers finishing it
        (``WorkerPool.collect``)."""
        if self._idle is None:
            return
        self._batches += 1
        self._late += collect_wait > self.LATE_S
        idle = self._idle.poll()
        if idle is None:
            return
        with self._lock:  # the window's takes, read and restarted at once
            (taken, waited), self._takes = self._takes, [0, 0]
        if self._idle.window_s > self.PAUSE_S:  # a pause (validation, a checkpoint): says nothing of this work
            self._batches = self._late = 0
            return
        if self._training_cores_kept and taken and not waited:  # the loader is ahead: the CPU costs the GPU least
            self.value = min(1.0, self.value + self.STEP)
        elif idle < self.reserve:  # the workers crowd the cores the training process needs
            steps = min(self.MAX_DOWN_STEPS, max(1, round(self.reserve - idle)))
            self.value = max(0.0, self.value - steps * self.STEP)
        elif 2 * self._late > self._batches:  # they do not keep up
            self.value = max(0.0, self.value - self.STEP)
        elif idle >= self.reserve + 1:
            self.value = min(1.0, self.value + self.STEP)
        self._batches = self._late = 0
