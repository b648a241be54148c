"""The ``requests_shed`` log line: what the proxy shed, summed, at most once a while.

One line per shed request would flood the log in a burst (thousands a second), and
none at all leaves an operator no trace of why clients got 503s: the counters tell
how many, not why. So the daemon asks each tick (:meth:`ShedLog.due`): the first shed
since kvguard started is logged at once, then the sheds since are summed into one
line at most every :data:`SHED_LOG_EVERY_S` while shedding goes on, once more on the
first tick that sheds nothing new (so the tail of a burst is not left unsaid), and
when kvguard stops. Each line names the classes and reasons, and the last shed
request's figures (what its 503 said).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from kvguard.actuators.proxy.settings import ProxyCounters

# A burst of sheds is one line per 10 s however many thousands it refuses: short enough
# to follow a burst as it goes, long enough that a long one stays a handful of lines.
SHED_LOG_EVERY_S = 10.0


class ShedLog:
    """When to write a ``requests_shed`` line, and what it says (the caller logs it)."""

    def __init__(self, counters: ProxyCounters, every_s: float = SHED_LOG_EVERY_S) -> None:
        self._counters = counters
        self.every_s = every_s
        self._logged: Counter[tuple[str, str]] = Counter(counters.shed)
        self._logged_at: float | None = None
        self._seen_total = sum(counters.shed.values())

    def due(self, now: float, *, final: bool = False) -> dict[str, Any] | None:
        """The fields of the line to write at ``now`` (monotonic seconds), or None.

        None while nothing was shed since the last line, or while shedding goes on
        and the last line is younger than :attr:`every_s`. ``final`` (kvguard stops):
        whatever was not said yet, now.
        """
        shed = self._counters.shed
        total = sum(shed.values())
        still_shedding = total != self._seen_total
        self._seen_total = total
        new = (
            Counter({key: count - self._logged[key] for key, count in shed.items()}) - Counter()
        )  # drops the keys with nothing new
        if not new:
            return None
        recent = self._logged_at is not None and now - self._logged_at < self.every_s
        if still_shedding and recent and not final:
            return None
        by_priority: Counter[str] = Counter()
        by_reason: Counter[str] = Counter()
        for (priority, reason), count in new.items():
            by_priority[priority] += count
            by_reason[reason] += count
        fields: dict[str, Any] = {
            "shed": sum(new.values()),
            "by_priority": dict(sorted(by_priority.items())),
            "by_reason": dict(sorted(by_reason.items())),
            "since_last_line_s": None
            if self._logged_at is None
            else round(now - self._logged_at, 1),
        }
        last = self._counters.last_shed
        if last is not None:
            fields |= {
                "last_priority": last.priority,
                "last_reason": last.reason,
                "last_detail": last.detail,
            }
        self._logged = Counter(shed)
        self._logged_at = now
        return fields
