"""The forecast on synthetic series: flat, ramp, step, burst, sawtooth, noisy ramp."""

from __future__ import annotations

import math
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from kvguard.core.forecast import ForecastSettings, forecast, least_squares_slope
from kvguard.core.series import TickSample

CAPACITY = 10_000.0
LIMIT = CAPACITY * (1 - ForecastSettings().kv_reserve_ratio)


def series(values: list[float], dt: float = 0.5, **extra: float) -> list[TickSample]:
    """KV-used samples every ``dt`` seconds on a 10,000-token pool."""
    return [
        TickSample(
            t=i * dt, kv_used_tokens=v, kv_capacity_tokens=CAPACITY, requests_waiting=0.0, **extra
        )
        for i, v in enumerate(values)
    ]


def test_a_flat_series_never_forecasts_exhaustion():
    """Constant use, however high, has no trend: time to exhaustion is infinite."""
    for level in (0.0, 3_000.0, 9_000.0):
        result = forecast(series([level] * 60))
        assert math.isinf(result.kv.time_to_exhaustion_s)
        assert result.kv.slope_per_s == 0.0
        assert result.kv.projected[120.0] == level


def test_a_linear_ramp_is_forecast_within_ten_percent_after_ten_ticks():
    """40 tokens/s from 2,000: after 10 ticks the time to exhaustion is within 10% of the truth."""
    values = [2_000 + 40 * 0.5 * i for i in range(10)]
    result = forecast(series(values))
    truth = (LIMIT - values[-1]) / 40
    assert abs(result.kv.time_to_exhaustion_s - truth) / truth < 0.10
    assert abs(result.kv.projected[10.0] - (values[-1] + 400)) < 1e-6


def test_a_noisy_ramp_is_still_forecast_within_ten_percent():
    """The same ramp with ±5% noise per sample, over the 30 s window."""
    rng = random.Random(7)
    values = [2_000 + 40 * 0.5 * i + rng.uniform(-100, 100) for i in range(60)]
    result = forecast(series(values))
    truth = (LIMIT - (2_000 + 40 * 0.5 * 59)) / 40
    assert abs(result.kv.time_to_exhaustion_s - truth) / truth < 0.10


def test_a_noisy_flat_series_does_not_forecast_exhaustion():
    """Noise around a level is not a trend (below the minimum rise rate)."""
    rng = random.Random(3)
    result = forecast(series([5_000 + rng.uniform(-50, 50) for _ in range(60)]))
    assert math.isinf(result.kv.time_to_exhaustion_s)


def test_a_pool_past_its_limit_is_exhausted_now():
    """At or past capacity minus the reserve, time to exhaustion is 0 whatever the trend."""
    assert forecast(series([9_900.0] * 10)).kv.time_to_exhaustion_s == 0.0


def test_a_step_then_flat_stops_forecasting_once_the_window_passes():
    """A jump is a trend while it is in the window, and no longer once it has left it."""
    values = [1_000.0] * 20 + [6_000.0] * 80
    during = forecast(series(values[:30]))
    after = forecast(series(values))
    assert during.kv.time_to_exhaustion_s < math.inf
    assert math.isinf(after.kv.time_to_exhaustion_s)


def test_waiting_requests_count_as_demand():
    """Queued requests add waiting x mean prompt length to the level."""
    samples = [
        TickSample(
            t=i * 0.5,
            kv_used_tokens=8_000.0,
            kv_capacity_tokens=CAPACITY,
            requests_waiting=float(i),
            prompt_tokens_sum=500.0 * i,
            prompt_tokens_count=float(i),
        )
        for i in range(1, 11)
    ]
    result = forecast(samples)
    assert result.mean_prompt_tokens == 500.0
    assert result.queue_demand_tokens == 10 * 500.0
    assert result.kv.level == 8_000.0 + 5_000.0
    assert result.kv.time_to_exhaustion_s == 0.0


def test_burst_then_drain_has_a_falling_trend():
    """After a burst, use falls: no exhaustion forecast."""
    values = [1_000.0 + 400 * i for i in range(10)] + [5_000.0 - 300 * i for i in range(15)]
    assert math.isinf(forecast(series(values)).kv.time_to_exhaustion_s)


def test_counter_rates_and_the_fallback_slope():
    """With too few points for a fit, the token counters give the trend."""
    samples = [
        TickSample(
            t=0.0,
            kv_used_tokens=1_000.0,
            kv_capacity_tokens=CAPACITY,
            prompt_tokens_total=0.0,
            generation_tokens_total=0.0,
            requests_finished_total=0.0,
        ),
        TickSample(
            t=1.0,
            kv_used_tokens=1_100.0,
            kv_capacity_tokens=CAPACITY,
            prompt_tokens_total=80.0,
            generation_tokens_total=20.0,
            requests_finished_total=0.0,
        ),
    ]
    result = forecast(samples)
    assert (result.prompt_fill_per_s, result.generation_fill_per_s) == (80.0, 20.0)
    assert result.kv.slope_per_s == 100.0


def test_a_counter_reset_starts_the_window_again():
    """A restart (counters fall) discards the samples before it."""
    before = [
        TickSample(
            t=i,
            kv_used_tokens=5_000.0,
            kv_capacity_tokens=CAPACITY,
            prompt_tokens_total=1_000.0 + i,
        )
        for i in range(5)
    ]
    after = [
        TickSample(
            t=5 + i,
            kv_used_tokens=100.0 * i,
            kv_capacity_tokens=CAPACITY,
            prompt_tokens_total=float(i),
        )
        for i in range(5)
    ]
    result = forecast(before + after)
    assert result.kv.slope_per_s == 100.0


def test_gpu_memory_forecast_and_headroom_bytes():
    """GPU bytes rising 1 GiB/s toward 80 GiB; KV headroom in bytes at a horizon."""
    gib = 1024**3
    samples = [
        TickSample(
            t=float(i),
            kv_used_tokens=1_000.0,
            kv_capacity_tokens=CAPACITY,
            gpu_used_bytes=60.0 * gib + i * gib,
            gpu_total_bytes=80.0 * gib,
        )
        for i in range(10)
    ]
    result = forecast(samples)
    expected = (80 * gib - ForecastSettings().gpu_reserve_bytes - 69 * gib) / gib
    assert abs(result.gpu.time_to_exhaustion_s - expected) < 1e-6
    assert result.headroom_bytes(1024.0, 10.0) == (LIMIT - 1_000.0) * 1024.0


def test_least_squares_slope_edge_cases():
    """One point or one instant has no slope."""
    assert least_squares_slope([(0.0, 1.0)]) is None
    assert least_squares_slope([(1.0, 1.0), (1.0, 2.0)]) is None
    assert least_squares_slope([(0.0, 0.0), (1.0, 2.0), (2.0, 4.0)]) == 2.0


@settings(max_examples=100, deadline=None)
@given(st.floats(1.0, 500.0), st.floats(0.0, 500.0), st.floats(0.0, 5_000.0))
def test_a_faster_fill_never_lengthens_time_to_exhaustion(rate, extra, start):
    """Raising the fill rate never increases the time to exhaustion."""
    slow = forecast(series([start + rate * 0.5 * i for i in range(20)]))
    fast = forecast(series([start + (rate + extra) * 0.5 * i for i in range(20)]))
    assert fast.kv.time_to_exhaustion_s <= slow.kv.time_to_exhaustion_s + 1e-9
