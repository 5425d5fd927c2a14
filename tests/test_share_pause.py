"""The CPU share across a pause of the loader's work (a validation pass, a checkpoint): the next iteration
starts from the share the last one learned, and the cores' load during the pause is not counted against
its workers."""

from __future__ import annotations

import pytest

import gpufeed.cores as cores
from gpufeed.cores import IdleCores
from gpufeed.placement import ShareControl


class Machine:
    """Four cores as /proc/stat counts them, and a clock: ``run(seconds, idle_cores)``."""

    def __init__(self, tmp_path) -> None:
        self.stat, self.now, self.idle, self.busy = tmp_path / "stat", 0.0, [0] * 4, [0] * 4
        self._write()

    def _write(self) -> None:
        lines = [f"cpu{c} {self.busy[c]} 0 0 {self.idle[c]} 0 0 0 0" for c in range(4)]
        self.stat.write_text("cpu  0 0 0 0 0 0 0 0\n" + "\n".join(lines) + "\n")

    def run(self, seconds: float, idle_cores: float) -> None:
        ticks = round(seconds * 100)
        for c in range(4):
            share = min(1.0, max(0.0, idle_cores - c))
            self.idle[c] += round(ticks * share)
            self.busy[c] += ticks - round(ticks * share)
        self.now += seconds
        self._write()


def _control(machine, tmp_path, monkeypatch) -> ShareControl:
    monkeypatch.setattr(cores, "affinity", lambda: {0, 1, 2, 3})
    idle = IdleCores(str(machine.stat), clock=lambda: machine.now, proc_cgroup=str(tmp_path / "none"))
    return ShareControl("auto", idle, training_cores_kept=True)


def test_a_pause_of_busy_cores_does_not_lower_the_share_and_the_next_window_counts_again(tmp_path, monkeypatch):
    machine = Machine(tmp_path)
    share = _control(machine, tmp_path, monkeypatch)
    for _ in range(6):  # training: the loader ahead of the training, cores to spare: the share rises
        share.taken(waited=False)
        machine.run(0.12, idle_cores=2.0)
        share.update(collect_wait=0.0)
    learned = share.value
    assert learned == pytest.approx(ShareControl.START + 6 * ShareControl.STEP)
    machine.run(30.0, idle_cores=0.0)  # a validation pass: another loader's workers take every core
    share.taken(waited=True)  # the first batch after it waits for the workers to start it
    share.update(collect_wait=0.0)
    assert share.value == learned  # the window spans the pause: it says nothing of this loader's workers
    share.taken(waited=True)
    machine.run(0.12, idle_cores=0.0)  # now this loader's own workers crowd the cores: that counts
    share.update(collect_wait=0.0)
    assert share.value == pytest.approx(learned - ShareControl.STEP)
