"""The traffic-pattern classifier, on recorded sim runs of each loadgen pattern and synthetics."""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvguard.core.pattern import (
    TRAFFIC_PATTERNS,
    PatternThresholds,
    classify,
)
from kvguard.core.series import TickSample
from kvguard.errors import InvalidInputError

RECORDINGS = Path(__file__).resolve().parent.parent / "fixtures" / "patterns"
FIXTURES = sorted(RECORDINGS.glob("*_seed*.json"))
GENERATED = ("steady", "bursty_short", "long_context", "prefill_heavy", "decode_heavy")
# Windows shorter than the default 60 s, slid tick by tick over each 30 s run.
SLIDING_WINDOW_S = 15.0
# Measured at 100% on every recording (windows of 10 s too; 5 s windows drop to
# 86-100%). The bar leaves room for a re-recording on a slower machine, not for a
# pattern that is named wrong a tenth of the time.
SLIDING_MIN_MATCH = 0.9
# As the daemon sees a run live (default 60 s window, growing from the start):
# every tick from here on names the pattern (measured: from 4.5-8 s on).
LIVE_FROM_S = 10.0


def load(path: Path) -> list[TickSample]:
    """A recorded series, as record.py wrote it."""
    return [TickSample(**row) for row in json.loads(path.read_text(encoding="utf-8"))]


def generated(path: Path) -> str:
    """The loadgen pattern a recording was made with (its file name says)."""
    return path.stem.rsplit("_seed", 1)[0]


# ---------------------------------------------------------------------- recordings
def test_every_pattern_is_recorded_with_several_seeds():
    """Each loadgen pattern has at least two seeds, so no threshold fits one run only."""
    seeds = Counter(generated(path) for path in FIXTURES)
    assert {pattern: seeds[pattern] >= 2 for pattern in GENERATED} == dict.fromkeys(GENERATED, True)


@pytest.mark.parametrize("path", FIXTURES, ids=lambda p: p.stem)
def test_whole_run_names_the_generated_pattern(path: Path):
    """The default window (60 s) covers the whole 30 s run and names the pattern generated."""
    reading = classify(load(path))
    assert reading.pattern == generated(path), dict(reading.features)
    assert reading.confidence >= 0.5


@pytest.mark.parametrize("path", FIXTURES, ids=lambda p: p.stem)
def test_sliding_windows_name_the_generated_pattern(path: Path):
    """At least 90% of the 15 s windows ending at each tick after the first 15 s name it."""
    samples = load(path)
    thresholds = PatternThresholds(window_s=SLIDING_WINDOW_S)
    readings = [
        classify(samples[: end + 1], thresholds)
        for end, sample in enumerate(samples)
        if sample.t >= SLIDING_WINDOW_S
    ]
    matched = sum(r.pattern == generated(path) for r in readings)
    assert len(readings) >= 20
    assert matched / len(readings) >= SLIDING_MIN_MATCH, Counter(r.pattern for r in readings)


@pytest.mark.parametrize("path", FIXTURES, ids=lambda p: p.stem)
def test_live_classification_settles_within_ten_seconds(path: Path):
    """Ticked live with the defaults, every reading from 10 s on names the generated pattern."""
    samples = load(path)
    wrong = [
        (sample.t, classify(samples[: end + 1]).pattern)
        for end, sample in enumerate(samples)
        if sample.t >= LIVE_FROM_S and classify(samples[: end + 1]).pattern != generated(path)
    ]
    assert wrong == []


# ---------------------------------------------------------------------- synthetic series
def series(
    ticks: int = 60,
    *,
    dt: float | Callable[[int], float] = 0.5,
    arrivals: Callable[[int], int] = lambda _: 2,
    prompt: float = 600.0,
    generation: float = 180.0,
    running: float = 4.0,
    kv_per_request: float = 700.0,
    capacity: float | None = 16384.0,
    start: float = 0.0,
) -> list[TickSample]:
    """Ticks of an engine whose requests arrive and finish within the tick they arrive in.

    So each tick's arrivals equal its finished requests, the running count stays
    at ``running``, and every request has exactly the given sizes.
    """
    out: list[TickSample] = []
    t, done = start, 0.0
    for i in range(ticks):
        if i:
            t += dt(i) if callable(dt) else dt
            done += arrivals(i)
        out.append(
            TickSample(
                t=t,
                kv_used_tokens=running * kv_per_request,
                kv_capacity_tokens=capacity,
                requests_running=running,
                requests_waiting=0.0,
                prompt_tokens_total=done * prompt,
                generation_tokens_total=done * generation,
                requests_finished_total=done,
                preemptions_total=0.0,
                prompt_tokens_sum=done * prompt,
                prompt_tokens_count=done,
                generation_tokens_sum=done * generation,
                generation_tokens_count=done,
            )
        )
    return out


