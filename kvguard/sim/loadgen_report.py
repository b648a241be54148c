"""What one load-generator run reports: outcomes, latency percentiles, SLO attainment, preemptions.

Pure: the outcome of each request goes in, the figures come out. The definitions
(good request, clamped, TPOT) are public contract, documented in docs/simulator.md.
"""

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


# How a sent request can end; every sent request ends as exactly one of these.
OUTCOME_KINDS = ("completed", "shed", "refused", "failed", "unfinished")


@dataclass(frozen=True)
class RequestOutcome:
    """How one sent request ended, as its client saw it.

    ``kind`` is one of :data:`OUTCOME_KINDS`: *completed* (a 2xx whose answer
    finished), *shed* (429 or 503, after any retries), *refused* (any other 4xx:
    kvguard's window cap, or the engine's own 400), *failed* (another 5xx, a
    timeout, a connection error, a broken or unreadable answer) or *unfinished*
    (cut off by the run). ``ttft_s`` and ``e2e_s`` are measured from the request's
    *scheduled* send time, so time spent waiting for a client slot or a retry
    counts. ``max_tokens`` is what the client last sent, ``output_tokens`` the
    request's true length, ``finish_reason`` the engine's last one, ``retries`` how
    often it was sent again after a 429/503 with ``Retry-After``.
    """

    priority: str
    status: str
    kind: str
    ttft_s: float | None = None
    e2e_s: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str | None = None
    max_tokens: int = 0
    output_tokens: int = 0
    streamed: bool = True
    retries: int = 0

    @property
    def completed(self) -> bool:
        """A 2xx whose answer finished."""
        return self.kind == "completed"

    @property
    def clamped(self) -> bool:
        """Completed, but cut short by someone who lowered ``max_tokens`` (kvguard's clamp).

        The answer ended on its length limit with fewer tokens than the client asked
        for and than the request's true length: neither the client nor the model
        stopped it.
        """
        return (
            self.completed
            and self.finish_reason == "length"
            and self.completion_tokens < self.max_tokens
            and self.completion_tokens < self.output_tokens
        )

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token of a completed request; None for any other.

        Streamed: ``(e2e - ttft) / (completion_tokens - 1)``, 0 for one token. Not
        streamed there is no first token to see: ``e2e / completion_tokens``.
        """
        if not self.completed or self.e2e_s is None:
            return None
        tokens = self.completion_tokens
        if not self.streamed:
            return self.e2e_s / tokens if tokens > 0 else 0.0
        if tokens <= 1:
            return 0.0
        ttft = self.ttft_s if self.ttft_s is not None else self.e2e_s
        return max(0.0, self.e2e_s - ttft) / (tokens - 1)


@dataclass(frozen=True)
class Slo:
    """The service-level objective a *good* request meets.

    Good: completed, not clamped, TTFT <= ``ttft_s`` and TPOT <= ``tpot_s`` and, when
    ``e2e_s`` is set, end-to-end latency <= ``e2e_s``. Without streaming no first token
    is seen: the whole answer must then have come by the time a streamed one meeting
    both bounds would have ended, ``ttft_s + tpot_s * (completion_tokens - 1)``.
    """

    ttft_s: float = 2.0
    tpot_s: float = 0.1
    e2e_s: float | None = None

    def met(self, outcome: RequestOutcome) -> bool:
        """Whether ``outcome`` is good."""
        tpot = outcome.tpot_s
        if tpot is None or outcome.e2e_s is None or outcome.clamped:
            return False
        if self.e2e_s is not None and outcome.e2e_s > self.e2e_s:
            return False
        if not outcome.streamed:
            tokens = max(outcome.completion_tokens, 1)
            return outcome.e2e_s <= self.ttft_s + self.tpot_s * (tokens - 1)
        ttft = outcome.ttft_s if outcome.ttft_s is not None else outcome.e2e_s
        if ttft > self.ttft_s:
            return False
        return tpot <= self.tpot_s


def _p99(values: list[float]) -> float | None:
    found = Percentiles.of(values)
    return None if found is None else found.p99


@dataclass(frozen=True)
class ClassCounts:
    """Requests of one priority class (or of all): how each ended, and how many were good.

    ``sent`` = ``succeeded`` + ``shed`` + ``refused`` + ``failed`` + ``unfinished``
    (``completed`` is ``succeeded``); ``clamped`` requests are completed but never
    good. Token sums and p99s are over completed requests; ``goodput_tokens`` over
    good ones.
    """

    sent: int = 0
    succeeded: int = 0
    failed: int = 0
    shed: int = 0
    unfinished: int = 0
    refused: int = 0
    clamped: int = 0
    slo_met: int = 0
    goodput_tokens: int = 0
    completion_tokens: int = 0
    requested_max_tokens: int = 0
    retries: int = 0
    ttft_p99_s: float | None = None
    tpot_p99_s: float | None = None

    @classmethod
    def of(cls, outcomes: list[RequestOutcome], slo: Slo) -> ClassCounts:
        """The counts of ``outcomes`` judged against ``slo``."""
        done = [o for o in outcomes if o.completed]
        good = [o for o in done if slo.met(o)]
        kinds = {kind: sum(o.kind == kind for o in outcomes) for kind in OUTCOME_KINDS}
        return cls(
            sent=len(outcomes),
            succeeded=kinds["completed"],
            failed=kinds["failed"],
            shed=kinds["shed"],
            unfinished=kinds["unfinished"],
            refused=kinds["refused"],
            clamped=sum(o.clamped for o in done),
            slo_met=len(good),
            goodput_tokens=sum(o.completion_tokens for o in good),
            completion_tokens=sum(o.completion_tokens for o in done),
            requested_max_tokens=sum(o.max_tokens for o in done),
            retries=sum(o.retries for o in outcomes),
            ttft_p99_s=_p99([o.ttft_s for o in done if o.ttft_s is not None]),
            tpot_p99_s=_p99([t for o in done if (t := o.tpot_s) is not None]),
        )

    @property
    def completed(self) -> int:
        """Requests whose answer finished (the same as ``succeeded``)."""
        return self.succeeded

    @property
    def slo_attainment(self) -> float | None:
        """Share of sent requests that were good; None when none was sent."""
        return self.slo_met / self.sent if self.sent else None

    def as_dict(self) -> dict[str, Any]:
        """The counts as plain JSON-ready values."""
        return {
            "sent": self.sent,
            "succeeded": self.succeeded,
            "completed": self.completed,
            "failed": self.failed,
            "shed": self.shed,
            "refused": self.refused,
            "unfinished": self.unfinished,
            "clamped": self.clamped,
            "slo_met": self.slo_met,
            "slo_attainment": self.slo_attainment,
            "goodput_tokens": self.goodput_tokens,
            "completion_tokens": self.completion_tokens,
            "requested_max_tokens": self.requested_max_tokens,
            "ttft_p99_s": self.ttft_p99_s,
            "tpot_p99_s": self.tpot_p99_s,
            "retries": self.retries,
        }


_SCALAR_FIELDS = (
    *("pattern", "seed", "model", "duration_s", "sent", "succeeded", "completed", "failed"),
    *("shed", "refused", "unfinished", "clamped", "prompt_tokens", "completion_tokens"),
    *("requested_max_tokens", "slo_ttft_s", "slo_tpot_s", "slo_e2e_s", "goodput"),
    *("goodput_ratio", "slo_met", "slo_attainment", "goodput_tokens", "ttft_p99_s"),
    *("tpot_p99_s", "retries", "retries_allowed", "client_max_tokens", "output_length"),
    *("trace", "speed", "start_s"),
    *("preemptions", "kv_usage_peak", "kv_usage_mean", "waiting_peak"),
)


@dataclass(frozen=True)
class LoadReport:
    """The outcome of one run.

    Every sent request ends as exactly one of succeeded (= completed), shed (429 or
    503 after any retries), refused (other 4xx), failed or unfinished (still
    running when the run's grace period ended); see :class:`RequestOutcome`.
    Latencies are over completed requests, measured from each request's scheduled
    send time (TTFT only when streaming). A request is *good* when it meets the
    :class:`Slo` (completed, not clamped, TTFT, TPOT and the optional end-to-end
    bound): ``slo_met`` (= ``goodput``) counts them, ``slo_attainment`` (=
    ``goodput_ratio``) is that count over all sent, ``goodput_tokens`` their output
    tokens. Token totals come from the server's ``usage`` objects.
    ``requested_max_tokens`` sums the ``max_tokens`` completed requests asked for.
    ``preemptions`` is the rise of the engine's preemption counter during the run,
    None when the server exposes none. ``kv_usage_peak``/``kv_usage_mean`` (0-1) and
    ``waiting_peak`` come from sampling the engine's gauges every half second during
    the run; None when it exposes none. ``status_counts`` keys are HTTP codes or
    ``connection_error``, ``timeout``, ``bad_response``, ``stream_error``,
    ``incomplete``, ``unfinished``. ``client_max_tokens`` is an int or ``"trace"``,
    ``output_length`` how the engine learnt each request's true length
    (``sim-field`` or ``ignore-eos``), ``trace`` the replayed file's name (None for a
    synthetic pattern).
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
    slo_e2e_s: float | None
    goodput: int
    goodput_ratio: float | None
    preemptions: float | None
    status_counts: Mapping[str, int]
    kv_usage_peak: float | None = None
    kv_usage_mean: float | None = None
    waiting_peak: float | None = None
    refused: int = 0
    clamped: int = 0
    goodput_tokens: int = 0
    requested_max_tokens: int = 0
    tpot_s: Percentiles | None = None
    ttft_p99_s: float | None = None
    tpot_p99_s: float | None = None
    retries: int = 0
    slo_tpot_s: float = 0.1
    client_max_tokens: int | str = 2048
    retries_allowed: int = 0
    output_length: str = "ignore-eos"
    trace: str | None = None
    speed: float = 1.0
    start_s: float = 0.0

    @property
    def completed(self) -> int:
        """Requests whose answer finished (the same as ``succeeded``)."""
        return self.succeeded

    @property
    def slo_met(self) -> int:
        """Good requests (the same as ``goodput``)."""
        return self.goodput

    @property
    def slo_attainment(self) -> float | None:
        """Good requests over sent ones (the same as ``goodput_ratio``)."""
        return self.goodput_ratio

    def as_dict(self) -> dict[str, Any]:
        """The report as plain JSON-ready values."""

        def pct(p: Percentiles | None) -> dict[str, float] | None:
            return None if p is None else {"p50": p.p50, "p90": p.p90, "p99": p.p99, "max": p.max}

        data: dict[str, Any] = {name: getattr(self, name) for name in _SCALAR_FIELDS}
        data["by_priority"] = {name: c.as_dict() for name, c in self.by_priority.items()}
        data["ttft_s"] = pct(self.ttft_s)
        data["tpot_s"] = pct(self.tpot_s)
        data["e2e_s"] = pct(self.e2e_s)
        data["status_counts"] = dict(self.status_counts)
        return data

    def _cache_line(self) -> str:
        if self.kv_usage_peak is None:
            return "n/a (no engine usage gauge)"
        mean = "n/a" if self.kv_usage_mean is None else f"{self.kv_usage_mean:.0%}"
        waiting = "n/a" if self.waiting_peak is None else f"{self.waiting_peak:g}"
        return f"usage peak {self.kv_usage_peak:.0%}  mean {mean}  waiting peak {waiting}"

    def _slo_text(self) -> str:
        parts = [f"TTFT <= {self.slo_ttft_s:g} s", f"TPOT <= {self.slo_tpot_s:g} s"]
        if self.slo_e2e_s is not None:
            parts.append(f"E2E <= {self.slo_e2e_s:g} s")
        return ", ".join(parts) + ", not clamped"

    def _class_lines(self) -> list[str]:
        lines = [
            f"{'  priority':<13}{'sent':>7}{'ok':>7}{'shed':>7}{'refus.':>7}{'failed':>7}"
            f"{'unfin.':>7}{'clamp.':>7}{'SLO met':>9}"
        ]
        for name, c in self.by_priority.items():
            share = "n/a" if c.slo_attainment is None else f"{c.slo_attainment:.1%}"
            lines.append(
                f"  {name:<11}{c.sent:>7}{c.succeeded:>7}{c.shed:>7}{c.refused:>7}{c.failed:>7}"
                f"{c.unfinished:>7}{c.clamped:>7}{share:>9}"
            )
        return lines

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
        ]
        if self.trace is not None:
            lines.append(
                f"Trace        {self.trace}  from {self.start_s:g} s  speed x{self.speed:g}"
            )
        lines += [
            f"Client       max_tokens {self.client_max_tokens}  output length"
            f" {self.output_length}  retries up to {self.retries_allowed}",
            f"Requests     sent {self.sent}  ok {self.succeeded}  shed {self.shed}"
            f"  failed {self.failed}  refused {self.refused}  unfinished {self.unfinished}"
            f"  clamped {self.clamped}  retries {self.retries}",
            *self._class_lines(),
            f"TTFT s       {pct(self.ttft_s)}",
            f"TPOT s       {pct(self.tpot_s)}",
            f"E2E s        {pct(self.e2e_s)}",
            f"Tokens       prompt {self.prompt_tokens:,}  completion {self.completion_tokens:,}"
            f"  good {self.goodput_tokens:,}  max_tokens asked {self.requested_max_tokens:,}",
            f"Goodput      {self.goodput} ({ratio} of sent; {self._slo_text()})",
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
