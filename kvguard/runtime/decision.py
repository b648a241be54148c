"""The daemon's decision step: forecast, traffic pattern and ladder, every tick.

:class:`Brain` keeps the recent window of :class:`~kvguard.core.series.TickSample`
and the policy's :class:`~kvguard.core.policy.GuardState`, runs the pure core
(:mod:`kvguard.core.forecast`, :mod:`kvguard.core.pattern`,
:mod:`kvguard.core.policy`) on each snapshot, and keeps an audit trail: the last
50 decisions with their reasons, a count per action and mode, and one structured
log event per level change and per action. Live (the default), each plan is put in
force through :class:`~kvguard.actuators.mitigations.Mitigations`; with dry-run it is
computed, exported, logged and shown, and nothing is blocked or changed. An
operator's overrides (``/control/*``: :meth:`Brain.set_dry_run`, :meth:`Brain.release`)
change the mode and the ladder's memory here, and nowhere else.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Literal

import structlog

from kvguard.actuators.dispatch import KIND_NOT_KNOWN, NO_RESTART_CONFIGURED
from kvguard.actuators.mitigations import ASYNC_ACTIONS, Mitigations, Outcome
from kvguard.config.settings import Config
from kvguard.core import admission as admission_rules
from kvguard.core.forecast import Forecast, forecast
from kvguard.core.pattern import PatternReading, PatternThresholds, classify
from kvguard.core.policy import (
    ACTION_KINDS,
    Action,
    Decision,
    GuardState,
    PolicyConfig,
    decide,
)
from kvguard.core.series import TickSample, tick_sample
from kvguard.core.snapshot import Snapshot

log = structlog.get_logger("kvguard.brain")
Mode = Literal["dry_run", "applied", "started", "not_applied"]
DECISIONS_KEPT = 50
RETRY_AFTER_MAX_S = 60
# The mitigations an operator's release lifts from the ladder's memory too, so /status
# does not show them as active and the ladder re-applies them if pressure persists.
RELEASED_KINDS = frozenset({"shed", "tighten_window"})


@dataclass(frozen=True)
class DecisionRecord:
    """One entry of the audit trail: what was decided, why, and in which mode."""

    at: float  # wall-clock seconds (for people); the decision's own t is monotonic
    level: str
    previous_level: str
    pattern: str
    actions: tuple[Action, ...]
    crossed: tuple[str, ...]
    deferred: tuple[str, ...]
    mode: Mode
    signals: dict[str, Any]

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form for /status."""
        return {
            "at": self.at,
            "level": self.level,
            "previous_level": self.previous_level,
            "pattern": self.pattern,
            "actions": [action_dict(a) for a in self.actions],
            "crossed": list(self.crossed),
            "deferred": list(self.deferred),
            "mode": self.mode,
            "signals": self.signals,
        }


@dataclass(frozen=True)
class ControlOutcome:
    """What an operator's override (``/control/*``) did.

    ``changed``: whether anything changed; ``released``: the mitigations a release
    lifted; ``refused``: why nothing was done (the mode cannot change now), else None.
    """

    changed: bool
    released: tuple[str, ...] = ()
    refused: str | None = None


def action_dict(action: Action) -> dict[str, Any]:
    """An action's fields, without the ones that do not apply."""
    fields = {
        "kind": action.kind,
        "reason": action.reason,
        "priority": action.priority,
        "max_prompt_tokens": action.max_prompt_tokens,
        "max_tokens": action.max_tokens,
        "target": action.target,
    }
    return {k: v for k, v in fields.items() if v is not None}