def bursts(size: int, every: int) -> Callable[[int], int]:
    """``size`` arrivals in one tick out of every ``every``, none in between."""
    return lambda i: size if i % every == 0 else 0


SHAPES: dict[str, dict[str, Any]] = {
    "steady": {},
    "bursty_short": {"arrivals": bursts(60, 6), "prompt": 150.0, "generation": 60.0},
    "prefill_heavy": {"prompt": 5000.0, "generation": 70.0, "kv_per_request": 4500.0},
    "decode_heavy": {"prompt": 100.0, "generation": 1200.0},
    "long_context": {"prompt": 3000.0, "generation": 280.0, "kv_per_request": 3300.0},
}


@pytest.mark.parametrize("pattern", TRAFFIC_PATTERNS)
def test_each_rule_names_its_shape(pattern: str):
    """A clean synthetic series of each shape is named after it, with full confidence."""
    reading = classify(series(**SHAPES[pattern]))
    assert (reading.pattern, reading.confidence) == (pattern, 1.0)


def test_too_little_data_reads_steady_with_zero_confidence():
    """No ticks, too few ticks, or no requests at all: steady, confidence 0."""
    assert classify([]).pattern == "steady"
    assert classify([]).confidence == 0.0
    few_ticks = classify(series(5, arrivals=bursts(100, 2), prompt=100, generation=20))
    assert (few_ticks.pattern, few_ticks.confidence) == ("steady", 0.0)
    idle = classify(series(60, arrivals=lambda _: 0, running=0))
    assert (idle.pattern, idle.confidence) == ("steady", 0.0)


def test_short_history_is_not_certain():
    """Confidence grows with the ticks seen, up to three times the minimum."""
    shape = SHAPES["decode_heavy"]
    early = classify(series(12, **shape))
    later = classify(series(40, **shape))
    assert early.pattern == later.pattern == "decode_heavy"
    assert 0 < early.confidence < later.confidence == 1.0


def test_counter_reset_uses_only_the_part_after_the_restart():
    """A falling counter means a restart: the traffic before it is forgotten."""
    before = series(40, **SHAPES["prefill_heavy"])
    after = series(20, start=before[-1].t + 0.5, **SHAPES["decode_heavy"])
    reading = classify(before + after)
    assert reading.pattern == "decode_heavy"
    assert reading.features["restarts"] == 1.0
    assert reading.features["mean_prompt_tokens"] == 100.0
    assert reading.features["ticks"] == 20


def test_reset_in_the_last_tick_leaves_too_little_data():
    """A restart seen only in the newest tick leaves one tick: steady, confidence 0."""
    samples = series(40, **SHAPES["bursty_short"])
    restarted = replace(samples[0], t=samples[-1].t + 0.5)
    reading = classify([*samples, restarted])
    assert (reading.pattern, reading.confidence) == ("steady", 0.0)


def test_unknown_fields_are_tolerated():
    """Ticks with every engine figure unknown (probe failures) are skipped, not fatal."""
    blank = classify([TickSample(t=0.5 * i) for i in range(40)])
    assert (blank.pattern, blank.confidence) == ("steady", 0.0)
    known = {name: value for name, value in blank.features.items() if value is not None}
    assert known == {"ticks": 40.0, "span_s": 19.5, "restarts": 0.0}
    bursty = series(60, **SHAPES["bursty_short"])
    gappy = [TickSample(t=s.t) if i % 7 == 3 else s for i, s in enumerate(bursty)]
    assert classify(gappy).pattern == "bursty_short"


def test_without_histograms_sizes_come_from_the_token_counters():
    """No request-size histograms (llama.cpp-like): tokens per finished request stand in."""
    shape = SHAPES["prefill_heavy"]
    samples = [
        replace(
            s,
            prompt_tokens_sum=None,
            prompt_tokens_count=None,
            generation_tokens_sum=None,
            generation_tokens_count=None,
        )
        for s in series(60, **shape)
    ]
    reading = classify(samples)
    assert reading.pattern == "prefill_heavy"
    assert reading.features["mean_prompt_tokens"] == 5000.0


def test_without_capacity_long_context_rests_on_prompt_size():
    """With the pool's size unknown, long prompts decoded at length still read long_context."""
    reading = classify(series(**{**SHAPES["long_context"], "capacity": None}))
    assert reading.pattern == "long_context"
    assert reading.features["kv_share_per_running_request"] is None


