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
