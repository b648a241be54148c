"""What every engine adapter shares: the scrape it reads, its shape, and a parsed exposition.

An adapter is pure: :class:`~kvguard.probes.engine.EngineProbe` does the HTTP and
hands it an :class:`EngineScrape`; the adapter maps that engine's metric names into
one normalized :class:`~kvguard.model.snapshot.EngineStats`. Exposition text is
parsed once, with ``prometheus_client``'s parser, into :class:`Samples`; a series
the engine does not export (renamed, removed, not yet observed) becomes ``None``,
never an exception.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from prometheus_client.parser import text_string_to_metric_families

from kvguard.errors import ProbeError
from kvguard.model.snapshot import EngineAction, EngineKind, EngineStats, HistogramSummary

PROBE_NAME = "engine"

Labels = dict[str, str]
Series = list[tuple[Labels, float]]

# Metric-name prefixes that identify an engine; checked in this order.
KIND_PREFIXES: tuple[tuple[EngineKind, str], ...] = (
    ("vllm", "vllm:"),
    ("sglang", "sglang:"),
    ("llamacpp", "llamacpp:"),
    ("trtllm", "nv_trt_llm_"),
    ("tgi", "tgi_"),
)


@dataclass(frozen=True)
class EngineScrape:
    """What one probe tick read from an engine, before any interpretation.

    ``metrics_text`` is the body of its metrics endpoint; ``slots`` and ``props``
    are llama.cpp's ``/slots`` and ``/props`` JSON when fetched and readable;
    ``healthy`` is false when the health endpoint did not answer 2xx.
    """

    metrics_text: str
    slots: list[dict[str, Any]] | None = None
    props: dict[str, Any] | None = None
    healthy: bool = True


class EngineAdapter(Protocol):
    """Maps one engine's metrics into :class:`EngineStats`.

    ``actions`` are the admin actions the engine offers (for the actuators);
    ``extra_paths`` are JSON endpoints to fetch beside the metrics (their bodies
    arrive as :attr:`EngineScrape.slots` / :attr:`EngineScrape.props`);
    ``health_path`` is the liveness endpoint. :meth:`parse` does no I/O.
    """

    kind: EngineKind
    actions: frozenset[EngineAction]
    extra_paths: tuple[str, ...]
    health_path: str

    def parse(self, scrape: EngineScrape) -> EngineStats:
        """Normalize one scrape; raises :class:`ProbeError` only for malformed text."""
        ...


class Samples:
    """Exposition text parsed once: sample name -> every (labels, value) under it.

    Non-finite values (``NaN``, ``±Inf``) are dropped: an engine reports NaN for
    "no data yet", which is "unknown" here. Lookups of absent names give ``None``.
    """

    def __init__(self, by_name: dict[str, Series]) -> None:
        self._by_name = by_name

    def names(self) -> Iterable[str]:
        """Every sample name present."""
        return self._by_name.keys()

    def series(self, name: str, **where: str) -> Series:
        """The samples named ``name`` whose labels include ``where`` (empty when absent)."""
        found = self._by_name.get(name, [])
        if not where:
            return list(found)
        return [(labels, v) for labels, v in found if _matches(labels, where)]

    def first_present(self, *names: str) -> str | None:
        """The first of ``names`` with at least one sample (for renamed series)."""
        return next((name for name in names if self._by_name.get(name)), None)

    def total(self, *names: str, **where: str) -> float | None:
        """Sum over label sets of the first present name (engines, ranks, reasons)."""
        name = self.first_present(*names)
        values = [v for _, v in self.series(name, **where)] if name else []
        return math.fsum(values) if values else None

    def highest(self, *names: str, **where: str) -> float | None:
        """Largest value over label sets of the first present name (the tightest engine)."""
        name = self.first_present(*names)
        values = [v for _, v in self.series(name, **where)] if name else []
        return max(values) if values else None

    def histogram(self, name: str) -> HistogramSummary | None:
        """Sum and count of a histogram, added over label sets; None unless both exist."""
        total, count = self.total(f"{name}_sum"), self.total(f"{name}_count")
        if total is None or count is None:
            return None
        return HistogramSummary(sum=total, count=count)


def _matches(labels: Labels, where: dict[str, str]) -> bool:
    return all(labels.get(key) == value for key, value in where.items())


def parse_exposition(text: str) -> Samples:
    """Parse Prometheus text exposition into :class:`Samples`.

    Raises :class:`ProbeError` (probe ``engine``) when the text is not valid
    exposition, e.g. an HTML error page or a truncated body.
    """
    by_name: dict[str, Series] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if math.isfinite(sample.value):
                    by_name.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    # The parser signals bad input with ValueError, but a few malformed shapes
    # surface as IndexError/KeyError/TypeError from inside it.
    except (ValueError, IndexError, KeyError, TypeError) as exc:
        raise ProbeError(PROBE_NAME, f"malformed metrics: {exc}") from exc
    return Samples(by_name)


def detect_kind_in(samples: Samples) -> EngineKind | None:
    """The engine whose metric-name prefix appears in ``samples``, or None."""
    names = list(samples.names())
    for kind, prefix in KIND_PREFIXES:
        if any(name.startswith(prefix) for name in names):
            return kind
    return None


def detect_kind(metrics_text: str) -> EngineKind | None:
    """The engine that produced ``metrics_text``, from its metric names; None if unknown.

    Raises :class:`ProbeError` when the text is not valid exposition.
    """
    return detect_kind_in(parse_exposition(metrics_text))


def as_int(value: float | str | None) -> int | None:
    """A count as an int; None for None or text that is not a number (``"None"``)."""
    if value is None:
        return None
    try:
        number = float(value)
    except ValueError:
        return None
    return round(number) if math.isfinite(number) else None


def ratio(part: float | None, whole: float | None) -> float | None:
    """``part / whole`` when both are known and ``whole`` is positive."""
    if part is None or whole is None or whole <= 0:
        return None
    return part / whole
