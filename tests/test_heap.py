"""Freed heap memory goes back to the kernel (runtime/heap.py), once a minute from the daemon."""

from __future__ import annotations

import psutil
import pytest

from kvguard.config.settings import parse_config
from kvguard.probes.engine import EngineProbe
from kvguard.runtime.daemon import Daemon
from kvguard.runtime.heap import TRIM_EVERY_S, can_trim, trim_heap
from kvguard.runtime.probing import Probes


@pytest.mark.skipif(not can_trim(), reason="this C library has no malloc_trim (not glibc)")
def test_a_trim_gives_fragmented_free_memory_back():
    """64 MiB freed between 64 MiB kept stays resident until the trim releases it."""
    process = psutil.Process()
    # Under glibc's mmap threshold, so from the heap; every other one is freed, and
    # the kept ones between them stop the heap from shrinking by itself.
    chunks = [bytes(64 * 1024) for _ in range(2000)]
    kept = chunks[1::2]
    del chunks
    resident = process.memory_info().rss
    assert trim_heap()
    assert resident - process.memory_info().rss > 32 * 2**20
    assert len(kept) == 1000  # alive until here


def test_the_daemon_trims_once_a_minute_by_its_clock():
    """maybe_trim_heap calls the trim when TRIM_EVERY_S passed since the last one, not before."""
    now = [1000.0]
    config = parse_config({"engine": {"url": "http://127.0.0.1:1"}}, env={})
    daemon = Daemon(
        config,
        probes=Probes(engine=EngineProbe(config.engine.url), nvml=None, host=None),
        clock=lambda: now[0],
    )
    trims: list[float] = []
    daemon.trim_heap = lambda: trims.append(now[0]) is None
    for at in (1000.0, 1030.0, 1059.9, 1060.0, 1061.0, 1119.0, 1125.0):
        now[0] = at
        daemon.maybe_trim_heap()
    assert trims == [1000.0 + TRIM_EVERY_S, 1125.0]