class Brain:
    """Runs forecast → pattern → policy on each snapshot and remembers what it decided."""

    def __init__(
        self,
        config: Config,
        *,
        dry_run: bool = True,
        mitigations: Mitigations | None = None,
        on_event: Callable[[str, dict[str, Any]], None] | None = None,
    ) -> None:
        self.config = config
        self.dry_run = dry_run
        self.mitigations = mitigations or Mitigations()
        self.mitigations.enforcing = not dry_run
        # When an operator switched to dry-run (/control/dry-run); None: live, or dry-run
        # from the start. What the ladder records after it never ran (set_dry_run).
        self.dry_run_since: float | None = None
        self.samples: deque[TickSample] = deque()
        self.guard = GuardState()
        self.forecast: Forecast | None = None
        self.pattern: PatternReading | None = None
        self.decision: Decision | None = None
        self.decisions: deque[DecisionRecord] = deque(maxlen=DECISIONS_KEPT)
        self.counts: Counter[tuple[str, str]] = Counter()
        self._count_from_zero()
        # Actions the engine cannot take (kind -> why): the ladder falls through them.
        self.unavailable: dict[str, str] = {}
        self._said_unavailable: dict[str, str] = {}
        # Level changes and actions go here too (the webhooks), as (event, fields).
        # Where level changes and actions go out (the webhooks), if anywhere.
        self.on_event: Callable[[str, dict[str, Any]], None] = on_event or (
            lambda _event, _fields: None
        )

    @property
    def mode(self) -> Mode:
        """``dry_run`` with ``--dry-run`` (or ``[policy] dry_run``), else ``applied``."""
        return "dry_run" if self.dry_run else "applied"

    def reconfigure(self, config: Config) -> None:
        """Adopt a reloaded config; the history and the level are kept."""
        self.config = config

    def step(self, snapshot: Snapshot, wall_time: float) -> Decision:
        """Decide on one snapshot; record and log what changed."""
        config = self.config
        self.samples.append(tick_sample(snapshot))
        self._refresh_pool(snapshot)
        keep = max(config.forecast.window_s, config.pattern_window_s) + 5.0
        while self.samples and snapshot.taken_at - self.samples[0].t > keep:
            self.samples.popleft()
        samples = tuple(self.samples)
        if self.decision is None:
            # The level holds since kvguard's first tick, not since the clock's epoch
            # (the host's boot, for a monotonic clock): /status's level_for_s.
            self.guard = replace(self.guard, level_since=snapshot.taken_at)
        self.forecast = forecast(samples, config.forecast)
        self.pattern = classify(samples, PatternThresholds(window_s=config.pattern_window_s))
        typical = self.mitigations.typical_request_tokens
        held = self.mitigations.admission_waiting
        guards = self.mitigations.admission_guards
        decision = decide(
            snapshot.taken_at,
            self.forecast,
            self.pattern.pattern,
            self._policy(),
            self.guard,
            typical_request_tokens=typical() if typical is not None else None,
            admission_waiting=held() if held is not None else 0,
            admission_guards=guards() if guards is not None else False,
        )
        self.guard = decision.state
        self.decision = decision
        outcomes = self.mitigations.apply(decision.plan, decision.level, self._retry_after_s())
        if decision.plan or decision.level != decision.previous_level:
            self._record(decision, wall_time, [outcome for _, outcome in outcomes])
        return decision

    def _policy(self) -> PolicyConfig:
        """The configured ladder, minus what this engine cannot do (said once, with why)."""
        policy = self.config.policy
        for kind, why in self.unavailable.items():
            # Before the engine's kind is known nothing is said: it is known within a
            # tick or two of the engine answering, and then what it cannot do is said.
            if self._said_unavailable.get(kind) != why and why != KIND_NOT_KNOWN:
                # An opt-in left off (no restart configured for the fp8 switch) is how
                # every default start looks: said, not warned.
                say = log.info if why == NO_RESTART_CONFIGURED else log.warning
                say("action_unavailable", action=kind, reason=why, falls_through=True)
        for kind, why in self._said_unavailable.items():
            if kind not in self.unavailable and why != KIND_NOT_KNOWN:
                # Said unavailable once: the log must not be left saying so.
                log.info("action_available", action=kind, was_unavailable_because=why)
        self._said_unavailable = dict(self.unavailable)
        if not self.unavailable:
            return policy
        return replace(policy, disabled=policy.disabled | frozenset(self.unavailable))

    def fp8_result(self, *, fp8_on: bool) -> None:
        """Tell the ladder what the engine's KV cache really is after a switch ended.

        The ladder marks fp8 on when it decides ``kv_fp8``; a switch that failed or
        rolled back leaves the engine as it was, and the ladder must not later revert
        a switch that never happened (or forget one that did).
        """
        self.guard = replace(self.guard, fp8_on=fp8_on)

    def active_actions(self) -> list[dict[str, Any]]:
        """The actions the last decision left in force, JSON-ready (for /status)."""
        decision = self.decision
        if decision is None:
            return []
        return [action_dict(a) for a in decision.state.active.values()]

    # ------------------------------------------------------------------ operator overrides
    def set_dry_run(self, dry_run: bool, reason: str, *, now: float, fp8_on: bool) -> bool:
        """Switch to dry-run or live (``/control/dry-run|live``); True when the mode changed.

        ``now``: the monotonic time; ``fp8_on``: whether the engine's KV cache is 8-bit
        now, as the fp8 switch knows it (False without one). The mitigations stop or
        start being enforced; at a change the ladder forgets what never really ran
        (:meth:`_forget_unreal_actions`). Every (action, mode) series of the new mode
        is counted from 0.
        """
        changed = self.dry_run != dry_run
        self.mitigations.set_enforcing(not dry_run, reason)
        self.dry_run = dry_run
        if changed:
            self._forget_unreal_actions(fp8_on=fp8_on)
            self.dry_run_since = now if dry_run else None
        self._count_from_zero()
        return changed

    def release(self, reason: str) -> list[str]:
        """Lift every mitigation in force now (``/control/release``); the ones lifted.

        The ladder forgets the shed and the window cap too (:data:`RELEASED_KINDS`):
        it re-applies them if pressure persists, rather than believing them in force.
        """
        released = self.mitigations.release_all(reason)
        guard = self.guard
        self.guard = replace(
            guard, active={k: v for k, v in guard.active.items() if k not in RELEASED_KINDS}
        )
        return released

    def _forget_unreal_actions(self, *, fp8_on: bool) -> None:
        """Align the ladder's memory with what the actuators really did, at a mode switch.

        In dry-run the ladder records ``kv_fp8`` (and marks fp8 on) and the other
        asynchronous actions without any of them running; kept, they would make the
        first live ticks revert a switch that never happened. The engine's KV cache is
        ``fp8_on`` (what the fp8 switch says), and no asynchronous action is in force:
        the ladder decides them afresh. Going live, the cooldowns and the restart
        budget those unreal actions used since dry-run began are given back too: a
        first real switch must not wait out the cooldown of one that never ran.
        """
        self.fp8_result(fp8_on=fp8_on)
        guard = self.guard
        active = {k: v for k, v in guard.active.items() if k not in ASYNC_ACTIONS}
        if self.dry_run:
            self.guard = replace(guard, active=active)
            return
        since = self.dry_run_since if self.dry_run_since is not None else -math.inf
        self.guard = replace(
            guard,
            active=active,
            last_action_at={
                kind: at
                for kind, at in guard.last_action_at.items()
                if kind not in ASYNC_ACTIONS or at < since
            },
            restarts=tuple(at for at in guard.restarts if at < since),
        )

    def _count_from_zero(self) -> None:
        """Every (action, mode) series of the current mode from 0 (counts kept).

        A series that appears at its first increment is one increase() cannot see.
        """
        modes = ("dry_run",) if self.dry_run else ("applied", "started", "not_applied")
        for kind in ACTION_KINDS:
            for mode in modes:
                self.counts[(kind, mode)] += 0

    def _refresh_pool(self, snapshot: Snapshot) -> None:
        """Tell the admission path the engine's usable pool (None until it is known).

        A failed read keeps the last known pool: a scrape that times out because the
        engine is at its busiest must not open projected admission to everything
        waiting, at the worst moment. The pool's size changes only when the engine
        restarts, and the next good read reports that.
        """
        engine, source = snapshot.engine, snapshot.sources.get("engine")
        if engine is None or source is None or not source.ok:
            # The pool's size stays (it changes only with a restart); what the engine
            # held does not: a stale count would block admission as long as reads fail.
            self.mitigations.engine_used_tokens = None
            return
        blocks, block = engine.kv_capacity_blocks, engine.block_size
        pool: int | None
        if engine.kind == "vllm" and blocks and block:
            # vLLM counts one reserved null block in num_gpu_blocks; it holds no KV.
            # Data-parallel engines each have their own (their blocks are added up).
            pool = max(blocks - max(len(engine.engines), 1), 0) * block
        elif engine.kv_capacity_tokens is not None:
            # SGLang's max_total_num_tokens, TensorRT-LLM's max blocks x tokens per
            # block, llama.cpp's and TGI's figures: what requests can hold, as is.
            pool = engine.kv_capacity_tokens
        else:
            pool = blocks * block if blocks and block else None
        self.mitigations.block_size = block or 16
        self.mitigations.pool_tokens = pool
        self._refresh_exhaustion(engine.kind, engine.preemptions_total is not None)
        self.mitigations.engine_used_tokens = engine.kv_used_tokens
        # The operator's [model] max_model_len, else what the engine says it serves:
        # a request without max_tokens may write up to it (reserved so, not 512).
        self.mitigations.context_tokens = self.config.model.max_model_len or engine.context_tokens

    def _refresh_exhaustion(self, kind: str | None, reports_preemptions: bool) -> None:
        """Tell the proxy whether the engine preempts or fails when its pool runs out.

        Logged once per change (``kv_exhaustion_mode``): it decides whether kvguard
        cancels answers before the pool runs out.
        """
        mode, reason = admission_rules.kv_exhaustion(
            self.config.engine.on_kv_exhaustion, kind, reports_preemptions
        )
        mitigations = self.mitigations
        if (mode, reason) == (mitigations.kv_exhaustion, mitigations.kv_exhaustion_reason):
            return
        mitigations.kv_exhaustion, mitigations.kv_exhaustion_reason = mode, reason
        log.info(
            "kv_exhaustion_mode",
            on_kv_exhaustion=mode,
            reason=reason,
            overrun_cancel=mode == "fail",
        )

    def _retry_after_s(self) -> int:
        """Seconds until shed clients should retry: the excess demand over the drain rate."""
        fc, policy = self.forecast, self.config.policy
        fallback = int(policy.hold_s)
        if fc is None or fc.kv.level is None or not fc.kv.capacity or not fc.drain_per_s:
            return fallback
        excess = fc.kv.level - (policy.high.kv_usage or 0.9) * fc.kv.capacity
        if excess <= 0:
            return 1
        # OpenAI's SDK ignores Retry-After over 60 s (and retries at once): cap it there.
        return max(1, min(RETRY_AFTER_MAX_S, math.ceil(excess / fc.drain_per_s)))

    def _record(self, decision: Decision, wall_time: float, outcomes: list[Outcome]) -> None:
        signals = {
            "kv_usage": decision.signals.kv_usage,
            "kv_demand": decision.signals.kv_demand,
            "time_to_exhaustion_s": decision.signals.time_to_exhaustion_s,
            "gpu_free_ratio": decision.signals.gpu_free_ratio,
            "gpu_time_to_exhaustion_s": decision.signals.gpu_time_to_exhaustion_s,
            "preemptions_per_s": decision.signals.preemptions_per_s,
            "queued_tokens": decision.signals.queued_tokens,
            "admission_waiting": decision.signals.admission_waiting,
            "binding": decision.binding,
        }
        record = DecisionRecord(
            wall_time,
            decision.level,
            decision.previous_level,
            decision.pattern,
            decision.plan,
            decision.crossed,
            decision.deferred,
            self.mode,
            signals,
        )
        self.decisions.append(record)
        if decision.level != decision.previous_level:
            # `from_level`/`to_level`, never `level`: that key is the log line's severity.
            log.warning(
                "pressure_level_changed",
                from_level=decision.previous_level,
                to_level=decision.level,
                pattern=decision.pattern,
                crossed=list(decision.crossed),
                **signals,
            )
            self.on_event(
                "level_changed",
                {
                    "previous": decision.previous_level,
                    "level": decision.level,
                    "pattern": decision.pattern,
                    "crossed": list(decision.crossed),
                    **signals,
                },
            )
        for action, outcome in zip(decision.plan, outcomes, strict=True):
            # An action that did not take effect (no actuator, nothing to cancel) is never
            # reported as applied; one handed to an asynchronous actuator is "started" and
            # its result is counted when it ends.
            mode: Mode = "dry_run" if self.dry_run else outcome
            self.counts[(action.kind, mode)] += 1
            fields = {
                "mode": mode,
                "level": decision.level,
                "pattern": decision.pattern,
                "crossed": list(decision.crossed),
                **action_dict(action),
            }
            # The webhook keeps `level` (its documented payload); the log line names it
            # `pressure_level`, since its own `level` is the severity.
            log_fields = {k: v for k, v in fields.items() if k != "level"}
            log.warning("decision", pressure_level=decision.level, **log_fields)
            self.on_event("action", fields)
