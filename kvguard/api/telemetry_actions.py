"""Metrics of the asynchronous actuators (docs/metrics.md, "Actions on the engine").

Engine admin calls, the fp8 switch, the supervised engine and the webhooks.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvguard.actuators.engine_flags import FP8_DTYPE, FP8_FLAGS, kv_dtype_of
from kvguard.actuators.supervisor import RESTART_REASONS
from kvguard.api.metric_families import counter_family, gauge

if TYPE_CHECKING:
    from kvguard.runtime.daemon import Daemon


def actuator_metrics(daemon: Daemon) -> Iterator[Metric]:
    """Every actuator series the daemon has (none without actuators)."""
    yield from _dtype_info(daemon)
    actuators = daemon.actuators
    if actuators is not None:
        yield counter_family(
            "kvguard_action_results",
            "How asynchronous actions on the engine ended.",
            ["action", "result"],
            actuators.results,
        )
        yield GaugeMetricFamily(
            "kvguard_engine_paused",
            "1 while kvguard holds the engine paused (engine-side shed).",
            value=1.0 if actuators.paused else 0.0,
        )
        switch = actuators.switch_report()
        if switch is not None:
            yield counter_family(
                "kvguard_reconfigure",
                "fp8 KV switches (drain and restart) by action and result.",
                ["action", "result"],
                switch.results,
            )
            yield from gauge(
                "kvguard_drain_duration_seconds",
                "Duration of the last drain before a restart.",
                switch.last_drain_s,
            )
            if daemon.proxy is None:  # with the proxy, it counts drain cancellations itself
                yield counter_family(
                    "kvguard_requests_cancelled",
                    "Requests cancelled: left over by a drain.",
                    ["reason"],
                    {"drain": switch.cancelled},
                )
    supervisor = daemon.supervisor
    if supervisor is not None:
        yield counter_family(
            "kvguard_engine_restarts",
            "Restarts of the supervised engine by reason: crash, oom, reconfigure.",
            ["reason"],
            {**dict.fromkeys(RESTART_REASONS, 0), **supervisor.restarts_by_reason},
        )
        yield CounterMetricFamily(
            "kvguard_engine_oom",
            "CUDA out-of-memory errors in the supervised engine's output.",
            value=supervisor.ooms,
        )
    webhooks = daemon.webhooks
    if webhooks is not None:
        yield counter_family(
            "kvguard_webhook_deliveries",
            "Webhook events by result (per event and URL): sent, failed, dropped.",
            ["result"],
            webhooks.counters,
        )


def _dtype_info(daemon: Daemon) -> Iterator[Metric]:
    """The engine's KV dtype: as it reports it, else as kvguard last started it."""
    snapshot = daemon.state.snapshot
    dtype = snapshot.engine.cache_dtype if snapshot and snapshot.engine else None
    actuators = daemon.actuators
    switch = actuators.switch_report() if actuators is not None else None
    if dtype is None and actuators is not None and switch is not None:
        kind = actuators.kind or ""
        if switch.fp8:
            dtype = FP8_DTYPE.get(kind) or kv_dtype_of(FP8_FLAGS.get(kind, ()), kind)
        else:
            supervisor = daemon.supervisor
            dtype = kv_dtype_of(supervisor.argv, kind) if supervisor is not None else "auto"
    if dtype is None:
        return
    family = GaugeMetricFamily(
        "kvguard_kv_cache_dtype_info",
        "The engine's KV-cache data type (1 for the one in use).",
        labels=["dtype"],
    )
    family.add_metric([dtype], 1.0)
    yield family
