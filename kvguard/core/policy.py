"""The mitigation ladder: pressure levels with hysteresis, and what to do at each.

:func:`decide` is pure and deterministic: from the time, the forecast, the traffic
pattern, the policy and the previous :class:`GuardState`, it returns a
:class:`Decision` — the level, the :class:`Action` plan, the reasons and the next
state. Nothing here acts; the daemon records (dry run) or hands the plan to the
actuators.

Levels ``ok → elevated → high → critical``:

* **Entry**: a level's entry thresholds are crossed when KV usage, GPU free share or
  the preemption rate is past them, or when time to exhaustion is under its limit
  *and* usage is at least ``tte_min_usage`` (a trend alone never escalates, like
  node-exporter's filling-up alerts). The highest crossed level must hold for
  ``confirm_ticks`` ticks; then it is entered at once, even several levels up. KV
  usage is judged with the waiting queue's prompts included (demand); when demand
  reaches ``instant_kv_demand`` of the pool, escalation needs no confirmation.
* **Exit**: stepping down needs every signal below the current level's *exit*
  thresholds (entry minus a margin) for ``hold_s`` seconds, and goes down one level
  per hold time (kubelet's pressure transition period).

Per pattern, actions follow docs/how-it-works.md, "Policy: the ladder"; a disabled action falls
through to its fallback. ``elevated`` only alerts. ``kv_fp8`` follows pressure
(``high`` or worse) sustained for ``fp8_after_s``, at most ``max_restarts_per_hour``;
``revert_kv_fp8`` follows ``fp8_revert_calm_s`` of ``ok``. Every action kind has a
cooldown; mitigations no longer called for are undone with ``release``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Literal

from kvguard.core.forecast import Forecast
from kvguard.core.pattern import TrafficPattern

Level = Literal["ok", "elevated", "high", "critical"]
LEVELS: tuple[Level, ...] = ("ok", "elevated", "high", "critical")
ActionKind = Literal[
    "shed", "tighten_window", "evict", "cancel_largest", "kv_fp8", "revert_kv_fp8", "release"
]
ACTION_KINDS: tuple[ActionKind, ...] = (
    "shed",
    "tighten_window",
    "evict",
    "cancel_largest",
    "kv_fp8",
    "revert_kv_fp8",
    "release",
)
Priority = Literal["sheddable", "standard"]
# What limits the engine now: its KV cache, its compute (a queue with room in the
# cache), or nothing.
Binding = Literal["kv_cache", "compute", "none"]
BINDINGS: tuple[Binding, ...] = ("kv_cache", "compute", "none")


@dataclass(frozen=True)
class LevelThresholds:
    """When a level is entered: any one signal past its threshold (None: not used)."""

    kv_usage: float | None = None
    time_to_exhaustion_s: float | None = None
    gpu_free_ratio: float | None = None
    preemptions_per_s: float | None = None


@dataclass(frozen=True)
class PolicyConfig:
    """Every threshold, hold time and cooldown of the ladder (``[policy]``)."""

    elevated: LevelThresholds = LevelThresholds(0.80, 300.0, 0.10, 0.05)
    high: LevelThresholds = LevelThresholds(0.90, 60.0, 0.05, 0.5)
    critical: LevelThresholds = LevelThresholds(0.97, 15.0, 0.02, 2.0)
    tte_min_usage: float = 0.5
    confirm_ticks: int = 3
    instant_kv_demand: float = 1.0
    exit_usage_margin: float = 0.05
    exit_tte_factor: float = 2.0
    hold_s: float = 30.0
    window_share_high: float = 0.10
    window_share_critical: float = 0.05
    min_window_tokens: int = 512
    cooldowns_s: Mapping[str, float] = field(
        default_factory=lambda: {
            "shed": 5.0,
            "tighten_window": 10.0,
            "evict": 30.0,
            "cancel_largest": 10.0,
            "kv_fp8": 600.0,
            "revert_kv_fp8": 600.0,
            "release": 5.0,
        }
    )
    fp8_after_s: float = 300.0
    fp8_revert_calm_s: float = 1800.0
    max_restarts_per_hour: int = 2
    disabled: frozenset[str] = frozenset()

    def thresholds(self, level: Level) -> LevelThresholds | None:
        """Entry thresholds of ``level`` (None for ``ok``)."""
        return {"elevated": self.elevated, "high": self.high, "critical": self.critical}.get(level)


@dataclass(frozen=True)
class Action:
    """One step of a plan.

    ``shed`` drops requests of ``priority`` and below; ``tighten_window`` caps prompt
    and/or completion tokens; ``release`` undoes the mitigation named in ``target``.
    """

    kind: ActionKind
    reason: str
    priority: Priority | None = None
    max_prompt_tokens: int | None = None
    max_tokens: int | None = None
    target: str | None = None

    @property
    def key(self) -> str:
        """What the action mitigates: actions with the same key replace each other."""
        return self.target if self.kind == "release" and self.target else self.kind


@dataclass(frozen=True)
class Signals:
    """The inputs of one decision, as they appear in logs and /status."""

    kv_usage: float | None
    kv_demand: float | None  # (in use + queued prompts) / capacity: usage to come
    time_to_exhaustion_s: float
    gpu_free_ratio: float | None
    gpu_time_to_exhaustion_s: float
    preemptions_per_s: float | None
    kv_capacity_tokens: float | None
    queued_tokens: float | None = None  # the engine's waiting prompts, in tokens
    requests_waiting: float | None = None  # the engine's queue (sizes may be unknown)
    # A high quantile of recent requests' prompt + answer: a window cap never goes under.
    typical_request_tokens: int | None = None
    # Requests kvguard's proxy holds at the door for KV room (its own queue).
    admission_waiting: int = 0
    # The proxy's admission checks every request against the pool now: what goes
    # through it cannot fill the pool, so a KV trend alone is an alert, not a reason.
    admission_guards: bool = False


@dataclass(frozen=True)
class GuardState:
    """What the policy remembers between ticks."""

    level: Level = "ok"
    level_since: float = 0.0
    pending: Level | None = None
    pending_ticks: int = 0
    calm_since: float | None = None
    pressure_since: float | None = None  # level >= high continuously since
    ok_since: float | None = 0.0
    active: Mapping[str, Action] = field(default_factory=dict)
    last_action_at: Mapping[str, float] = field(default_factory=dict)
    restarts: tuple[float, ...] = ()
    fp8_on: bool = False


@dataclass(frozen=True)
class Decision:
    """The outcome of one tick of the policy."""

    t: float
    level: Level
    previous_level: Level
    pattern: TrafficPattern
    plan: tuple[Action, ...]
    crossed: tuple[str, ...]
    deferred: tuple[str, ...]
    signals: Signals
    state: GuardState
    binding: Binding = "none"


def binding_of(signals: Signals, policy: PolicyConfig) -> Binding:
    """Which resource limits the engine now, from what the engine is refusing.

    The KV cache binds when it turns work away: preemptions, requests kvguard's proxy
    holds at the door for KV room, a queue while the cache is past ``elevated``'s
    usage, or queued prompts that cannot fit the room left (demand over the whole
    pool). A queue
    with room in the cache is compute (the engine's batch limits or its speed): its
    queue is the right place for that work, and shedding on KV signals would only
    lose requests. A full cache with nothing waiting is a pool in use, not pressure.
    """
    if (signals.preemptions_per_s or 0.0) > 0:
        return "kv_cache"
    if signals.admission_waiting > 0:
        return "kv_cache"  # the proxy holds them at the door for want of KV room
    queued = (signals.queued_tokens or 0.0) > 0 or (signals.requests_waiting or 0.0) > 0
    if not queued:
        return "none"
    usage = signals.kv_usage
    nearly_full = policy.elevated.kv_usage if policy.elevated.kv_usage is not None else 0.8
    if usage is not None and usage >= nearly_full:
        return "kv_cache"
    demand = signals.kv_demand
    if demand is not None and demand >= 1:
        return "kv_cache"  # what waits cannot fit what is left, whatever runs now
    return "compute"


def signals_of(forecast: Forecast) -> Signals:
    """The decision's inputs from a forecast."""
    gpu = forecast.gpu
    free_ratio = None
    if gpu.level is not None and gpu.capacity:
        free_ratio = max(0.0, 1 - gpu.level / gpu.capacity)
    kv = forecast.kv
    demand = kv.level / kv.capacity if kv.level is not None and kv.capacity else None
    return Signals(
        kv_usage=forecast.kv_usage_ratio,
        kv_demand=demand,
        time_to_exhaustion_s=forecast.kv.time_to_exhaustion_s,
        gpu_free_ratio=free_ratio,
        gpu_time_to_exhaustion_s=gpu.time_to_exhaustion_s,
        preemptions_per_s=forecast.preemptions_per_s,
        kv_capacity_tokens=forecast.kv.capacity,
        queued_tokens=forecast.queue_demand_tokens,
        requests_waiting=forecast.requests_waiting,
    )


def crossed(
    signals: Signals,
    t: LevelThresholds,
    policy: PolicyConfig,
    *,
    exit_: bool = False,
    binding: Binding | None = None,
    level: Level = "elevated",
) -> list[str]:
    """The thresholds ``signals`` are past: entry thresholds, or (``exit_``) the lower exit ones.

    ``level`` is the level ``t`` belongs to. Past ``elevated`` (an alert), KV usage
    and demand count only while the KV cache binds (``binding``, :func:`binding_of`;
    None: not asked): a full pool nothing waits for, or a queue the cache has room
    for, is no reason to shed. Time to exhaustion (with usage past
    ``tte_min_usage``) may raise the level to ``high`` — acting before the pool
    fills is the point — but a trend alone never reaches ``critical``: there it
    counts only in a cache already past ``high``'s usage that binds. While the
    proxy's admission guards the pool (``signals.admission_guards``) the KV cache's
    trend counts only for ``elevated``.
    """
    out: list[str] = []
    margin = policy.exit_usage_margin if exit_ else 0.0
    factor = policy.exit_tte_factor if exit_ else 1.0
    kv_counts = level == "elevated" or binding in (None, "kv_cache")
    # Queued requests are admitted the moment blocks free, so usage to come (demand)
    # is judged like usage: a burst in the queue is pressure before it is in the cache.
    name, usage = "kv_usage", signals.kv_usage
    if signals.kv_demand is not None and (usage is None or signals.kv_demand > usage):
        name, usage = "kv_demand", signals.kv_demand
    if kv_counts and t.kv_usage is not None and usage is not None and usage >= t.kv_usage - margin:
        out.append(f"{name} {usage:.3f} >= {t.kv_usage - margin:.3f}")
    # The trend is what lets kvguard act before the pool fills (a cache that does not
    # bind yet will): it may raise the level to high on its own, never to critical
    # unless the cache is already past high's usage and binds.
    trend_floor = policy.tte_min_usage
    if level == "critical":
        trend_floor = max(trend_floor, policy.high.kv_usage or 0.0)
        if not kv_counts:
            usage = None
    if t.time_to_exhaustion_s is not None and usage is not None and usage >= trend_floor:
        limit = t.time_to_exhaustion_s * factor
        for name, tte in (
            ("kv", signals.time_to_exhaustion_s),
            ("gpu", signals.gpu_time_to_exhaustion_s),
        ):
            if name == "kv" and signals.admission_guards and level != "elevated":
                # Admission holds what goes through the proxy to the pool: the trend
                # cannot end in exhaustion through it, so it alerts and no more (on
                # traffic that fits, a rising saw-tooth shed requests for nothing).
                continue
            if tte <= limit:
                out.append(f"{name}_time_to_exhaustion {tte:.1f}s <= {limit:g}s")
    if t.gpu_free_ratio is not None and signals.gpu_free_ratio is not None:
        limit = t.gpu_free_ratio + (margin if exit_ else 0.0)
        if signals.gpu_free_ratio <= limit:
            out.append(f"gpu_free_ratio {signals.gpu_free_ratio:.3f} <= {limit:.3f}")
    rate = signals.preemptions_per_s
    if t.preemptions_per_s is not None and rate is not None:
        limit = t.preemptions_per_s / factor
        if rate > 0 and rate >= limit:
            out.append(f"preemptions {rate:.2f}/s >= {limit:g}/s")
    return out


def decide(
    now: float,
    forecast: Forecast,
    pattern: TrafficPattern,
    policy: PolicyConfig,
    state: GuardState,
    *,
    typical_request_tokens: int | None = None,
    admission_waiting: int = 0,
    admission_guards: bool = False,
) -> Decision:
    """One tick of the ladder: the new level, the plan and the next state.

    ``typical_request_tokens`` (a high quantile of recent requests' prompt + answer,
    when the proxy has seen enough) is the least a window cap leaves;
    ``admission_waiting`` counts the requests the proxy holds for KV room;
    ``admission_guards`` says the proxy's admission checks each request against the
    pool now (then the KV cache's time to exhaustion alone raises no further than
    ``elevated``).
    """
    signals = signals_of(forecast)
    signals = replace(
        signals,
        typical_request_tokens=typical_request_tokens,
        admission_waiting=admission_waiting,
        admission_guards=admission_guards,
    )
    binding = binding_of(signals, policy)
    # Requests the proxy holds at the door are the KV cache binding (so reported), but
    # admission already holds them to the pool: only what the engine itself shows (its
    # queue, preemptions) lets the KV signals raise the level, or the ladder would shed
    # on top of admission what admission would have let in moments later.
    engine_binding = binding_of(replace(signals, admission_waiting=0), policy)
    previous = state.level
    target, reasons = _target_level(signals, policy, engine_binding)
    level, state = _next_level(now, target, signals, policy, state, binding=engine_binding)
    plan, deferred, state = _plan(now, level, pattern, signals, policy=policy, state=state)
    return Decision(
        now, level, previous, pattern, plan, tuple(reasons), deferred, signals, state, binding
    )


def _target_level(
    signals: Signals, policy: PolicyConfig, binding: Binding
) -> tuple[Level, list[str]]:
    for level in reversed(LEVELS[1:]):
        thresholds = policy.thresholds(level)
        assert thresholds is not None  # noqa: S101 - every level but ok has thresholds
        found = crossed(signals, thresholds, policy, binding=binding, level=level)
        if found:
            return level, [f"{level}: {reason}" for reason in found]
    return "ok", []


def _next_level(
    now: float,
    target: Level,
    signals: Signals,
    policy: PolicyConfig,
    state: GuardState,
    *,
    binding: Binding,
) -> tuple[Level, GuardState]:
    current = state.level
    rank, target_rank = LEVELS.index(current), LEVELS.index(target)
    if target_rank > rank and (signals.kv_demand or 0.0) >= policy.instant_kv_demand:
        # The queue and the cache already exceed the pool: the next allocations will
        # preempt or fail. That is no noise to confirm; a burst fills a pool in < 1 s.
        return target, _entered(now, target, state)
    if target_rank > rank:
        # Escalation must hold for confirm_ticks consecutive ticks; the level entered is
        # the lowest one the whole streak agreed on, so more pressure never enters later.
        pending = target
        ticks = 1
        if state.pending is not None:
            pending = LEVELS[min(LEVELS.index(state.pending), target_rank)]
            ticks = state.pending_ticks + 1
        if ticks < policy.confirm_ticks:
            return current, replace(state, pending=pending, pending_ticks=ticks, calm_since=None)
        return pending, _entered(now, pending, state)
    state = replace(state, pending=None, pending_ticks=0)
    if current == "ok":
        return current, state
    thresholds = policy.thresholds(current)
    assert thresholds is not None  # noqa: S101 - current is not ok
    if crossed(signals, thresholds, policy, exit_=True, binding=binding, level=current):
        return current, replace(state, calm_since=None)
    calm_since = state.calm_since if state.calm_since is not None else now
    if now - calm_since < policy.hold_s:
        return current, replace(state, calm_since=calm_since)
    lower = LEVELS[rank - 1]  # one level per hold time, never straight back to ok
    return lower, _entered(now, lower, state)


def _entered(now: float, level: Level, state: GuardState) -> GuardState:
    pressured = LEVELS.index(level) >= LEVELS.index("high")
    return replace(
        state,
        level=level,
        level_since=now,
        pending=None,
        pending_ticks=0,
        calm_since=None,
        pressure_since=(state.pressure_since if state.pressure_since is not None else now)
        if pressured
        else None,
        ok_since=now if level == "ok" else None,
    )


# What each pattern calls for, per level (docs/how-it-works.md, "Policy: the ladder"); later
# entries add to earlier.
_LADDER: Mapping[str, Mapping[str, tuple[str, ...]]] = {
    "long_context": {"high": ("tighten_window",), "critical": ("evict", "cancel_largest")},
    "bursty_short": {"high": ("shed:sheddable",), "critical": ("shed:standard",)},
    "prefill_heavy": {
        "high": ("tighten_window:prompt", "shed:sheddable"),
        "critical": ("shed:standard",),
    },
    "decode_heavy": {
        "high": ("tighten_window:completion",),
        "critical": ("shed:standard", "cancel_largest"),
    },
    "steady": {"high": ("shed:sheddable",), "critical": ("shed:standard",)},
}
# When an action is disabled, the ladder falls through to the next in its chain.
_FALLBACK: Mapping[str, str] = {
    "tighten_window": "shed:sheddable",
    "evict": "cancel_largest",
    "cancel_largest": "shed:standard",
    "shed:sheddable": "",
    "shed:standard": "",
}


def _wanted(
    level: Level, pattern: TrafficPattern, signals: Signals, policy: PolicyConfig
) -> dict[str, Action]:
    """The mitigations that should be in force at ``level`` for ``pattern``."""
    steps: list[str] = []
    ladder = _LADDER.get(pattern, _LADDER["steady"])
    if level in ("high", "critical"):
        steps += ladder["high"]
    if level == "critical":
        steps += ladder["critical"]
    wanted: dict[str, Action] = {}
    for step in steps:
        action = _action(_enabled(step, policy), level, pattern, signals, policy)
        if action is not None:
            previous = wanted.get(action.kind)
            wanted[action.kind] = _stronger(previous, action) if previous else action
    return wanted


def _enabled(step: str, policy: PolicyConfig) -> str:
    """``step``, or the first enabled action down its fallback chain ("" if none)."""
    for _ in range(len(_FALLBACK) + 1):  # the chain is short and acyclic; bound it anyway
        kind = step.partition(":")[0]
        if not step or kind not in policy.disabled:
            return step
        step = _FALLBACK.get(step, _FALLBACK.get(kind, ""))
    return ""


def _action(
    step: str, level: Level, pattern: TrafficPattern, signals: Signals, policy: PolicyConfig
) -> Action | None:
    if not step:
        return None
    kind, _, detail = step.partition(":")
    reason = f"{level} pressure, {pattern} traffic"
    if kind == "shed":
        return Action("shed", reason, priority="standard" if detail == "standard" else "sheddable")
    if kind == "tighten_window":
        share = policy.window_share_critical if level == "critical" else policy.window_share_high
        capacity = signals.kv_capacity_tokens or 0.0
        # Never under what a typical request of the current traffic needs: a cap
        # below it refuses most requests (400), which loses them as a shed would.
        typical = signals.typical_request_tokens or 0
        cap = max(policy.min_window_tokens, math.floor(capacity * share), typical)
        return Action(
            "tighten_window",
            reason,
            max_prompt_tokens=cap if detail in ("", "prompt") else None,
            max_tokens=cap if detail in ("", "completion") else None,
        )
    if kind in ("evict", "cancel_largest"):
        return Action(kind, reason)  # type: ignore[arg-type]
    return None


def _stronger(a: Action, b: Action) -> Action:
    """Of two actions of one kind, the one that mitigates more (shed more, cap tighter)."""
    if a.kind == "shed":
        return b if b.priority == "standard" else a
    if a.kind == "tighten_window":

        def tight(x: int | None, y: int | None) -> int | None:
            return y if x is None else x if y is None else min(x, y)

        return replace(
            a,
            max_prompt_tokens=tight(a.max_prompt_tokens, b.max_prompt_tokens),
            max_tokens=tight(a.max_tokens, b.max_tokens),
        )
    return a


def _plan(
    now: float,
    level: Level,
    pattern: TrafficPattern,
    signals: Signals,
    *,
    policy: PolicyConfig,
    state: GuardState,
) -> tuple[tuple[Action, ...], tuple[str, ...], GuardState]:
    wanted = _wanted(level, pattern, signals, policy)
    plan: list[Action] = []
    deferred: list[str] = []
    active = dict(state.active)
    last = dict(state.last_action_at)

    def allowed(kind: str) -> bool:
        ready = now - last.get(kind, -math.inf) >= policy.cooldowns_s.get(kind, 0.0)
        if not ready:
            deferred.append(f"{kind}: cooldown")
        return ready

    for kind, action in wanted.items():
        current = active.get(kind)
        one_shot = kind in ("evict", "cancel_largest")
        if current == action and not one_shot:
            continue
        if allowed(kind):
            plan.append(action)
            last[kind] = now
            if not one_shot:
                active[kind] = action
    for kind in list(active):
        if kind not in wanted and allowed("release"):
            plan.append(
                Action("release", f"{level} pressure: {kind} no longer needed", target=kind)
            )
            last["release"] = now
            del active[kind]
    state = replace(state, active=active, last_action_at=last)
    fp8_action, state = _fp8(now, level, pattern, policy=policy, state=state, deferred=deferred)
    if fp8_action is not None:
        plan.append(fp8_action)
    return tuple(plan), tuple(deferred), state


def _fp8(
    now: float,
    level: Level,
    pattern: TrafficPattern,
    *,
    policy: PolicyConfig,
    state: GuardState,
    deferred: list[str],
) -> tuple[Action | None, GuardState]:
    recent = tuple(t for t in state.restarts if now - t < 3600.0)
    state = replace(state, restarts=recent)
    last = state.last_action_at
    if not state.fp8_on and "kv_fp8" not in policy.disabled and state.pressure_since is not None:
        if now - state.pressure_since < policy.fp8_after_s:
            return None, state
        if len(recent) >= policy.max_restarts_per_hour:
            deferred.append("kv_fp8: restart cap reached")
            return None, state
        if now - last.get("kv_fp8", -math.inf) < policy.cooldowns_s.get("kv_fp8", 0.0):
            deferred.append("kv_fp8: cooldown")
            return None, state
        reason = f"{level} pressure for {now - state.pressure_since:.0f}s with {pattern} traffic"
        return Action("kv_fp8", reason), replace(
            state, fp8_on=True, restarts=(*recent, now), last_action_at={**last, "kv_fp8": now}
        )
    if (
        state.fp8_on
        and "revert_kv_fp8" not in policy.disabled
        and level == "ok"
        and state.ok_since is not None
    ):
        if now - state.ok_since < policy.fp8_revert_calm_s:
            return None, state
        if len(recent) >= policy.max_restarts_per_hour:
            deferred.append("revert_kv_fp8: restart cap reached")
            return None, state
        reason = f"ok for {now - state.ok_since:.0f}s"
        return Action("revert_kv_fp8", reason), replace(
            state,
            fp8_on=False,
            restarts=(*recent, now),
            last_action_at={**last, "revert_kv_fp8": now},
        )
    return None, state
