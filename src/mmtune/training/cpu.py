"""CPU threads of a run on the CPU: as many as the cores this process may really use.

torch starts one intra-op thread per core it sees, but in a container or under a CPU
quota it sees the host's cores, not the ones it may run on: 64 threads on 2 allowed
cores spend most of their time waiting for each other. :func:`set_cpu_threads` uses the
cores of the process's affinity mask, capped by the cgroup CPU quota, unless
``OMP_NUM_THREADS`` (or an explicit count) says otherwise, and returns a line saying
what it chose and why, for the run's start-up output.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Optional

__all__ = ["available_cpus", "set_cpu_threads"]


def _cgroup_quota(root: Path = Path("/sys/fs/cgroup")) -> Optional[float]:
    """CPUs allowed by a cgroup v2 (``cpu.max``) or v1 (``cpu.cfs_quota_us``) quota; None if unlimited."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return None if quota <= 0 else quota / period
    except (OSError, ValueError):
        return None


def available_cpus(cgroup_root: Path = Path("/sys/fs/cgroup")) -> int:
    """Cores this process may run on: its affinity mask, capped by the cgroup quota (at least 1)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    quota = _cgroup_quota(cgroup_root)
    if quota is not None:
        cores = min(cores, max(1, math.ceil(quota)))
    return max(1, cores)


def set_cpu_threads(threads: Optional[int] = None) -> str:
    """Set torch's intra-op threads and return the line that says how many and why.

    Args:
        threads: a count to use; ``None``: ``$OMP_NUM_THREADS`` when set, else
            :func:`available_cpus`.
    """
    import torch

    if threads is not None:
        why = "as asked"
    elif os.environ.get("OMP_NUM_THREADS", "").strip().isdigit() and int(os.environ["OMP_NUM_THREADS"]) > 0:
        threads, why = int(os.environ["OMP_NUM_THREADS"]), "from OMP_NUM_THREADS"
    else:
        threads = available_cpus()
        why = f"the cores this process may use, of {os.cpu_count()} on the machine; set OMP_NUM_THREADS to change"
    torch.set_num_threads(threads)
    return f"CPU threads: {threads} ({why})"
