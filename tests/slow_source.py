"""A source whose reads are slow, in a module of its own: worker processes unpickle it by importing this
module, which loads nothing heavier than gpufeed's sources (a test module would bring PyTorch along)."""

from __future__ import annotations

import time

from gpufeed.sources.base import FileSource


class SleepySource(FileSource):
    """Each read takes ``pause`` seconds more: every sample keeps within a generous sample_timeout, a batch
    of them need not keep within a batch_timeout."""

    pause = 1.5

    def read(self, index, max_bytes=None):
        time.sleep(self.pause)
        return super().read(index, max_bytes)


class HungrySource(FileSource):
    """Reading a file whose name holds "hungry" runs out of memory, as reading a 40 GB file would."""

    def read(self, index, max_bytes=None):
        if "hungry" in self.paths[index]:
            raise MemoryError()
        return super().read(index, max_bytes)
