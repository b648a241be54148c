"""What one load-generator run reports: counts, latency percentiles, goodput, preemptions."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvguard.core.snapshot import EngineStats
from kvguard.errors import ProbeError
from kvguard.probes.engines import ADAPTERS, EngineScrape, detect_kind


@dataclass(frozen=True)
class Percentiles:
    """Nearest-rank percentiles of a latency, in seconds."""

    p50: float
    p90: float
    p99: float
    max: float

    @classmethod
    def of(cls, values: list[float]) -> Percentiles | None:
        """Percentiles of ``values``; None when there are none."""
        if not values:
            return None
        ordered = sorted(values)

        def rank(q: float) -> float:
            return ordered[max(0, math.ceil(q * len(ordered)) - 1)]

        return cls(rank(0.50), rank(0.90), rank(0.99), ordered[-1])


@dataclass(frozen=True)
class ClassCounts:
    """Requests of one priority class: sent, and how each ended."""

    sent: int = 0
    succeeded: int = 0
    failed: int = 0
    shed: int = 0
    unfinished: int = 0


_SCALAR_FIELDS = (
    *("pattern", "seed", "model", "duration_s", "sent", "succeeded", "failed", "shed"),
    "unfinished",
    *("prompt_tokens", "completion_tokens", "slo_ttft_s", "slo_e2e_s", "goodput"),
    *("goodput_ratio", "preemptions", "kv_usage_peak", "kv_usage_mean", "waiting_peak"),
)


@dataclass(frozen=True)
class LoadReport:
    """The outcome of one run.

    Every sent request ends as exactly one of succeeded, failed, shed (HTTP 429
    or 503) or unfinished (still running when the run's grace period ended).
    Latencies are over succeeded requests (TTFT only when streaming). ``goodput``
    counts succeeded requests within both SLOs (TTFT is not judged without
    streaming) and ``goodput_ratio`` is that count over all sent requests. Token
    totals come from the server's ``usage`` objects. ``preemptions`` is the rise of
    the engine's preemption counter during the run, None when the server exposes
    none. ``kv_usage_peak``/``kv_usage_mean`` (0-1) and ``waiting_peak`` come from
    sampling the engine's gauges every half second during the run; None when it
    exposes none. ``status_counts`` keys are HTTP codes or ``connection_error``,
    ``timeout``, ``bad_response``, ``stream_error``, ``incomplete``, ``unfinished``.
    """

    pattern: str
    seed: int
    model: str
    duration_s: float
    sent: int
    succeeded: int
    failed: int
    shed: int
    unfinished: int
    by_priority: Mapping[str, ClassCounts]
    ttft_s: Percentiles | None
    e2e_s: Percentiles | None
    prompt_tokens: int
    completion_tokens: int
    slo_ttft_s: float
    slo_e2e_s: float
    goodput: int
    goodput_ratio: float | None
    preemptions: float | None
    status_counts: Mapping[str, int]
    kv_usage_peak: float | None = None
    kv_usage_mean: float | None = None
    waiting_peak: float | None = None

    def as_dict(self) -> dict[str, Any]:
        """The report as plain JSON-ready values."""

        def pct(p: Percentiles | None) -> dict[str, float] | None:
            return None if p is None else {"p50": p.p50, "p90": p.p90, "p99": p.p99, "max": p.max}

        data: dict[str, Any] = {name: getattr(self, name) for name in _SCALAR_FIELDS}
        data["by_priority"] = {
            name: {
                "sent": c.sent,
                "succeeded": c.succeeded,
                "failed": c.failed,
                "shed": c.shed,
                "unfinished": c.unfinished,
            }
            for name, c in self.by_priority.items()
        }
        data["ttft_s"] = pct(self.ttft_s)
        data["e2e_s"] = pct(self.e2e_s)
        data["status_counts"] = dict(self.status_counts)
        return data

    def _cache_line(self) -> str:
        if self.kv_usage_peak is None:
            return "n/a (no engine usage gauge)"
        mean = "n/a" if self.kv_usage_mean is None else f"{self.kv_usage_mean:.0%}"
        waiting = "n/a" if self.waiting_peak is None else f"{self.waiting_peak:g}"
        return f"usage peak {self.kv_usage_peak:.0%}  mean {mean}  waiting peak {waiting}"

    def render(self) -> str:
        """A short human-readable table of the report."""

        def pct(p: Percentiles | None) -> str:
            if p is None:
                return "n/a"
            return f"p50 {p.p50:.3f}  p90 {p.p90:.3f}  p99 {p.p99:.3f}  max {p.max:.3f}"

        ratio = "n/a" if self.goodput_ratio is None else f"{self.goodput_ratio:.1%}"
        preempt = "n/a (no engine counter)" if self.preemptions is None else f"{self.preemptions:g}"
        codes = ", ".join(f"{k}: {v}" for k, v in sorted(self.status_counts.items())) or "none"
        lines = [
            f"loadgen {self.pattern}  seed {self.seed}  model {self.model}"
            f"  {self.duration_s:.1f} s",
            f"Requests     sent {self.sent}  ok {self.succeeded}  shed {self.shed}"
            f"  failed {self.failed}  unfinished {self.unfinished}",
            f"{'  priority':<13}{'sent':>7}{'ok':>7}{'shed':>7}{'failed':>7}{'unfin.':>7}",
        ]
        lines += [
            f"  {name:<11}{c.sent:>7}{c.succeeded:>7}{c.shed:>7}{c.failed:>7}{c.unfinished:>7}"
            for name, c in self.by_priority.items()
        ]
        lines += [
            f"TTFT s       {pct(self.ttft_s)}",
            f"E2E s        {pct(self.e2e_s)}",
            f"Tokens       prompt {self.prompt_tokens:,}  completion {self.completion_tokens:,}",
            f"Goodput      {self.goodput} ({ratio} of sent; TTFT <= {self.slo_ttft_s:g} s,"
            f" E2E <= {self.slo_e2e_s:g} s)",
            f"Preemptions  {preempt}",
            f"KV cache     {self._cache_line()}",
            f"Status       {codes}",
        ]
        return "\n".join(lines)


def engine_reading(text: str) -> EngineStats | None:
    """The engine's figures in exposition ``text``, read by kvguard's own adapters.

    None when the text is not exposition or comes from no engine kvguard knows (a
    missing endpoint reads the same way). llama.cpp's KV use needs ``/slots``, so it
    stays unknown here.
    """
    try:
        kind = detect_kind(text)
        return None if kind is None else ADAPTERS[kind].parse(EngineScrape(text))
    except ProbeError:
        return None


def preemptions_in(text: str) -> float | None:
    """The engine's preemption counter in ``text`` (summed over engines), None if absent."""
    reading = engine_reading(text)
    return None if reading is None else reading.preemptions_total
