"""CPU threads: the cores the process may use, capped by a cgroup quota, or OMP_NUM_THREADS."""

import os

import pytest
import torch

from mmtune.training.cpu import available_cpus, set_cpu_threads


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _cgroup(tmp_path, v2=None, v1=None):
    if v2 is not None:
        (tmp_path / "cpu.max").write_text(v2)
    if v1 is not None:
        (tmp_path / "cpu").mkdir()
        (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text(str(v1[0]))
        (tmp_path / "cpu" / "cpu.cfs_period_us").write_text(str(v1[1]))
    return tmp_path


@pytest.mark.parametrize("v2, v1, quota", [
    (None, None, None),                     # no cgroup files: the affinity mask alone
    ("max 100000\n", None, None),           # v2, unlimited
    ("150000 100000\n", None, 2),           # v2, 1.5 CPUs: rounded up
    ("50000 100000\n", None, 1),            # v2, half a CPU: at least one thread
    (None, (-1, 100000), None),             # v1, unlimited
    (None, (100000, 100000), 1),            # v1, one CPU
])
def test_available_cpus_is_the_affinity_mask_capped_by_the_quota(tmp_path, v2, v1, quota):
    cores = len(os.sched_getaffinity(0))
    expected = cores if quota is None else min(cores, quota)
    assert available_cpus(_cgroup(tmp_path, v2, v1)) == expected


def test_set_cpu_threads_says_how_many_and_why(monkeypatch, restore_threads):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    line = set_cpu_threads()
    assert torch.get_num_threads() == available_cpus()
    assert line.startswith(f"CPU threads: {available_cpus()} (the cores this process may use")
    assert "OMP_NUM_THREADS" in line  # how to choose another number

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert set_cpu_threads() == "CPU threads: 1 (from OMP_NUM_THREADS)" and torch.get_num_threads() == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "not-a-number")  # ignored, as torch ignores it
    assert set_cpu_threads().startswith(f"CPU threads: {available_cpus()} (the cores")
    assert set_cpu_threads(1) == "CPU threads: 1 (as asked)"
