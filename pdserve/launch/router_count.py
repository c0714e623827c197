"""How many router processes `pdserve up` runs unless told: one per 16 usable cores, 1 to 8.

Usable cores: the process's CPU affinity (a cpuset), capped by a cgroup v2 CPU quota (a
Kubernetes CPU limit), which affinity does not show.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CORES_PER_ROUTER, MAX_ROUTERS = 16, 8


def default_router_processes(cpu_count: int) -> int:
    """One router process per 16 cores, 1 to 8: a router saturates one core at several
    decode workers' token rate; the rest of the machine is the workers' (or other pods')."""
    return max(1, min(MAX_ROUTERS, cpu_count // CORES_PER_ROUTER))


def available_cpus(cgroup_cpu_max: str = "/sys/fs/cgroup/cpu.max") -> int:
    """The cores this process may use: its CPU affinity (a cpuset), capped by a cgroup v2 CPU
    quota (a Kubernetes CPU limit), which affinity does not show."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    try:
        quota = cpu_quota(Path(cgroup_cpu_max).read_text())
    except OSError:  # no cgroup v2 CPU controller here
        quota = None
    return cpus if quota is None else max(1, min(cpus, math.ceil(quota)))


def cpu_quota(cpu_max: str) -> float | None:
    """Cores a cgroup v2 `cpu.max` ("<quota> <period>" or "max <period>") allows; None: no
    limit."""
    quota, _, period = cpu_max.strip().partition(" ")
    if quota == "max" or not period:
        return None
    return int(quota) / int(period)
