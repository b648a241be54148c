"""A cumulative-bucket histogram kept in memory and exposed as Prometheus exposes it.

Shared by the simulated engine's metrics and the proxy's per-request accounting.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

# Request sizes in tokens (vLLM's request_prompt_tokens buckets, extended).
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


@dataclass
class Histogram:
    """Cumulative-bucket histogram, as Prometheus exposes it."""

    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.buckets)

    def observe(self, value: float) -> None:
        """Record one value."""
        index = bisect.bisect_left(self.buckets, value)
        if index < len(self.counts):
            self.counts[index] += 1
        self.total += value
        self.count += 1

    def cumulative(self) -> list[tuple[str, float]]:
        """``(le, cumulative count)`` pairs ending with ``+Inf``."""
        out: list[tuple[str, float]] = []
        running = 0
        for bound, n in zip(self.buckets, self.counts, strict=True):
            running += n
            out.append((repr(float(bound)), running))
        out.append(("+Inf", self.count))
        return out
