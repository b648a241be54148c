"""The /status document: what the daemon knows now, as one JSON object.

:func:`status_document` builds it from the daemon's latest state (config redacted,
budget, snapshot, staleness, reconciliation, pressure, mitigations, proxy and the
asynchronous actuators). It only reads; the ``control`` section (the recent
``/control/*`` actions) is added by the route in :mod:`kvguard.api.app`.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from kvguard.api.budget_report import budget_to_dict
from kvguard.api.logs import json_finite

if TYPE_CHECKING:
    from kvguard.actuators.proxy.settings import ShedNote
    from kvguard.runtime.daemon import Daemon


def tick_age_s(daemon: Daemon) -> float | None:
    """Seconds since the last completed tick; None before the first."""
    last = daemon.state.last_tick_at
    return None if last is None else daemon.clock() - last


def status_document(daemon: Daemon) -> dict[str, Any]:
    """The /status JSON: config (redacted), budget, latest snapshot, staleness, reconciliation.

    Strict JSON: every non-finite number in it (a time to exhaustion that never comes is
    +Inf) is null, wherever it sits, so ``json.dumps(..., allow_nan=False)`` and strict
    parsers (``jq``, Go's, JavaScript's ``JSON.parse``) take it.
    """
    document: dict[str, Any] = json_finite(_document(daemon))
    return document


def _document(daemon: Daemon) -> dict[str, Any]:
    state = daemon.state
    snapshot = state.snapshot
    budget = None
    if state.budget is not None:
        model = daemon.config.model.config or ""
        gpu = "configured" if daemon.config.gpu.memory_bytes else "from NVML or default"
        budget = budget_to_dict(state.budget, model, gpu)
    rec = state.reconciliation
    return {
        "version": daemon.version,
        "dry_run": daemon.dry_run,
        "uptime_s": round(daemon.clock() - state.started_at, 3),
        "config": daemon.config.redacted(),
        "tick": {
            "count": state.ticks_total,
            "last_age_s": tick_age_s(daemon),
            "duration_s": state.tick_duration_s,
            "next_interval_s": daemon.next_interval(),
        },
        "sources": {
            name: asdict(reading)
            for name, reading in (snapshot.sources if snapshot else {}).items()
        },
        "engine": _engine(daemon),
        "gpus": [asdict(g) for g in snapshot.gpus] if snapshot and snapshot.gpus else None,
        "host": asdict(snapshot.host) if snapshot and snapshot.host else None,
        "budget": budget,
        "budget_error": state.budget_error,
        "pressure": _pressure(daemon),
        "mitigations": mitigations_dict(daemon),
        "proxy": _proxy(daemon),
        "actions": _actions(daemon),
        "reconciliation": None
        if rec is None
        else {
            "predicted_kv_capacity_tokens": rec.predicted_tokens,
            "reported_kv_capacity_tokens": rec.reported_tokens,
            "difference_tokens": rec.difference_tokens,
            "difference_ratio": rec.difference_ratio,
        },
    }


def mitigations_dict(daemon: Daemon) -> dict[str, Any]:
    """What is in force now (also the answer of every ``/control/*`` action)."""
    m = daemon.mitigations
    return {
        "enforcing": m.enforcing,
        "shed_floor": m.shed_floor,
        "max_prompt_tokens": m.max_prompt_tokens,
        "max_tokens": m.max_tokens,
        "retry_after_s": m.retry_after_s,
    }


def _pressure(daemon: Daemon) -> dict[str, Any] | None:
    brain = daemon.brain
    decision, fc, pattern = brain.decision, brain.forecast, brain.pattern
    if decision is None or fc is None or pattern is None:
        return None
    return {
        "mode": brain.mode,
        "level": decision.level,
        "level_for_s": round(decision.t - decision.state.level_since, 3),
        # What limits the engine: kv_cache, compute (a queue with room in the cache), none.
        "binding_resource": decision.binding,
        "crossed": list(decision.crossed),
        "deferred": list(decision.deferred),
        "pattern": pattern.pattern,
        "pattern_confidence": pattern.confidence,
        "pattern_features": dict(pattern.features),
        "forecast": {
            "kv_level_tokens": fc.kv.level,
            "kv_capacity_tokens": fc.kv.capacity,
            "kv_slope_tokens_per_s": fc.kv.slope_per_s,
            "kv_time_to_exhaustion_s": _finite(fc.kv.time_to_exhaustion_s),
            "kv_projected_tokens": {f"{h:g}": v for h, v in fc.kv.projected.items()},
            "gpu_time_to_exhaustion_s": _finite(fc.gpu.time_to_exhaustion_s),
            "queue_demand_tokens": fc.queue_demand_tokens,
            "prompt_fill_per_s": fc.prompt_fill_per_s,
            "generation_fill_per_s": fc.generation_fill_per_s,
            "drain_per_s": fc.drain_per_s,
            "preemptions_per_s": fc.preemptions_per_s,
        },
        "active": brain.active_actions(),
        # Their signals hold the times to exhaustion as the policy saw them (+Inf: not
        # rising): status_document writes them null.
        "decisions": [record.as_dict() for record in reversed(brain.decisions)],
    }


def _actions(daemon: Daemon) -> dict[str, Any] | None:
    """The asynchronous actuators: what this engine can do, and how it went."""
    actuators = daemon.actuators
    if actuators is None:
        return None
    switch, supervisor = actuators.switch_report(), daemon.supervisor
    return {
        "engine_kind": actuators.kind,
        "unavailable": dict(daemon.brain.unavailable),
        "engine_paused": actuators.paused,
        "results": [
            {"action": a, "result": r, "count": n}
            for (a, r), n in sorted(actuators.results.items())
        ],
        "reconfigure": None
        if switch is None
        else {
            "mode": switch.mode,
            "restarter": switch.restarter,
            "fp8": switch.fp8,
            "busy": switch.busy,
            "last_drain_s": switch.last_drain_s,
        },
        # The engine's argv can hold secrets (--api-key): only the program is shown.
        "supervisor": None
        if supervisor is None
        else {
            "program": supervisor.program,
            "pid": supervisor.pid,
            "restarts": supervisor.restarts_by_reason,
            "ooms": supervisor.ooms,
            "last_exit_code": supervisor.last_exit_code,
        },
        "webhooks": None if daemon.webhooks is None else dict(daemon.webhooks.counters),
    }


def _proxy(daemon: Daemon) -> dict[str, Any] | None:
    proxy = daemon.proxy
    if proxy is None:
        return None
    # The current budget's (it follows an fp8 switch and reloads), else what the proxy had.
    budget = daemon.state.budget
    mitigations = proxy.mitigations
    per_token = (
        budget.budget.kv_bytes_per_token_per_gpu if budget is not None else proxy.bytes_per_token
    )
    queue_s = proxy.admission_queue_s
    return {
        "listen": proxy.settings.listen,
        "upstream": proxy.settings.upstream,
        "inflight_requests": len(proxy.inflight),
        # Requests the proxy holds for room (not the engine's queue: engine.requests_waiting).
        "held_requests": proxy.waiting,
        "waiting_requests": proxy.waiting,  # deprecated: held_requests' old name
        # How long requests have waited for room without a break (None: none waits);
        # older than admission_wait_s it is overload, and a request waits less.
        "admission_queue_s": None if queue_s is None else round(queue_s, 3),
        # What it refused with 503 since kvguard started, and the last one's reason.
        "requests_shed": _shed_counts(proxy.counters.shed),
        "last_shed": _last_shed(proxy.counters.last_shed),
        "inflight_kv_tokens": proxy.inflight.total_tokens,
        "admission": proxy.settings.admission,
        # What admission holds for them: a quantile of their total under "observed".
        "reserved_kv_tokens": proxy.reserved_tokens,
        # Whether kvguard cancels answers before the pool runs out: for an engine that
        # fails then, not for one that preempts (it resumes the answer later).
        "on_kv_exhaustion": {
            "mode": mitigations.kv_exhaustion,
            "reason": mitigations.kv_exhaustion_reason,
            "overrun_cancel": mitigations.kv_exhaustion == "fail",
        },
        # What each kind of request's answers really use (the reservations of "observed").
        "answer_lengths": {
            "quantile": proxy.settings.reserve_quantile,
            "min_samples": proxy.settings.reserve_min_samples,
            "typical_request_tokens": proxy.lengths.typical_request_tokens(),
            "kinds": proxy.lengths.snapshot(),
        },
        # Ids and sizes only: prompt text never leaves the request path.
        "top_inflight": [
            {
                "request_id": r.request_id,
                "priority": r.priority,
                "prompt_tokens": r.prompt_tokens,
                "generated_tokens": r.generated,
                "kv_tokens": r.footprint_tokens,
                "projected_kv_tokens": r.projected_tokens,
                "reserved_output_tokens": r.reserved_output,
                "expected_output_tokens": (
                    None if r.expected_output is None else math.ceil(r.expected_output)
                ),
                "kv_bytes": r.footprint_tokens * per_token if per_token else None,
            }
            for r in proxy.inflight.top(10)
        ],
    }


def _shed_counts(shed: Counter[tuple[str, str]]) -> dict[str, Any]:
    by_priority: Counter[str] = Counter()
    by_reason: Counter[str] = Counter()
    for (priority, reason), count in shed.items():
        by_priority[priority] += count
        by_reason[reason] += count
    return {
        "total": sum(shed.values()),
        "by_priority": dict(sorted(by_priority.items())),
        "by_reason": dict(sorted(by_reason.items())),
    }


def _last_shed(note: ShedNote | None) -> dict[str, Any] | None:
    if note is None:
        return None
    return {
        "age_s": round(max(time.monotonic() - note.at, 0.0), 1),
        "priority": note.priority,
        "reason": note.reason,
        "detail": note.detail,
    }


def _finite(value: float) -> float | None:
    """JSON has no infinity: +Inf ("not rising") is null."""
    return value if math.isfinite(value) else None


def _engine(daemon: Daemon) -> dict[str, Any] | None:
    snapshot = daemon.state.snapshot
    if snapshot is None or snapshot.engine is None:
        return None
    data = asdict(snapshot.engine)
    data["actions"] = sorted(daemon.probes.engine.actions)
    return data
