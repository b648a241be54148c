"""Forecast: where the KV cache and GPU memory are heading, and how soon they run out.

Method (docs/how-it-works.md has the worked example):

* **Demand level** per tick: KV tokens in use plus the waiting queue's prompt demand
  (waiting requests x mean prompt length from the engine's histogram), since waiting
  requests are admitted — and allocate — the moment blocks free.
* **Trend**: least-squares slope of the demand level over the last ``window_s``
  seconds, as Prometheus's ``predict_linear`` does; robust to the noise of 0.5 s
  samples because every point in the window weighs in. With fewer than
  ``min_samples`` points the trend falls back to the token counters: prompt fill +
  generation fill - drain (finished requests x mean request length), per second.
* **Projection** at each horizon: ``level + slope x horizon`` (never below 0).
* **Time to exhaustion**: ``(limit - level) / slope`` where ``limit`` is capacity
  minus a reserve; 0 when the level is already past the limit; +Inf when the slope is
  not rising (below ``min_rise_ratio_per_s`` of capacity per second, which keeps a
  flat but noisy series from forecasting exhaustion).

GPU memory is forecast the same way on NVML's used bytes of the fullest GPU. A
trend alone never escalates anything: the policy gates time to exhaustion with a
level (see :mod:`kvguard.core.policy`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from kvguard.core.series import TickSample

INF = math.inf


@dataclass(frozen=True)
class ForecastSettings:
    """The forecast's parameters (``[policy]`` in the config)."""

    horizons_s: tuple[float, ...] = (10.0, 30.0, 120.0)
    window_s: float = 30.0
    min_samples: int = 4
    kv_reserve_ratio: float = 0.02  # the last 2% of the pool counts as exhausted
    gpu_reserve_bytes: float = 512 * 1024**2  # allocations fail before the last byte
    min_rise_ratio_per_s: float = 0.0005  # 0.05% of capacity per second ~ 33 min to fill


@dataclass(frozen=True)
class ResourceForecast:
    """One resource's level, trend, projections and time to exhaustion."""

    level: float | None
    capacity: float | None
    limit: float | None
    slope_per_s: float | None
    projected: Mapping[float, float] = field(default_factory=dict)
    time_to_exhaustion_s: float = INF


@dataclass(frozen=True)
class Forecast:
    """Everything the forecast concluded at one tick."""

    kv: ResourceForecast
    gpu: ResourceForecast
    kv_used_tokens: float | None = None
    queue_demand_tokens: float | None = None
    prompt_fill_per_s: float | None = None
    generation_fill_per_s: float | None = None
    drain_per_s: float | None = None
    preemptions_per_s: float | None = None
    mean_prompt_tokens: float | None = None
    mean_request_tokens: float | None = None
    requests_waiting: float | None = None  # the engine's queue at the last tick

    @property
    def kv_usage_ratio(self) -> float | None:
        """KV tokens in use over capacity (the queue not included)."""
        used, capacity = self.kv_used_tokens, self.kv.capacity
        return used / capacity if used is not None and capacity else None

    def headroom_bytes(self, bytes_per_token: float | None, horizon_s: float) -> float | None:
        """KV headroom at ``horizon_s`` in bytes: projected spare tokens x bytes per token."""
        kv = self.kv
        projected = kv.projected.get(horizon_s)
        if bytes_per_token is None or kv.limit is None or projected is None:
            return None
        return (kv.limit - projected) * bytes_per_token


