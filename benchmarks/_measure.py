"""Timing and peak-memory helpers shared by the benchmarks (Linux /proc based)."""

from __future__ import annotations

import ctypes
import gc
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


def _status(key: str) -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(key):
                return int(line.split()[1]) * 1024.0
    raise RuntimeError(f"{key} not in /proc/self/status")


@contextmanager
def measured() -> Iterator[dict]:
    """Wall time and peak resident memory *above the level at entry* of the enclosed block.

    Peak = VmHWM after the block − VmRSS at entry, with the high-water mark reset at entry
    (``echo 5 > /proc/self/clear_refs``) and freed heap memory handed back to the OS first
    (``malloc_trim``), so memory the allocator kept from earlier work is not counted as free.
    """
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")
    rss0 = _status("VmRSS:")
    res: dict = {}
    t0 = time.perf_counter()
    try:
        yield res
    finally:
        res["seconds"] = time.perf_counter() - t0
        res["peak_bytes"] = _status("VmHWM:") - rss0


def best_of(f: Callable[[], Any], repeat: int = 1) -> tuple[float, Any]:
    """(minimum wall seconds over ``repeat`` calls of f, f's last result)."""
    best, out = float("inf"), None
    for _ in range(repeat):
        t = time.perf_counter()
        out = f()
        best = min(best, time.perf_counter() - t)
    return best, out


def peak_rss() -> float:
    """This process's peak resident memory (bytes, VmHWM)."""
    return _status("VmHWM:")
