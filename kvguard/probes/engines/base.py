"""What every engine adapter shares: the scrape it reads, its shape, and a parsed exposition.

An adapter is pure: :class:`~kvguard.probes.engine.EngineProbe` does the HTTP and
hands it an :class:`EngineScrape`; the adapter maps that engine's metric names into
one normalized :class:`~kvguard.core.snapshot.EngineStats`. Exposition text is
parsed once, with ``prometheus_client``'s parser, into :class:`Samples`; a series
the engine does not export (renamed, removed, not yet observed) becomes ``None``,
never an exception. A series it exports with a garbage value (a ratio outside
[0, 1], a negative or non-finite count, ``1e308``) is a :class:`ProbeError` that
names the series: kvguard must not act on it as a reading.

That parser costs about 18 µs a series, and a data-parallel vLLM exports well over
a thousand series of which an adapter reads a few dozen. So each adapter declares
the sample names it reads (``reads``), and :func:`parse_exposition` first keeps
only their lines (:func:`keep_lines`); the parser still reads every line it gets.
"""

from __future__ import annotations

import json
import math
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from prometheus_client.parser import text_string_to_metric_families

from kvguard.core.snapshot import EngineAction, EngineKind, EngineStats, HistogramSummary
from kvguard.errors import ProbeError
from kvguard.probes.engines.exposition import (
    COMMENT_LINE,
    DESCRIPTOR_LINE,
    SAMPLE_LINE,
    names_for,
)
from kvguard.probes.engines.wanted import FamilyCache, parse_wanted

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
    ``healthy`` is false when the health endpoint did not answer 2xx. ``previous``
    is this probe's last reading, for an engine whose answer may carry no figures
    (trtllm-serve's empty list keeps the capacity it reported before). ``families`` is
    the probe's :class:`~kvguard.probes.engines.wanted.FamilyCache`: the families read
    that did not change since the last scrape are not parsed again.
    """

    metrics_text: str
    slots: list[dict[str, Any]] | None = None
    props: dict[str, Any] | None = None
    healthy: bool = True
    previous: EngineStats | None = None
    families: FamilyCache | None = None


class EngineAdapter(Protocol):
    """Maps one engine's metrics into :class:`EngineStats`.

    ``actions`` are the admin actions the engine offers (for the actuators);
    ``extra_paths`` are JSON endpoints to fetch beside the metrics (their bodies
    arrive as :attr:`EngineScrape.slots` / :attr:`EngineScrape.props`);
    ``health_path`` is the liveness endpoint; an adapter whose engine comes in
    servers with different ones also offers ``health_path_for(metrics_text)``
    (:func:`health_path_for`). ``reads`` names every sample
    :meth:`parse` looks up (as :class:`Samples` names them: counters with
    ``_total``, histograms as ``_sum``/``_count``); lines of other series are
    dropped before parsing, and ``None`` parses everything. :meth:`parse` does no I/O.
    """

    kind: EngineKind
    actions: frozenset[EngineAction]
    extra_paths: tuple[str, ...]
    health_path: str
    reads: frozenset[str] | None

    def parse(self, scrape: EngineScrape) -> EngineStats:
        """Normalize one scrape; raises :class:`ProbeError` only for malformed text."""
        ...


def health_path_for(adapter: EngineAdapter, metrics_text: str) -> str:
    """The liveness path of the server that answered ``metrics_text``.

    TensorRT-LLM comes behind Triton (``/v2/health/ready``) or trtllm-serve
    (``/health``), and only the metrics body tells which; other adapters have one path.
    """
    choose = getattr(adapter, "health_path_for", None)
    return str(choose(metrics_text)) if callable(choose) else adapter.health_path


# The largest count a series may report: past 2**53 a float no longer holds every
# integer, and products of such counts (blocks x block size) leave the float range.
# Real counts are far below it (a year of 10^5 tokens/s is about 3e12).
MAX_COUNT = 2.0**53
# Slack around a ratio's [0, 1] for an engine's float arithmetic (1 - free/total);
# a value inside it is clamped, one outside it is an error.
RATIO_SLACK = 1e-9


class Samples:
    """Exposition text parsed once: sample name -> every (labels, value) under it.

    :meth:`series` gives the values as the engine wrote them. The lookups adapters
    read with (:meth:`total`, :meth:`highest`, :meth:`histogram`, :meth:`ratios`,
    :meth:`highest_ratio`) check each value they use and raise :class:`ProbeError`
    naming the series when it is garbage: a count that is negative, not finite
    (``NaN``, ``±Inf``) or over :data:`MAX_COUNT`; a ratio outside [0, 1]. Lookups
    of absent names give ``None``.
    """

    def __init__(self, by_name: dict[str, Series]) -> None:
        self._by_name = by_name

    def names(self) -> Iterable[str]:
        """Every sample name present."""
        return self._by_name.keys()

    def series(self, name: str, **where: str) -> Series:
        """The samples named ``name`` whose labels include ``where`` (empty when absent).

        Unchecked: the values are the engine's, ``NaN`` and ``±Inf`` included.
        """
        found = self._by_name.get(name, [])
        if not where:
            return list(found)
        return [(labels, v) for labels, v in found if _matches(labels, where)]

    def first_present(self, *names: str) -> str | None:
        """The first of ``names`` with at least one sample (for renamed series)."""
        return next((name for name in names if self._by_name.get(name)), None)

    def total(self, *names: str, **where: str) -> float | None:
        """Sum over label sets of the first present name (engines, ranks, reasons).

        Every value summed must be a count; raises :class:`ProbeError` otherwise.
        """
        values = self._counts(names, where)
        return math.fsum(values) if values else None

    def highest(self, *names: str, **where: str) -> float | None:
        """Largest count over label sets of the first present name (the tightest engine)."""
        values = self._counts(names, where)
        return max(values) if values else None

    def ratios(self, name: str, **where: str) -> Series:
        """The samples of ``name``, each checked to be a ratio in [0, 1]."""
        return [
            (labels, check_ratio(name, labels, value))
            for labels, value in self.series(name, **where)
        ]

    def highest_ratio(self, *names: str, **where: str) -> float | None:
        """Largest ratio over label sets of the first present name; each must be in [0, 1]."""
        name = self.first_present(*names)
        values = [value for _, value in self.ratios(name, **where)] if name else []
        return max(values) if values else None

    def histogram(self, name: str) -> HistogramSummary | None:
        """Sum and count of a histogram, added over label sets; None unless both exist."""
        total, count = self.total(f"{name}_sum"), self.total(f"{name}_count")
        if total is None or count is None:
            return None
        return HistogramSummary(sum=total, count=count)

    def _counts(self, names: tuple[str, ...], where: dict[str, str]) -> list[float]:
        name = self.first_present(*names)
        if name is None:
            return []
        return [check_count(name, labels, value) for labels, value in self.series(name, **where)]


def check_count(name: str, labels: Labels, value: float) -> float:
    """``value`` when it is a count (finite, 0 to :data:`MAX_COUNT`); else :class:`ProbeError`.

    Engines' counts, counters, token and block figures are never negative; NaN or
    infinity is no count, and a figure past :data:`MAX_COUNT` overflows what is made of it.
    """
    if math.isfinite(value) and 0 <= value <= MAX_COUNT:
        return value
    raise ProbeError(
        PROBE_NAME,
        f"{_shown(name, labels)} is {value:g}: a count must be a finite number"
        f" from 0 to {MAX_COUNT:.0f}",
    )


def check_ratio(name: str, labels: Labels, value: float) -> float:
    """``value`` as a ratio, clamped to [0, 1] within :data:`RATIO_SLACK`; else a ProbeError."""
    if math.isfinite(value) and -RATIO_SLACK <= value <= 1 + RATIO_SLACK:
        return min(max(value, 0.0), 1.0)
    raise ProbeError(
        PROBE_NAME,
        f"{_shown(name, labels)} is {value:g}: a ratio must be a finite number in [0, 1]",
    )


def count_label(name: str, labels: Labels, key: str) -> int | None:
    """Label ``key`` of a sample of ``name``, read as a count (vLLM's ``num_gpu_blocks``).

    ``None`` when absent or not a number (vLLM writes ``"None"`` before it has
    profiled); :class:`ProbeError` when it is a number but no count (negative, not
    finite, over :data:`MAX_COUNT`).
    """
    text = labels.get(key)
    if text is None:
        return None
    try:
        number = float(text)
    except ValueError:
        return None
    if math.isfinite(number) and 0 <= number <= MAX_COUNT:
        return round(number)
    raise ProbeError(
        PROBE_NAME,
        f"{_shown(name, labels)}: label {key}={text[:40]!r} is not a count"
        f" (a finite number from 0 to {MAX_COUNT:.0f})",
    )


def _shown(name: str, labels: Labels) -> str:
    """A series as an error names it: its name and labels, cut to a readable length."""
    if not labels:
        return name
    text = ",".join(f'{key}="{value}"' for key, value in sorted(labels.items()))
    return f"{name}{{{text[:120] + '...' if len(text) > 120 else text}}}"


def histogram_names(*names: str) -> tuple[str, ...]:
    """The ``_sum`` and ``_count`` sample names of each histogram (what ``histogram()`` reads)."""
    return tuple(f"{name}{suffix}" for name in names for suffix in ("_sum", "_count"))


def _matches(labels: Labels, where: dict[str, str]) -> bool:
    return all(labels.get(key) == value for key, value in where.items())


# What keep_lines may drop: a HELP/TYPE line or a sample line of plain shape
# (kvguard/probes/engines/exposition.py). Anything else (an HTML page, a truncated
# line, quoted UTF-8 names, odd spacing) is kept, so the parser judges it exactly as
# it would without the filter.


def keep_lines(text: str, reads: Collection[str]) -> str:
    """The lines of ``text`` that can matter to an adapter reading the samples ``reads``.

    Kept: every sample line named in ``reads`` (or named without the ``_total`` the
    parser adds to counters), the ``# HELP``/``# TYPE`` lines of their families, and
    every line whose shape is not plainly a well-formed sample or descriptor, so a
    malformed body still fails to parse. Dropped: the other families' lines and
    plain comments. Families in real expositions are contiguous, so the kept lines parse
    to exactly the samples of ``reads`` that the whole text gives.
    """
    samples, families = names_for(reads)
    kept: list[str] = []
    for line in text.split("\n"):  # the parser splits on \n only, not on every line break
        if not line:
            continue
        if line[0] == "#":
            match = DESCRIPTOR_LINE.fullmatch(line)
            if match is None:
                if COMMENT_LINE.fullmatch(line) is None:
                    kept.append(line)
            elif (match.group(1) or match.group(2)) in families:
                kept.append(line)
            continue
        match = SAMPLE_LINE.fullmatch(line)
        if match is None or match.group(1) in samples:
            kept.append(line)
    kept.append("")
    return "\n".join(kept)


def parse_exposition(
    text: str, reads: Collection[str] | None = None, cache: FamilyCache | None = None
) -> Samples:
    """Parse Prometheus text exposition into :class:`Samples`.

    With ``reads``, only those samples' lines are parsed: by :func:`parse_wanted`
    when the page is plainly exposition (families nobody reads are skipped whole),
    else by ``prometheus_client`` after :func:`keep_lines`; the others are not in the
    result. Raises :class:`ProbeError` (probe ``engine``) when
    the text is not valid exposition, e.g. an HTML error page or a truncated body.
    """
    if reads is not None:
        # The common case (a well-formed page, a few families read) without
        # prometheus_client's per-character parse; anything else takes the strict path.
        fast = parse_wanted(text, reads, cache)
        if fast is not None:
            return Samples(fast)
        text = keep_lines(text, reads)
    by_name: dict[str, Series] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                # Non-finite values too: the lookups judge them, naming the series.
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

    A JSON list is trtllm-serve's iteration stats (no engine kvguard reads answers
    its metrics endpoint with one, and exposition text never starts with ``[``).
    Raises :class:`ProbeError` when the text is neither that nor valid exposition.
    """
    if metrics_text.lstrip().startswith("["):
        return "trtllm" if _is_json_list(metrics_text) else None
    return detect_kind_in(parse_exposition(metrics_text))


def _is_json_list(text: str) -> bool:
    try:
        body = json.loads(text)
    except (ValueError, RecursionError):
        return False
    return isinstance(body, list) and all(isinstance(item, dict) for item in body)


def as_int(value: float | str | None) -> int | None:
    """A count as an int; None for None or text that is not a number (``"None"``)."""
    if value is None:
        return None
    try:
        number = float(value)
    except (ValueError, OverflowError):  # OverflowError: an int past the float range
        return None
    return round(number) if math.isfinite(number) else None


def ratio(part: float | None, whole: float | None) -> float | None:
    """``part / whole`` when both are known and ``whole`` is positive."""
    if part is None or whole is None or whole <= 0:
        return None
    return part / whole