def forecast(
    samples: Sequence[TickSample], settings: ForecastSettings = ForecastSettings()
) -> Forecast:
    """Forecast from a window of samples, oldest first (only the newest ``window_s`` count)."""
    if not samples:
        empty = ResourceForecast(None, None, None, None)
        return Forecast(empty, empty)
    recent = _since_last_reset(_window(samples, settings.window_s))
    last = recent[-1]
    mean_prompt = _mean_delta(recent, "prompt_tokens_sum", "prompt_tokens_count")
    mean_generation = _mean_delta(recent, "generation_tokens_sum", "generation_tokens_count")
    mean_request = (
        mean_prompt + mean_generation
        if mean_prompt is not None and mean_generation is not None
        else None
    )
    prompt_rate = _rate(recent, "prompt_tokens_total")
    generation_rate = _rate(recent, "generation_tokens_total")
    finished_rate = _rate(recent, "requests_finished_total")
    drain = finished_rate * mean_request if finished_rate is not None and mean_request else None
    counter_slope = None
    if prompt_rate is not None and generation_rate is not None:
        counter_slope = prompt_rate + generation_rate - (drain or 0.0)

    def demand(s: TickSample) -> float | None:
        if s.kv_used_tokens is None:
            return None
        waiting = (s.requests_waiting or 0.0) * (mean_prompt or 0.0)
        return s.kv_used_tokens + waiting

    capacity = last.kv_capacity_tokens
    kv_limit = capacity * (1 - settings.kv_reserve_ratio) if capacity else None
    kv = _resource(recent, demand, capacity, kv_limit, counter_slope, settings=settings)
    gpu_capacity = last.gpu_total_bytes
    gpu_limit = gpu_capacity - settings.gpu_reserve_bytes if gpu_capacity else None
    gpu = _resource(
        recent, lambda s: s.gpu_used_bytes, gpu_capacity, gpu_limit, None, settings=settings
    )
    waiting_demand = None
    if last.requests_waiting is not None and mean_prompt is not None:
        waiting_demand = last.requests_waiting * mean_prompt
    return Forecast(
        kv=kv,
        gpu=gpu,
        kv_used_tokens=last.kv_used_tokens,
        queue_demand_tokens=waiting_demand,
        prompt_fill_per_s=prompt_rate,
        generation_fill_per_s=generation_rate,
        drain_per_s=drain,
        preemptions_per_s=_rate(recent, "preemptions_total"),
        mean_prompt_tokens=mean_prompt,
        mean_request_tokens=mean_request,
        requests_waiting=last.requests_waiting,
    )


def _resource(
    samples: Sequence[TickSample],
    value_of: Callable[[TickSample], float | None],
    capacity: float | None,
    limit: float | None,
    fallback_slope: float | None,
    *,
    settings: ForecastSettings,
) -> ResourceForecast:
    points = [(s.t, v) for s in samples if (v := value_of(s)) is not None]
    if not points:
        return ResourceForecast(None, capacity, limit, None)
    level = points[-1][1]
    slope = least_squares_slope(points) if len(points) >= settings.min_samples else fallback_slope
    projected = {h: max(0.0, level + (slope or 0.0) * h) for h in settings.horizons_s}
    tte = INF
    if limit is not None:
        if level >= limit:
            tte = 0.0
        elif slope is not None and capacity and slope > settings.min_rise_ratio_per_s * capacity:
            tte = (limit - level) / slope
    return ResourceForecast(level, capacity, limit, slope, projected, tte)


def least_squares_slope(points: Sequence[tuple[float, float]]) -> float | None:
    """Slope of the least-squares line through ``(t, value)`` points (None if t is constant)."""
    n = len(points)
    if n < 2:
        return None
    mean_t = sum(t for t, _ in points) / n
    mean_v = sum(v for _, v in points) / n
    var = sum((t - mean_t) ** 2 for t, _ in points)
    if var == 0:
        return None
    return sum((t - mean_t) * (v - mean_v) for t, v in points) / var


def _window(samples: Sequence[TickSample], window_s: float) -> Sequence[TickSample]:
    newest = samples[-1].t
    start = len(samples)
    while start > 0 and newest - samples[start - 1].t <= window_s:
        start -= 1
    return samples[start:]


def _since_last_reset(samples: Sequence[TickSample]) -> Sequence[TickSample]:
    """Samples after the last fall of a counter (an engine restart resets them)."""
    start = 0
    for i in range(1, len(samples)):
        before, after = samples[i - 1], samples[i]
        for name in ("prompt_tokens_total", "generation_tokens_total", "requests_finished_total"):
            a, b = getattr(before, name), getattr(after, name)
            if a is not None and b is not None and b < a:
                start = i
    return samples[start:]


def _rate(samples: Sequence[TickSample], name: str) -> float | None:
    known = [(s.t, getattr(s, name)) for s in samples if getattr(s, name) is not None]
    if len(known) < 2 or known[-1][0] == known[0][0]:
        return None
    return float((known[-1][1] - known[0][1]) / (known[-1][0] - known[0][0]))


def _mean_delta(samples: Sequence[TickSample], sum_name: str, count_name: str) -> float | None:
    """Mean observation of a histogram over the window (its delta sum / delta count)."""
    known = [
        (getattr(s, sum_name), getattr(s, count_name))
        for s in samples
        if getattr(s, sum_name) is not None and getattr(s, count_name) is not None
    ]
    if len(known) < 2:
        return None
    d_sum, d_count = known[-1][0] - known[0][0], known[-1][1] - known[0][1]
    if d_count > 0:
        return float(d_sum / d_count)
    # No request finished in the window: fall back to the all-time mean.
    total_sum, total_count = known[-1]
    return float(total_sum / total_count) if total_count else None
