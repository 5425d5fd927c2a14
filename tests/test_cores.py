"""Usable and idle cores: the affinity mask, the cgroup CPU quota (v1 and v2, read from fake trees), and
the idle-core readings that steer cpu_share="auto"."""

import pytest

import gpufeed.cores as cores
from gpufeed.cores import IdleCores, cpu_limit, usable_cores

from gpufeed.placement.cpus import KEEP_FROM_CPUS, KEPT_AT_MOST

POLICY = dict(least=KEEP_FROM_CPUS, most=KEPT_AT_MOST)  # placement.cpus: none kept under 8 CPUs, at most 1/4


def _tree(root, files):
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


@pytest.mark.parametrize("proc, files, expected", [
    # Kubernetes, cgroup v2: the limit sits on the pod, the container's own file says max
    ("0::/kubepods/pod1/ctr\n", {"kubepods/pod1/cpu.max": "800000 100000\n", "kubepods/pod1/ctr/cpu.max": "max 100000\n"},
     8.0),
    ("0::/\n", {"cpu.max": "250000 100000\n"}, 2.5),  # Docker --cpus=2.5 with its own cgroup namespace
    ("0::/docker/abc\n", {"cpu.max": "200000 100000\n"}, 2.0),  # the host's path, but only our cgroup mounted
    ("0::/\n", {"cpu.max": "max 100000\n"}, None),  # no quota
    ("4:cpu,cpuacct:/docker/abc\n1:memory:/docker/abc\n",  # cgroup v1
     {"cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "150000\n", "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n"},
     1.5),
    ("4:cpu,cpuacct:/\n", {"cpu,cpuacct/cpu.cfs_quota_us": "-1\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n"}, None),
    ("0::/\n", {}, None),  # no cgroup files at all
])
def test_cpu_limit_reads_the_cgroup_quota(tmp_path, proc, files, expected):
    _tree(tmp_path / "fs", files)
    (tmp_path / "fs").mkdir(exist_ok=True)
    (tmp_path / "cgroup").write_text(proc)
    assert cpu_limit(str(tmp_path / "fs"), str(tmp_path / "cgroup")) == expected


def test_cpu_limit_without_cgroup_information(tmp_path):
    assert cpu_limit(str(tmp_path), str(tmp_path / "missing")) is None


@pytest.mark.parametrize("limit, expected", [(None, 16), (2.5, 2), (0.5, 1), (64.0, 16)])
def test_usable_cores_is_the_mask_capped_by_the_quota(monkeypatch, limit, expected):
    monkeypatch.setattr(cores, "affinity", lambda: set(range(16)))
    monkeypatch.setattr(cores, "cpu_limit", lambda *a: limit)
    assert usable_cores() == expected


def test_idle_cores_from_proc_stat(tmp_path, monkeypatch):
    monkeypatch.setattr(cores, "affinity", lambda: {0, 1})  # this process's cores; cpu7 is another's
    stat, now = tmp_path / "stat", [0.0]

    def write(idle0, busy0, idle1, busy1):  # user, nice, system, idle, iowait, irq, softirq, steal
        stat.write_text(f"cpu  1 1 1 1 1 1 1 1\ncpu0 {busy0} 0 0 {idle0} 0 0 0 0\ncpu1 {busy1} 0 0 {idle1} 0 0 0 0\n"
                        "cpu7 0 0 0 999 0 0 0 0\nintr 1 2 3\n")

    write(100, 100, 100, 100)
    reader = IdleCores(str(stat), clock=lambda: now[0], proc_cgroup=str(tmp_path / "none"))
    assert reader.capacity == 2
    write(150, 150, 100, 200)  # core 0 half idle, core 1 busy
    assert reader.poll() is None  # the window has not ended
    now[0] = 0.2
    assert reader.poll() == pytest.approx(0.5)
    missing = IdleCores(str(tmp_path / "missing"), clock=lambda: now[0], proc_cgroup=str(tmp_path / "none"))
    assert missing.poll() is None
    now[0] = 0.4  # nothing to read (not Linux): every core counts as idle, lateness alone steers the share
    assert missing.poll() == 2


def test_idle_cores_under_a_quota_count_our_cgroup_usage(tmp_path, monkeypatch):
    monkeypatch.setattr(cores, "affinity", lambda: set(range(16)))
    _tree(tmp_path / "fs", {"cpu.max": "400000 100000\n", "cpu.stat": "usage_usec 1000000\nuser_usec 1\n"})
    (tmp_path / "cgroup").write_text("0::/\n")
    now = [0.0]
    reader = IdleCores(str(tmp_path / "stat-unused"), clock=lambda: now[0], cgroup_root=str(tmp_path / "fs"),
                       proc_cgroup=str(tmp_path / "cgroup"))
    assert reader.capacity == 4.0  # the quota, not the 16 cores of the mask
    (tmp_path / "fs" / "cpu.stat").write_text("usage_usec 1300000\nuser_usec 1\n")
    now[0] = 0.2  # 0.3 core-seconds in 0.2 s: 1.5 cores busy of 4
    assert reader.poll() == pytest.approx(2.5)
    (tmp_path / "fs" / "cpu.stat").write_text("usage_usec 2300000\n")
    now[0] = 0.4  # 1 core-second in 0.2 s: more than the quota (bursts): none idle
    assert reader.poll() == 0.0


@pytest.mark.parametrize("n, kept, expected", [
    (16, 3, set(range(3, 16))),  # the lowest 3 kept for the training process's threads
    (16, 6, set(range(4, 16))),  # at most a quarter of the mask
    (8, 3, set(range(2, 8))),
    (7, 3, None),  # small machines: no restriction
    (16, 0, None),
])
def test_worker_cpus_leave_the_lowest_cores_to_the_training_process(n, kept, expected):
    mask = {c + 10 for c in range(n)}  # CPU numbers need not start at 0 (taskset, torchrun bindings)
    got = cores.worker_cpus(kept, mask=mask, siblings=lambda c: {c}, **POLICY)
    assert got == (None if expected is None else {c + 10 for c in expected})


def test_worker_cpus_keep_whole_physical_cores():
    # 16 cores with 2 threads each, numbered as Linux does on x86: core k is CPUs k and k + 16
    siblings = lambda c: {c % 16, c % 16 + 16}
    got = cores.worker_cpus(3, mask=set(range(32)), siblings=siblings, **POLICY)
    assert got == set(range(32)) - {0, 1, 2, 16, 17, 18}
    # a quarter of 12 CPUs is 3: one whole core (2 CPUs) fits, a second would not
    assert cores.worker_cpus(3, mask={0, 1, 2, 3, 4, 5, 16, 17, 18, 19, 20, 21}, siblings=siblings, **POLICY) == \
        {1, 2, 3, 4, 5, 17, 18, 19, 20, 21}
    # siblings outside the mask are not the workers' anyway
    assert cores.worker_cpus(2, mask=set(range(16)), siblings=siblings, **POLICY) == set(range(2, 16))


def test_thread_siblings_from_sysfs_or_the_cpu_alone():
    assert 0 in cores._thread_siblings(0)
    assert cores._thread_siblings(10**6) == {10**6}  # no such CPU
