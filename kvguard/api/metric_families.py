"""Small builders for Prometheus metric families (shared by the collectors)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric


def gauge(name: str, doc: str, value: float | None) -> Iterator[Metric]:
    """One unlabelled gauge, or nothing when the value is unknown (absent, never 0)."""
    if value is not None:
        yield GaugeMetricFamily(name, doc, value=value)


def counter_family(
    name: str, doc: str, labels: list[str], counts: Mapping[Any, float]
) -> CounterMetricFamily:
    """A labelled counter family from a Counter keyed by one label value or a tuple of them."""
    family = CounterMetricFamily(name, doc, labels=labels)
    for key, count in sorted(counts.items()):
        family.add_metric(list(key) if isinstance(key, tuple) else [key], count)
    return family
