"""Traffic pattern: which kind of load the engine has been serving lately.

The ladder (docs/how-it-works.md, "Policy: the ladder") picks its first mitigation
by traffic pattern, because a few very long conversations and thousands of short
bursty requests stress different limits even at the same token throughput. :func:`classify`
reads the ticks of the last ``window_s`` seconds (default 60) and names one of
five patterns. It is pure and deterministic; every number it used comes back in
:attr:`PatternReading.features` for ``/status`` and the logs.

Features, all from differences of the engine's counters inside the window (a
counter that falls means the engine restarted: only the ticks from the restart
on are used):

* **request size**: mean prompt and generation tokens per finished request, from
  the ``request_prompt_tokens`` / ``request_generation_tokens`` histograms' sum
  and count; without histograms, token counters over finished requests.
* **prompt/generation split**: prompt tokens over generation tokens processed
  (``prompt_tokens_total`` / ``generation_tokens_total``), i.e. how many tokens
  were prefilled per token decoded.
* **arrivals** per tick: requests that entered the engine = growth of running +
  waiting + requests finished in the tick (the engine counts no arrivals itself).
  Burstiness is their **dispersion**, variance over mean of the per-tick counts
  (each tick's expected count scaled by its length, since the daemon polls faster
  under pressure): 1 for independent (Poisson) arrivals at any rate, about the
  burst size when requests come in bursts. The coefficient of variation is
  reported too, but not used: for Poisson arrivals it is ``1/sqrt(mean)`` and so
  reads as "bursty" for any slow stream.
* **concurrency**: mean running (+ waiting) requests; **KV per running request**:
  KV tokens in use over running requests, also as a share of the pool.

Rules, tried in this order; the first whose every condition holds names the
pattern (thresholds are :class:`PatternThresholds` fields):

1. ``bursty_short``: short requests (mean prompt + generation at most
   ``bursty_max_request_tokens``) arriving in bursts (arrival dispersion at least
   ``bursty_min_arrival_dispersion``).
2. ``prefill_heavy``: long prompts (mean prompt at least ``long_prompt_tokens``)
   and prefill dominating the token split (prompt over generation tokens at least
   ``prefill_min_prompt_ratio``).
3. ``decode_heavy``: long answers (mean generation at least
   ``decode_min_generation_tokens``) and decode dominating the split (generation
   over prompt tokens at least ``decode_min_generation_ratio``).
4. ``long_context``: long prompts (mean prompt at least ``long_prompt_tokens``:
   the history a conversation carries) with answers too long for rule 2, whose
   sequences each hold a large share of the KV pool (KV tokens per running
   request at least ``long_context_min_kv_share`` of capacity; this condition is
   skipped when the capacity is unknown).
5. ``steady``: none of the above.

With fewer than ``min_ticks`` ticks or ``min_requests`` requests seen in the
window (in the engine when it opened, plus arrivals; finished requests where
arrivals cannot be told), the answer is ``steady`` with confidence 0.

Confidence: each condition's margin is how far its feature sits beyond its
threshold, as a log ratio; a rule's margin is its weakest condition's. A named
pattern scores ``0.5 + 0.5 * min(1, margin / ln(full_confidence_factor))`` (just
over the line: 0.5; a factor 2 beyond it: 1). ``steady`` scores the same on the
distance of the nearest rule from firing, and at most 0.5 when some rule could
not be ruled out for lack of data. Both are scaled by
``min(1, ticks / (3 * min_ticks))``, so a short history never reads as certain.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from types import MappingProxyType
from typing import Literal

from kvguard.core.series import TickSample
from kvguard.errors import InvalidInputError

TrafficPattern = Literal["long_context", "bursty_short", "prefill_heavy", "decode_heavy", "steady"]
TRAFFIC_PATTERNS: tuple[TrafficPattern, ...] = (
    "long_context",
    "bursty_short",
    "prefill_heavy",
    "decode_heavy",
    "steady",
)

# Counters whose fall marks an engine restart (each is cumulative since start).
_COUNTERS = (
    "prompt_tokens_total",
    "generation_tokens_total",
    "requests_finished_total",
    "preemptions_total",
    "prompt_tokens_sum",
    "prompt_tokens_count",
    "generation_tokens_sum",
    "generation_tokens_count",
)


@dataclass(frozen=True)
class PatternThresholds:
    """Every threshold of the classifier, with the reasoning behind its default.

    Sizes are in tokens. The defaults sit on boundaries an operator would name,
    between the traffic shapes of docs/how-it-works.md ("What goes wrong");
    tests/core/test_pattern.py checks them on recorded runs of every loadgen
    pattern (tests/fixtures/patterns/).
    """

    window_s: float = 60.0
    """Seconds of history classified: long enough to hold several bursts and many
    requests, short enough to follow a change of traffic within a minute."""

    min_ticks: int = 10
    """Fewer ticks than this (5 s at the default poll) is not a pattern yet."""

    min_requests: int = 5
    """Fewer requests seen than this (present at the start, plus arrivals) is not a
    pattern: a mean size or an arrival spread of so few means nothing."""

    bursty_max_request_tokens: float = 1024.0
    """``bursty_short`` requests are short: mean prompt + generation below 1k tokens
    (chat turns, classification, tool calls); longer requests are judged by size."""

    bursty_min_arrival_dispersion: float = 8.0
    """Arrival variance over mean per tick. Independent arrivals give 1 at any
    rate; bursts of B requests give about B. Eight allows for the clumping that
    queueing and batching add to smooth traffic while far below real bursts."""

    long_prompt_tokens: float = 1024.0
    """A long prompt: a mean of at least 1k tokens (documents, RAG contexts,
    conversation histories), against a few hundred for chat turns and tool calls.
    Shared by ``prefill_heavy`` and ``long_context``, which the split tells apart."""

    prefill_min_prompt_ratio: float = 30.0
    """At least 30 prompt tokens prefilled per generated token: answers of a few
    dozen tokens against prompts of thousands (summaries, extraction, scoring).
    Multi-turn chat with long histories reads 10-20 (answers of hundreds of
    tokens on histories of thousands): that is ``long_context``."""

    decode_min_generation_tokens: float = 256.0
    """``decode_heavy`` answers are long: a mean of at least 256 generated tokens
    (long-form writing, code, reasoning), so the cache grows during decode."""

    decode_min_generation_ratio: float = 2.0
    """At least two tokens generated per prompt token: the cache fills by decode,
    not prefill; chat, even with long histories, generates fewer tokens than it reads."""

    long_context_min_kv_share: float = 0.1
    """Each running sequence holds at least a tenth of the KV pool on average, so
    ten of them fill it: a few sequences own the cache. Moderate requests hold
    under 5% of a pool sized for the model's context length."""

    full_confidence_factor: float = 2.0
    """A feature this many times beyond its threshold gives full confidence."""

    def __post_init__(self) -> None:
        for spec in fields(self):
            value = getattr(self, spec.name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise InvalidInputError(spec.name, value, "must be a number > 0")
        if self.full_confidence_factor <= 1:
            raise InvalidInputError(
                "full_confidence_factor", self.full_confidence_factor, "must be > 1"
            )


DEFAULT_THRESHOLDS = PatternThresholds()


@dataclass(frozen=True)
class PatternReading:
    """The pattern of the recent window, how sure the classifier is, and why.

    ``confidence`` is in 0-1 (0: not enough data to say). ``features`` holds every
    input the decision used, by name, None where the window could not tell.
    """

    pattern: TrafficPattern
    confidence: float
    features: Mapping[str, float | None]


def classify(
    samples: Sequence[TickSample], thresholds: PatternThresholds = DEFAULT_THRESHOLDS
) -> PatternReading:
    """Name the traffic pattern of the ticks within ``window_s`` of the newest one.

    ``samples`` are in time order, oldest first (they are sorted by ``t`` in any
    case). Deterministic: the same samples and thresholds give the same reading.
    """
    window, restarts = _window(samples, thresholds.window_s)
    features = _features(window)
    features["restarts"] = float(restarts)
    ticks = len(window)
    seen = features["requests_seen"] or 0.0
    if ticks < thresholds.min_ticks or seen < thresholds.min_requests:
        return PatternReading("steady", 0.0, MappingProxyType(features))
    coverage = min(1.0, ticks / (3 * thresholds.min_ticks))
    unit = math.log(thresholds.full_confidence_factor)
    nearest, undecided = -math.inf, False
    for pattern, margin in _rules(features, thresholds):
        if margin is None:
            undecided = True
        elif margin >= 0:
            confidence = _confidence(margin, unit, coverage)
            return PatternReading(pattern, confidence, MappingProxyType(features))
        else:
            nearest = max(nearest, margin)
    confidence = _confidence(-nearest, unit, coverage)
    if undecided:  # some pattern might hold; the data could not rule it out
        confidence = min(confidence, 0.5 * coverage)
    return PatternReading("steady", confidence, MappingProxyType(features))


def _confidence(margin: float, unit: float, coverage: float) -> float:
    return round(coverage * (0.5 + 0.5 * min(1.0, margin / unit)), 4)


# ---------------------------------------------------------------------- rules
def _rules(
    f: Mapping[str, float | None], th: PatternThresholds
) -> list[tuple[TrafficPattern, float | None]]:
    """Each rule's margin in order: >= 0 holds, < 0 fails, None cannot be told."""
    split = f["prompt_generation_ratio"]
    if split is None and (f["prompt_tokens"] or 0) > 0:
        split = math.inf  # prompts processed and nothing generated: all prefill
    decode_split = None if split is None else (math.inf if split == 0 else 1 / split)
    long_context = [_above(f["mean_prompt_tokens"], th.long_prompt_tokens)]
    if f["kv_share_per_running_request"] is not None:
        long_context.append(_above(f["kv_share_per_running_request"], th.long_context_min_kv_share))
    return [
        (
            "bursty_short",
            _all(
                _below(f["mean_request_tokens"], th.bursty_max_request_tokens),
                _above(f["arrival_dispersion"], th.bursty_min_arrival_dispersion),
            ),
        ),
        (
            "prefill_heavy",
            _all(
                _above(f["mean_prompt_tokens"], th.long_prompt_tokens),
                _above(split, th.prefill_min_prompt_ratio),
            ),
        ),
        (
            "decode_heavy",
            _all(
                _above(f["mean_generation_tokens"], th.decode_min_generation_tokens),
                _above(decode_split, th.decode_min_generation_ratio),
            ),
        ),
        ("long_context", _all(*long_context)),
    ]


def _above(value: float | None, threshold: float) -> float | None:
    """Log ratio of ``value`` over ``threshold``: >= 0 when at or above it."""
    if value is None:
        return None
    return math.log(value / threshold) if value > 0 else -math.inf


def _below(value: float | None, threshold: float) -> float | None:
    """Log ratio of ``threshold`` over ``value``: >= 0 when at or below it."""
    margin = _above(value, threshold)
    return None if margin is None else -margin


def _all(*margins: float | None) -> float | None:
    """The weakest condition's margin; a known failure outweighs an unknown."""
    known = [m for m in margins if m is not None]
    if len(known) < len(margins) and all(m >= 0 for m in known):
        return None
    return min(known)


# ---------------------------------------------------------------------- window
def _window(samples: Sequence[TickSample], window_s: float) -> tuple[list[TickSample], int]:
    """The ticks within ``window_s`` of the newest from the last restart on, and the restarts.

    A restart is a tick where any counter fell; several counters falling at once
    are one restart.
    """
    ordered = sorted(samples, key=lambda s: s.t)
    if not ordered:
        return [], 0
    newest = ordered[-1].t
    window = [s for s in ordered if s.t >= newest - window_s]
    restarts: set[int] = set()
    for name in _COUNTERS:
        previous: float | None = None
        for index, sample in enumerate(window):
            value = getattr(sample, name)
            if value is None:
                continue
            if previous is not None and value < previous:
                restarts.add(index)
            previous = value
    return window[max(restarts, default=0) :], len(restarts)


def _delta(window: Sequence[TickSample], name: str) -> float | None:
    """Growth of counter ``name`` between its first and last known value."""
    values = [v for v in (getattr(s, name) for s in window) if v is not None]
    return values[-1] - values[0] if len(values) >= 2 else None


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return numerator / denominator


# ---------------------------------------------------------------------- features
def _features(window: Sequence[TickSample]) -> dict[str, float | None]:
    """Every feature the rules read, None where the window cannot tell."""
    span = window[-1].t - window[0].t if window else 0.0
    finished = _first_known(
        _delta(window, "requests_finished_total"),
        _delta(window, "prompt_tokens_count"),
        _delta(window, "generation_tokens_count"),
    )
    prompt = _first_known(
        _delta(window, "prompt_tokens_total"), _delta(window, "prompt_tokens_sum")
    )
    generation = _first_known(
        _delta(window, "generation_tokens_total"), _delta(window, "generation_tokens_sum")
    )
    # Histograms give the sizes of finished requests exactly; without them, tokens
    # processed per finished request is the same figure in a steady state.
    mean_prompt = _first_known(
        _ratio(_delta(window, "prompt_tokens_sum"), _delta(window, "prompt_tokens_count")),
        _ratio(_delta(window, "prompt_tokens_total"), finished),
    )
    mean_generation = _first_known(
        _ratio(_delta(window, "generation_tokens_sum"), _delta(window, "generation_tokens_count")),
        _ratio(_delta(window, "generation_tokens_total"), finished),
    )
    mean_request = (
        mean_prompt + mean_generation
        if mean_prompt is not None and mean_generation is not None
        else None
    )
    arrivals = _arrivals(window)
    # Requests in the engine when the window opened were seen too: a few long
    # conversations may bring few arrivals and still fill the cache all along.
    present = _in_system(window[0]) if window else None
    seen = (
        present + arrivals["arrivals"]
        if present is not None and arrivals["arrivals"] is not None
        else finished
    )
    features: dict[str, float | None] = {
        "ticks": float(len(window)),
        "span_s": span,
        "requests_finished": finished,
        "requests_seen": seen,
        "mean_prompt_tokens": mean_prompt,
        "mean_generation_tokens": mean_generation,
        "mean_request_tokens": mean_request,
        "prompt_tokens": prompt,
        "generation_tokens": generation,
        "prompt_tokens_per_s": _ratio(prompt, span),
        "generation_tokens_per_s": _ratio(generation, span),
        "prompt_generation_ratio": _ratio(prompt, generation),
        "prompt_share": _ratio(prompt, (prompt or 0.0) + (generation or 0.0)),
        **arrivals,
        **_occupancy(window),
    }
    # Rounded for logs and /status; a figure that overflowed says nothing.
    return {
        k: (None if v is None or not math.isfinite(v) else round(v, 6)) for k, v in features.items()
    }


def _first_known(*values: float | None) -> float | None:
    return next((v for v in values if v is not None), None)


def _in_system(sample: TickSample) -> float | None:
    if sample.requests_running is None:
        return None
    return sample.requests_running + (sample.requests_waiting or 0.0)


def _finished(sample: TickSample) -> tuple[str, float] | None:
    for name in ("requests_finished_total", "prompt_tokens_count", "generation_tokens_count"):
        value = getattr(sample, name)
        if value is not None:
            return name, value
    return None


def _arrivals(window: Sequence[TickSample]) -> dict[str, float | None]:
    """Arrivals per tick (growth of running + waiting, plus finished) and their spread."""
    counts: list[tuple[float, float]] = []  # (arrivals, seconds) per tick
    for before, after in itertools.pairwise(window):
        present = (_in_system(before), _in_system(after))
        done = (_finished(before), _finished(after))
        dt = after.t - before.t
        if present[0] is None or present[1] is None or dt <= 0:
            continue
        if done[0] is None or done[1] is None or done[0][0] != done[1][0]:
            continue
        # Never negative: requests that vanish uncounted (an engine error) are not arrivals.
        counts.append((max(0.0, present[1] - present[0] + done[1][1] - done[0][1]), dt))
    total = sum(a for a, _ in counts)
    seconds = sum(dt for _, dt in counts)
    if not counts or seconds <= 0:
        return dict.fromkeys(("arrivals", "arrivals_per_s", "arrival_cv", "arrival_dispersion"))
    rate = total / seconds
    # Each tick's expected count is rate x its length: polls speed up under pressure.
    squares = sum((a - rate * dt) ** 2 for a, dt in counts)
    mean = total / len(counts)
    return {
        "arrivals": total,
        "arrivals_per_s": rate,
        "arrival_cv": math.sqrt(squares / len(counts)) / mean if mean > 0 else None,
        "arrival_dispersion": squares / total if total > 0 else None,
    }


def _occupancy(window: Sequence[TickSample]) -> dict[str, float | None]:
    """Mean running and waiting requests, and KV tokens per running request."""
    running = [s.requests_running for s in window if s.requests_running is not None]
    waiting = [s.requests_waiting for s in window if s.requests_waiting is not None]
    pairs = [
        (s.kv_used_tokens, s.requests_running)
        for s in window
        if s.kv_used_tokens is not None and s.requests_running
    ]
    # A ratio of sums, not a mean of ratios: a tick with one tiny request running
    # must not weigh as much as a tick with fifty.
    per_request = _ratio(sum(kv for kv, _ in pairs), sum(n for _, n in pairs)) if pairs else None
    capacity = next((s.kv_capacity_tokens for s in reversed(window) if s.kv_capacity_tokens), None)
    mean_running = sum(running) / len(running) if running else None
    mean_waiting = sum(waiting) / len(waiting) if waiting else None
    return {
        "mean_running": mean_running,
        "mean_waiting": mean_waiting,
        "mean_concurrency": (
            None if mean_running is None else mean_running + (mean_waiting or 0.0)
        ),
        "kv_tokens_per_running_request": per_request,
        "kv_share_per_running_request": _ratio(per_request, capacity),
    }
