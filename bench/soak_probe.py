"""What the soak reads from the server between rounds: memory of its process tree, engine metrics.

Memory is read per process of the tritonserver tree (the server and its python-backend stubs),
because a leak in the model shows in the stub and one in Triton's request handling in the
server. RSS counts the shared-memory region the two exchange tensors through in both processes,
so PSS (each shared page split between its users) is summed for the tree total as well.
"""

from __future__ import annotations

import time
import urllib.request
from typing import Any

import psutil

IDLE_GAUGES = ("trtforge_kv_blocks_used", "trtforge_requests_running", "trtforge_requests_waiting")
"""Gauges that must read 0 once every request has been answered (or cut) and the engine caught up."""


def _one(proc: psutil.Process) -> dict[str, Any]:
    with proc.oneshot():
        full = proc.memory_full_info()
        return {"pid": proc.pid, "name": proc.name(), "rss_mib": full.rss / 2**20,
                "pss_mib": full.pss / 2**20, "uss_mib": full.uss / 2**20,
                "threads": proc.num_threads(), "fds": proc.num_fds()}


def tree_memory(pid: int) -> dict[str, Any]:
    """Memory of `pid` and all its descendants: per process, and RSS/PSS summed."""
    root = psutil.Process(pid)
    procs = []
    for proc in [root, *root.children(recursive=True)]:
        try:
            procs.append(_one(proc))
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return {"processes": procs,
            "rss_mib": sum(p["rss_mib"] for p in procs),
            "pss_mib": sum(p["pss_mib"] for p in procs)}


def read_metrics(url: str) -> dict[str, float]:
    """The trtforge_* samples on Triton's metrics port, by name (histogram buckets left out)."""
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    values = {}
    for line in text.splitlines():
        if line.startswith("trtforge_") and "_bucket{" not in line:
            name, value = line.rsplit(" ", 1)
            values[name.split("{")[0]] = float(value)
    return values


def wait_idle(url: str, timeout_s: float, poll_s: float = 0.2) -> tuple[bool, float, dict[str, float]]:
    """Poll until the idle gauges read 0: (idle, seconds waited, last metrics)."""
    start = time.monotonic()
    while True:
        metrics = read_metrics(url)
        idle = all(metrics.get(g, -1) == 0 for g in IDLE_GAUGES)
        if idle or time.monotonic() - start > timeout_s:
            return idle, time.monotonic() - start, metrics
        time.sleep(poll_s)
