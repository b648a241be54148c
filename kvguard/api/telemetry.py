"""kvguard's own metrics.

:class:`DaemonCollector` reads the daemon's latest state at scrape time (no
background updates, nothing to go stale between ticks) and yields every
``kvguard_*`` series; docs/metrics.md lists them. A value kvguard does not know is
left out, never exported as 0. The logs are set up in :mod:`kvguard.api.logs`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector, CollectorRegistry

from kvguard.actuators.mitigations import PRIORITIES
from kvguard.api.metric_families import counter_family, gauge
from kvguard.api.telemetry_actions import actuator_metrics
from kvguard.core.pattern import TRAFFIC_PATTERNS
from kvguard.core.policy import BINDINGS, LEVELS
from kvguard.core.snapshot import EngineShare

if TYPE_CHECKING:
    from kvguard.runtime.daemon import Daemon

BUDGET_COMPONENTS = ("weights", "kv_pool", "activations", "overhead", "headroom")
# Every reason the proxy counts a refusal under (kvguard.actuators.proxy), exported as
# 0 from the start so that increase() sees the first refusal of each.
REJECT_REASONS = (
    "prompt_over_window",  # 400: the window cap
    "no_room_for_completion",  # 400: the window cap
    "invalid_body",  # 400: a generation request whose body is not a valid one
    "method_not_allowed",  # 405
    "bad_target",  # 400: an absolute-URI or asterisk target
    "bad_header",  # 400: a control character or non-UTF-8 bytes in a header value
    "bad_path",  # 400: a path an engine could read as another one
    "path_not_allowed",  # 404: no route of the engine, nor in [proxy] allowed_paths
    "path_blocked",  # 403: an engine admin path ([proxy] blocked_paths)
    "content_encoding",  # 415: a compressed request body (it cannot pass as sent)
)


# Every (priority, reason) a shed is counted under, and every code the proxy answers with
# itself: 0 from the start, so rate() and alerts see the first one on a fresh start.
SHED_SERIES = tuple(
    (priority, reason)
    for priority in PRIORITIES
    for reason in ("kv_cache_pressure", "kv_pool_full", "draining")
)
PROXY_ERROR_CODES = ("408", "413", "502", "503", "504")


class DaemonCollector(Collector):
    """Every kvguard_* series, from the daemon's state at the moment of the scrape."""

    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon

    def collect(self) -> Iterator[Metric]:
        """Yield the families; unknown values are omitted."""
        yield from self._self_metrics()
        yield from self._gpu_metrics()
        yield from self._host_metrics()
        yield from self._engine_metrics()
        yield from self._budget_metrics()
        yield from self._brain_metrics()
        yield from self._proxy_metrics()
        yield from actuator_metrics(self.daemon)

    def _self_metrics(self) -> Iterator[Metric]:
        state = self.daemon.state
        info = GaugeMetricFamily("kvguard_build_info", "kvguard's version.", labels=["version"])
        info.add_metric([self.daemon.version], 1.0)
        yield info
        up = GaugeMetricFamily(
            "kvguard_probe_up", "Whether the probe's last read worked.", labels=["probe"]
        )
        duration = GaugeMetricFamily(
            "kvguard_probe_duration_seconds", "Duration of the probe's last read.", labels=["probe"]
        )
        errors = CounterMetricFamily(
            "kvguard_probe_errors", "Failed probe reads.", labels=["probe"]
        )
        age = GaugeMetricFamily(
            "kvguard_probe_age_seconds",
            "Seconds since the probe last read its source.",
            labels=["probe"],
        )
        now = self.daemon.clock()
        for name, tracker in sorted(state.trackers.items()):
            up.add_metric([name], 1.0 if tracker.ok else 0.0)
            duration.add_metric([name], tracker.duration_s)
            errors.add_metric([name], tracker.errors_total)
            if tracker.read_at is not None:
                age.add_metric([name], now - tracker.read_at)
        yield from (up, duration, errors, age)
        yield from gauge(
            "kvguard_tick_duration_seconds", "Duration of the last tick.", state.tick_duration_s
        )
        yield CounterMetricFamily("kvguard_ticks", "Ticks completed.", value=state.ticks_total)
        yield CounterMetricFamily(
            "kvguard_tick_overruns",
            "Ticks longer than poll.timeout_s + 0.5 s: something blocked the event loop.",
            value=state.tick_overruns_total,
        )
        yield GaugeMetricFamily(
            "kvguard_event_loop_lag_seconds",
            "How late the event loop ran the watchdog's latest timer.",
            value=state.loop_lag_s,
        )
        yield GaugeMetricFamily(
            "kvguard_event_loop_lag_max_seconds",
            "The largest event-loop lag since kvguard started.",
            value=state.loop_lag_max_s,
        )
        yield CounterMetricFamily(
            "kvguard_event_loop_stalls",
            "Times the event loop was stalled past the watchdog's threshold.",
            value=state.loop_stalls_total,
        )
        try:
            tasks = len(asyncio.all_tasks())  # /metrics is served on the loop: counted now
        except RuntimeError:  # collected off any loop: there are no tasks to count
            return
        yield GaugeMetricFamily(
            "kvguard_event_loop_tasks", "Asyncio tasks alive on kvguard's event loop.", value=tasks
        )

    def _fresh(self, source: str) -> bool:
        """Whether ``source`` answered this tick: a stale value is not exported as live."""
        snapshot = self.daemon.state.snapshot
        reading = snapshot.sources.get(source) if snapshot else None
        return reading is not None and reading.ok

    def _gpu_metrics(self) -> Iterator[Metric]:
        snapshot = self.daemon.state.snapshot
        if snapshot is None or not snapshot.gpus or not self._fresh("nvml"):
            return
        families = {
            "total": GaugeMetricFamily(
                "kvguard_gpu_memory_total_bytes", "GPU memory, total.", labels=["gpu"]
            ),
            "used": GaugeMetricFamily(
                "kvguard_gpu_memory_used_bytes", "GPU memory in use.", labels=["gpu"]
            ),
            "free": GaugeMetricFamily(
                "kvguard_gpu_memory_free_bytes", "GPU memory free.", labels=["gpu"]
            ),
            "reserved": GaugeMetricFamily(
                "kvguard_gpu_memory_reserved_bytes",
                "GPU memory reserved by the driver.",
                labels=["gpu"],
            ),
        }
        process = GaugeMetricFamily(
            "kvguard_gpu_process_memory_bytes", "GPU memory of one process.", labels=["gpu", "pid"]
        )
        for gpu in snapshot.gpus:
            label = [str(gpu.index)]
            families["total"].add_metric(label, gpu.total_bytes)
            families["used"].add_metric(label, gpu.used_bytes)
            families["free"].add_metric(label, gpu.free_bytes)
            if gpu.reserved_bytes is not None:
                families["reserved"].add_metric(label, gpu.reserved_bytes)
            for proc in gpu.processes:
                if proc.used_bytes is not None:
                    process.add_metric([str(gpu.index), str(proc.pid)], proc.used_bytes)
        yield from families.values()
        yield process

    def _host_metrics(self) -> Iterator[Metric]:
        snapshot = self.daemon.state.snapshot
        host = snapshot.host if snapshot else None
        if host is None or not self._fresh("host"):
            return
        yield from gauge(
            "kvguard_host_memory_total_bytes", "Host memory, total.", host.memory_total_bytes
        )
        yield from gauge(
            "kvguard_host_memory_available_bytes",
            "Host memory available.",
            host.memory_available_bytes,
        )
        yield from gauge(
            "kvguard_engine_process_resident_bytes",
            "Resident memory of the engine process.",
            host.engine_resident_bytes,
        )
        if host.engine_cpu_seconds_total is not None:
            yield CounterMetricFamily(
                "kvguard_engine_process_cpu_seconds",
                "CPU time (user + system) of the engine process.",
                value=host.engine_cpu_seconds_total,
            )
        yield from gauge(
            "kvguard_engine_process_cpu_ratio",
            "Deprecated: rate(kvguard_engine_process_cpu_seconds_total) (removed in the next"
            " release). CPU of the engine process, in cores.",
            host.engine_cpu_ratio,
        )

    def _engine_metrics(self) -> Iterator[Metric]:
        snapshot = self.daemon.state.snapshot
        engine = snapshot.engine if snapshot else None
        source = snapshot.sources.get("engine") if snapshot else None
        up = engine is not None and engine.up and source is not None and source.ok
        yield GaugeMetricFamily(
            "kvguard_engine_up", "Whether the engine answers and is healthy.", value=float(up)
        )
        if engine is None or not self._fresh("engine"):
            return
        yield from gauge(
            "kvguard_kv_cache_usage_ratio", "KV cache in use, 0-1.", engine.kv_cache_usage_ratio
        )
        yield from gauge(
            "kvguard_kv_cache_capacity_tokens",
            "Tokens the engine's KV cache holds.",
            engine.kv_capacity_tokens,
        )
        yield from gauge(
            "kvguard_kv_cache_used_tokens", "Tokens in the KV cache now.", engine.kv_used_tokens
        )
        yield from gauge(
            "kvguard_requests_running", "Requests being processed.", engine.requests_running
        )
        yield from gauge(
            "kvguard_requests_waiting", "Requests queued in the engine.", engine.requests_waiting
        )
        if engine.preemptions_total is not None:
            yield CounterMetricFamily(
                "kvguard_engine_preemptions",
                "The engine's preemption counter.",
                value=engine.preemptions_total,
            )
        yield from _engine_share_metrics(engine.engines)

    def _budget_metrics(self) -> Iterator[Metric]:
        state = self.daemon.state
        if state.budget is None:
            return
        b = state.budget.budget
        lines = GaugeMetricFamily(
            "kvguard_budget_bytes", "The VRAM budget per GPU, by component.", labels=["component"]
        )
        values = (
            b.weights_bytes_per_gpu,
            b.kv_pool_bytes_per_gpu,
            b.activation_bytes_per_gpu,
            b.overhead_bytes_per_gpu,
            b.headroom_bytes_per_gpu,
        )
        for component, value in zip(BUDGET_COMPONENTS, values, strict=True):
            lines.add_metric([component], value)
        yield lines
        yield from gauge(
            "kvguard_kv_bytes_per_token", "KV bytes per token, whole model.", b.kv_bytes_per_token
        )
        yield from gauge(
            "kvguard_budget_kv_capacity_tokens",
            "KV capacity the budget predicts.",
            b.kv_capacity_tokens,
        )
        rec = state.reconciliation
        if rec is not None:
            yield from gauge(
                "kvguard_engine_kv_capacity_tokens",
                "KV capacity the engine reports.",
                rec.reported_tokens,
            )
            yield from gauge(
                "kvguard_budget_kv_capacity_difference_tokens",
                "Reported minus predicted KV capacity.",
                rec.difference_tokens,
            )

    def _brain_metrics(self) -> Iterator[Metric]:
        brain = self.daemon.brain
        yield counter_family(
            "kvguard_decisions",
            "Actions decided, by action and mode.",
            ["action", "mode"],
            brain.counts,
        )
        fc, decision, pattern = brain.forecast, brain.decision, brain.pattern
        if fc is not None:
            tte = GaugeMetricFamily(
                "kvguard_time_to_exhaustion_seconds",
                "Forecast time until the resource runs out (+Inf: not rising).",
                labels=["resource"],
            )
            tte.add_metric(["kv_cache"], fc.kv.time_to_exhaustion_s)
            tte.add_metric(["gpu_memory"], fc.gpu.time_to_exhaustion_s)
            yield tte
            projected = GaugeMetricFamily(
                "kvguard_projected_kv_tokens",
                "KV demand (in use + queued prompts) projected at each horizon.",
                labels=["horizon"],
            )
            for horizon, value in sorted(fc.kv.projected.items()):
                projected.add_metric([f"{horizon:g}"], value)
            yield projected
            budget = self.daemon.state.budget
            per_token = budget.budget.kv_bytes_per_token_per_gpu if budget else None
            horizons = self.daemon.config.forecast.horizons_s
            headroom = fc.headroom_bytes(per_token, horizons[0]) if horizons else None
            yield from gauge(
                "kvguard_headroom_bytes",
                "KV headroom per GPU at the first forecast horizon, in bytes.",
                headroom,
            )
        if decision is not None:
            level = LEVELS.index(decision.level)
            yield GaugeMetricFamily(
                "kvguard_pressure_level", "Pressure level, 0 ok to 3 critical.", value=level
            )
            state = GaugeMetricFamily(
                "kvguard_pressure_state", "1 for the current pressure level.", labels=["state"]
            )
            for name in LEVELS:
                state.add_metric([name], 1.0 if name == decision.level else 0.0)
            yield state
            binding = GaugeMetricFamily(
                "kvguard_binding_resource",
                "1 for what limits the engine now: kv_cache, compute (a queue with room"
                " in the cache) or none.",
                labels=["resource"],
            )
            for resource in BINDINGS:
                binding.add_metric([resource], 1.0 if resource == decision.binding else 0.0)
            yield binding
        if pattern is not None:
            family = GaugeMetricFamily(
                "kvguard_traffic_pattern",
                "1 for the traffic pattern now detected.",
                labels=["pattern"],
            )
            for kind in TRAFFIC_PATTERNS:
                family.add_metric([kind], 1.0 if kind == pattern.pattern else 0.0)
            yield family

    def _proxy_metrics(self) -> Iterator[Metric]:
        proxy = self.daemon.proxy
        if proxy is None:
            return
        inflight, counters = proxy.inflight, proxy.counters
        yield GaugeMetricFamily(
            "kvguard_inflight_requests",
            "Requests in flight through the proxy.",
            value=len(inflight),
        )
        yield GaugeMetricFamily(
            "kvguard_proxy_held_requests",
            "Requests the proxy holds until they fit the engine's pool.",
            value=proxy.waiting,
        )
        # The old name, easy to confuse with the engine's queue (kvguard_requests_waiting):
        # exported one more release so dashboards and alerts can move.
        yield GaugeMetricFamily(
            "kvguard_waiting_requests",
            "Deprecated: kvguard_proxy_held_requests (removed in the next release).",
            value=proxy.waiting,
        )
        tokens = inflight.total_tokens
        yield GaugeMetricFamily(
            "kvguard_inflight_kv_tokens", "KV tokens held by requests in flight.", value=tokens
        )
        if proxy.bytes_per_token is not None:
            yield GaugeMetricFamily(
                "kvguard_inflight_kv_bytes",
                "KV bytes per GPU held by requests in flight.",
                value=tokens * proxy.bytes_per_token,
            )
        for name, doc, hist in (
            (
                "kvguard_request_kv_tokens",
                "KV tokens a request held at its end.",
                inflight.kv_tokens,
            ),
            ("kvguard_request_prompt_tokens", "Prompt tokens per request.", inflight.prompt_tokens),
        ):
            family = HistogramMetricFamily(name, doc)
            family.add_metric([], hist.cumulative(), sum_value=hist.total)
            yield family
        yield counter_family(
            "kvguard_requests_shed",
            "Requests shed by the proxy.",
            ["priority", "reason"],
            {**dict.fromkeys(SHED_SERIES, 0), **counters.shed},
        )
        yield CounterMetricFamily(
            "kvguard_requests_clamped",
            "Requests whose max_tokens was lowered.",
            value=counters.clamped,
        )
        yield counter_family(
            "kvguard_requests_rejected",
            "Requests the proxy refused with a 4xx of its own: over the window cap, or"
            " malformed or not forwardable; reason says which.",
            ["reason"],
            {**dict.fromkeys(REJECT_REASONS, 0), **counters.rejected},
        )
        yield counter_family(
            "kvguard_requests_cancelled",
            "Requests cancelled: the largest to free KV cache, answers past their"
            " reservation before the pool runs out, or left over by a drain.",
            ["reason"],
            counters.cancelled,
        )
        yield counter_family(
            "kvguard_proxy_errors",
            "Proxy answers of its own: 408, 413, 503 (body memory full), 502, 504.",
            ["code"],
            {**dict.fromkeys(PROXY_ERROR_CODES, 0), **counters.upstream_errors},
        )