def test_slow_independent_arrivals_are_not_bursty():
    """One short request every two seconds has a high CV but no bursts: not bursty_short."""
    reading = classify(series(60, arrivals=bursts(1, 4), prompt=150, generation=60))
    assert reading.features["arrival_cv"] is not None
    assert reading.features["arrival_cv"] > 1.5
    assert reading.pattern == "steady"


def test_faster_polling_alone_does_not_look_bursty():
    """A constant arrival rate ticked at a changing interval (fast polls) has no dispersion."""
    intervals = [0.5, 0.1, 0.1, 0.1, 0.1, 0.1]
    reading = classify(
        series(
            60,
            dt=lambda i: intervals[i % 6],
            arrivals=lambda i: 10 if intervals[i % 6] == 0.5 else 2,
            prompt=150,
            generation=60,
        )
    )
    assert reading.features["arrival_dispersion"] == 0.0
    assert reading.pattern == "steady"


def test_only_the_window_counts():
    """Bursts older than window_s are forgotten once steady traffic fills the window."""
    old = series(60, **SHAPES["bursty_short"])
    done = old[-1].requests_finished_total or 0.0
    recent = [
        replace(
            s,
            prompt_tokens_total=(s.prompt_tokens_total or 0) + done * 150,
            generation_tokens_total=(s.generation_tokens_total or 0) + done * 60,
            requests_finished_total=(s.requests_finished_total or 0) + done,
            prompt_tokens_sum=(s.prompt_tokens_sum or 0) + done * 150,
            prompt_tokens_count=(s.prompt_tokens_count or 0) + done,
            generation_tokens_sum=(s.generation_tokens_sum or 0) + done * 60,
            generation_tokens_count=(s.generation_tokens_count or 0) + done,
        )
        for s in series(130, start=old[-1].t + 0.5)
    ]
    assert classify(old + recent[:20]).pattern == "bursty_short"
    assert classify(old + recent).pattern == "steady"
    assert classify(old + recent).features["restarts"] == 0.0


def test_features_are_exposed_with_their_values():
    """Every input of the decision is in the reading, with the series' true figures."""
    reading = classify(series(41))  # 40 intervals of 0.5 s, 2 arrivals each
    f = reading.features
    assert f["mean_prompt_tokens"] == 600.0
    assert f["mean_generation_tokens"] == 180.0
    assert f["mean_request_tokens"] == 780.0
    assert f["prompt_generation_ratio"] == pytest.approx(600 / 180, rel=1e-5)
    assert f["prompt_share"] == pytest.approx(600 / 780, rel=1e-5)
    assert f["arrivals"] == 80.0
    assert f["arrivals_per_s"] == 4.0
    assert f["arrival_cv"] == 0.0
    assert f["arrival_dispersion"] == 0.0
    assert f["requests_finished"] == 80.0
    assert f["requests_seen"] == 84.0  # four running when the window opened
    assert f["mean_concurrency"] == 4.0
    assert f["kv_tokens_per_running_request"] == 700.0
    assert f["kv_share_per_running_request"] == pytest.approx(700 / 16384, rel=1e-5)
    assert f["span_s"] == 20.0
    with pytest.raises(TypeError):
        reading.features["ticks"] = 0.0  # type: ignore[index]


def test_thresholds_are_validated():
    """A threshold that is not a positive number is refused, naming the field."""
    for spec in fields(PatternThresholds):
        with pytest.raises(InvalidInputError, match=spec.name):
            PatternThresholds(**{spec.name: 0})
    with pytest.raises(InvalidInputError, match="full_confidence_factor"):
        PatternThresholds(full_confidence_factor=1.0)


# ---------------------------------------------------------------------- properties
counts = st.none() | st.floats(0, 1e7, allow_nan=False)
ticks = st.builds(
    TickSample,
    t=st.floats(0, 600, allow_nan=False),
    **{spec.name: counts for spec in fields(TickSample) if spec.name != "t"},
)


@settings(max_examples=200, deadline=None)
@given(st.lists(ticks, max_size=40))
def test_classify_is_deterministic_and_bounded(samples: list[TickSample]):
    """Same input, same reading; any input gives a known pattern and a confidence in 0-1."""
    first, second = classify(samples), classify(list(samples))
    assert first == second
    assert first.pattern in TRAFFIC_PATTERNS
    assert 0.0 <= first.confidence <= 1.0
    assert all(v is None or math.isfinite(v) for v in first.features.values())


@settings(max_examples=100, deadline=None)
@given(st.randoms(use_true_random=False), st.sampled_from(sorted(SHAPES)))
def test_tick_order_does_not_matter(rng, shape: str):
    """Ticks are read in time order whatever order they are given in."""
    samples = series(40, **SHAPES[shape])
    shuffled = list(samples)
    rng.shuffle(shuffled)
    assert classify(shuffled) == classify(samples)