# Per data-parallel engine: (family, help, EngineShare attribute). Separate families
# from the deployment-wide kvguard_kv_cache_usage_ratio / kvguard_requests_*, which
# keep their single unlabelled series.
SHARE_GAUGES = (
    (
        "kvguard_engine_kv_cache_usage_ratio",
        "KV cache in use on one data-parallel engine, 0-1.",
        "kv_cache_usage_ratio",
    ),
    (
        "kvguard_engine_requests_running",
        "Requests being processed by one data-parallel engine.",
        "requests_running",
    ),
    (
        "kvguard_engine_requests_waiting",
        "Requests queued in one data-parallel engine.",
        "requests_waiting",
    ),
)


def _engine_share_metrics(shares: tuple[EngineShare, ...]) -> Iterator[Metric]:
    """One series per data-parallel rank of this tick; a rank gone is simply not there."""
    if not shares:
        return
    for name, doc, attribute in SHARE_GAUGES:
        family = GaugeMetricFamily(name, doc, labels=["dp_rank"])
        for share in shares:
            value = getattr(share, attribute)
            if value is not None:
                family.add_metric([str(share.index)], value)
        yield family


def daemon_registry(daemon: Daemon) -> CollectorRegistry:
    """A fresh registry holding the daemon's collector (one per server, one per test)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(DaemonCollector(daemon))
    # kvguard's own process: process_cpu_seconds_total, process_resident_memory_bytes,
    # open file descriptors… (Linux /proc; nothing elsewhere).
    ProcessCollector(registry=registry)
    return registry
